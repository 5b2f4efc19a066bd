//! Reading the services' Prometheus metrics in tests: scrape `/metrics` (over loopback, or with
//! curl inside a node's network namespace), parse the text format into series (name + labels →
//! value), and ask what moved between two scrapes.
//!
//! ```ignore
//! let before = Scrape::http(&cluster.allocator().metrics).await?;
//! // ... create pods ...
//! let after = Scrape::http(&cluster.allocator().metrics).await?;
//! after.moved(&before, "kuryr_allocator_allocations_total", &[]).at_least(2.0)?;
//! after.moved(&before, "kuryr_cni_requests_total", &[("op", "ADD"), ("code", "0")]).at_least(2.0)?;
//! ```
//!
//! Label filters match a subset: `&[("op", "ADD")]` sums every series of the name whose `op` is
//! `ADD`, whatever its other labels. A histogram is read through its `_count`, `_sum` and
//! `_bucket` series, which is how it is exposed.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};

/// One sample: a metric name, its labels and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// As exposed, including a `_total`, `_count`, `_sum` or `_bucket` suffix.
    pub name: String,
    /// Label name → value, unescaped.
    pub labels: BTreeMap<String, String>,
    /// The value (`NaN`, `+Inf` and `-Inf` included).
    pub value: f64,
}

impl Series {
    /// Whether every `(name, value)` of `filter` is among the labels.
    pub fn matches(&self, filter: &[(&str, &str)]) -> bool {
        filter.iter().all(|(k, v)| self.labels.get(*k).is_some_and(|l| l == v))
    }
}

impl fmt::Display for Series {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)?;
        if !self.labels.is_empty() {
            let labels: Vec<String> = self.labels.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
            write!(f, "{{{}}}", labels.join(","))?;
        }
        write!(f, " {}", self.value)
    }
}

/// Every series of one `/metrics` page.
#[derive(Clone, Debug, Default)]
pub struct Scrape {
    /// In page order.
    pub series: Vec<Series>,
    /// Where it was read (for messages).
    pub source: String,
}

impl Scrape {
    /// Parses the Prometheus (or OpenMetrics) text format. Comments and `# EOF` are skipped; a
    /// malformed sample line is an error naming it.
    pub fn parse(text: &str) -> Result<Scrape> {
        let mut series = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            series.push(parse_line(line).with_context(|| format!("metrics line {}: {line:?}", n + 1))?);
        }
        Ok(Scrape { series, source: String::new() })
    }

    /// Scrapes `addr` (`HOST:PORT`, or a URL; `/metrics` is added to a bare address).
    pub async fn http(addr: &str) -> Result<Scrape> {
        let url = metrics_url(addr);
        let resp = reqwest::Client::new()
            .get(&url)
            .timeout(std::time::Duration::from_secs(10))
            .send()
            .await
            .with_context(|| format!("GET {url}"))?;
        ensure!(resp.status().is_success(), "GET {url}: {}", resp.status());
        let text = resp.text().await.with_context(|| format!("GET {url}: reading the body"))?;
        let mut s = Scrape::parse(&text).with_context(|| format!("parsing {url}"))?;
        s.source = url;
        Ok(s)
    }

    /// Scrapes `addr` from inside the network namespace at `netns` (where a node's binder
    /// listens on its own loopback), with curl.
    pub async fn in_netns(netns: &Path, addr: &str) -> Result<Scrape> {
        let url = metrics_url(addr);
        let text = crate::node::netns_exec(netns, &["curl", "-sf", "--max-time", "10", &url])
            .await
            .with_context(|| format!("GET {url} in {}", netns.display()))?;
        let mut s = Scrape::parse(&text).with_context(|| format!("parsing {url} in {}", netns.display()))?;
        s.source = format!("{url} in {}", netns.display());
        Ok(s)
    }

    /// The series of `name` whose labels include `filter`.
    pub fn select<'a>(&'a self, name: &'a str, filter: &'a [(&'a str, &'a str)]) -> impl Iterator<Item = &'a Series> {
        self.series.iter().filter(move |s| s.name == name && s.matches(filter))
    }

    /// Whether any series of `name` is exposed.
    pub fn has(&self, name: &str) -> bool {
        self.select(name, &[]).next().is_some()
    }

    /// The sum of the series of `name` matching `filter`; 0 when there is none.
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.select(name, filter).map(|s| s.value).sum()
    }

    /// The value of the one series of `name` matching `filter`; an error when there is none or
    /// several.
    pub fn value(&self, name: &str, filter: &[(&str, &str)]) -> Result<f64> {
        let found: Vec<&Series> = self.select(name, filter).collect();
        match found.as_slice() {
            [one] => Ok(one.value),
            [] => bail!("no series {name} with {filter:?} at {}; {}", self.source, self.similar(name)),
            many => bail!("{} series {name} with {filter:?} at {}: {}", many.len(), self.source, list(many)),
        }
    }

    /// Observations of histogram `name` (its `_count`) matching `filter`, summed.
    pub fn count(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.sum(&format!("{name}_count"), filter)
    }

    /// The sum of observed values of histogram `name` (its `_sum`) matching `filter`.
    pub fn hist_sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.sum(&format!("{name}_sum"), filter)
    }

    /// How much the series of `name` matching `filter` grew since `before` (their sums).
    pub fn moved<'a>(&self, before: &Scrape, name: &'a str, filter: &'a [(&'a str, &'a str)]) -> Moved<'a> {
        Moved {
            name,
            filter,
            before: before.sum(name, filter),
            after: self.sum(name, filter),
            source: self.source.clone(),
        }
    }

    /// How many observations histogram `name` matching `filter` gained since `before`.
    pub fn moved_count<'a>(&self, before: &Scrape, name: &'a str, filter: &'a [(&'a str, &'a str)]) -> MovedCount<'a> {
        MovedCount(Moved {
            name,
            filter,
            before: before.count(name, filter),
            after: self.count(name, filter),
            source: self.source.clone(),
        })
    }

    /// The series whose names share `name`'s first two words, for error messages.
    fn similar(&self, name: &str) -> String {
        let stem: String = name.split('_').take(2).collect::<Vec<_>>().join("_");
        let near: Vec<&Series> = self.series.iter().filter(|s| s.name.starts_with(&stem)).take(40).collect();
        if near.is_empty() { format!("nothing named {stem}_*") } else { format!("there are: {}", list(&near)) }
    }
}

fn list(series: &[&Series]) -> String {
    series.iter().map(|s| s.to_string()).collect::<Vec<_>>().join("; ")
}

fn metrics_url(addr: &str) -> String {
    if addr.starts_with("http://") || addr.starts_with("https://") {
        if addr.trim_end_matches('/').ends_with("/metrics") { addr.to_string() } else { format!("{addr}/metrics") }
    } else {
        format!("http://{addr}/metrics")
    }
}

/// A change of a summed value between two scrapes; see [`Scrape::moved`].
#[derive(Clone, Debug)]
pub struct Moved<'a> {
    name: &'a str,
    filter: &'a [(&'a str, &'a str)],
    /// The sum before.
    pub before: f64,
    /// The sum after.
    pub after: f64,
    source: String,
}

impl Moved<'_> {
    /// After minus before.
    pub fn delta(&self) -> f64 {
        self.after - self.before
    }

    /// Fails unless the value grew by at least `n`.
    pub fn at_least(&self, n: f64) -> Result<f64> {
        self.expect(self.delta() >= n, &format!("at least {n}"))
    }

    /// Fails unless the value grew by exactly `n`.
    pub fn exactly(&self, n: f64) -> Result<f64> {
        self.expect(self.delta() == n, &format!("exactly {n}"))
    }

    /// The delta when `ok`, else an error saying what moved and what was `expected`.
    fn expect(&self, ok: bool, expected: &str) -> Result<f64> {
        ensure!(
            ok,
            "{} with {:?} at {} moved by {} ({} → {}), expected {expected}",
            self.name,
            self.filter,
            self.source,
            self.delta(),
            self.before,
            self.after
        );
        Ok(self.delta())
    }
}

/// A change of a histogram's observation count; see [`Scrape::moved_count`].
#[derive(Clone, Debug)]
pub struct MovedCount<'a>(Moved<'a>);

impl MovedCount<'_> {
    /// Observations gained.
    pub fn delta(&self) -> f64 {
        self.0.delta()
    }

    /// Fails unless at least `n` observations were made.
    pub fn at_least(&self, n: f64) -> Result<f64> {
        self.0.at_least(n).context("histogram observations (_count)")
    }

    /// Fails unless exactly `n` observations were made.
    pub fn exactly(&self, n: f64) -> Result<f64> {
        self.0.exactly(n).context("histogram observations (_count)")
    }
}

/// `name{labels} value [timestamp]`.
fn parse_line(line: &str) -> Result<Series> {
    let name_end = line.find(['{', ' ', '\t']).context("no value")?;
    let name = &line[..name_end];
    ensure!(
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
        "bad metric name {name:?}"
    );
    let mut rest = line[name_end..].trim_start();
    let mut labels = BTreeMap::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(after_brace)?;
        labels = parsed;
        rest = after;
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().context("no value")?;
    let value = parse_value(value)?;
    if let Some(ts) = fields.next() {
        ts.parse::<f64>().with_context(|| format!("bad timestamp {ts:?}"))?;
    }
    ensure!(fields.next().is_none(), "trailing text after the value");
    Ok(Series { name: name.to_string(), labels, value })
}

/// The labels after `{`, up to and including `}`; returns them and what follows.
fn parse_labels(mut s: &str) -> Result<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start();
        if let Some(after) = s.strip_prefix('}') {
            return Ok((labels, after));
        }
        let eq = s.find('=').context("a label without '='")?;
        let key = s[..eq].trim();
        ensure!(
            !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "bad label name {key:?}"
        );
        let after_eq = s[eq + 1..].trim_start();
        let mut chars = after_eq.char_indices();
        ensure!(matches!(chars.next(), Some((_, '"'))), "the value of label {key} is not quoted");
        let mut value = String::new();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    other => bail!("bad escape in label {key}: {other:?}"),
                },
                '"' => {
                    end = Some(i);
                    break;
                }
                c => value.push(c),
            }
        }
        let end = end.with_context(|| format!("the value of label {key} is not terminated"))?;
        ensure!(labels.insert(key.to_string(), value).is_none(), "label {key} twice");
        s = after_eq[end + 1..].trim_start();
        s = s.strip_prefix(',').unwrap_or(s);
    }
}

fn parse_value(v: &str) -> Result<f64> {
    Ok(match v {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse().with_context(|| format!("bad value {v:?}"))?,
    })
}

/// The value of one sample (`name{labels}` exactly as exposed); 0 when absent.
pub fn metric(text: &str, sample: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits until sample `sample` ([`metric`]) reads `want` in the exposition `scrape` returns, and
/// returns that exposition. A counter moves after the work it counts is visible to others (an
/// API write lands before its writer counts it), so a test that saw the work waits for the count
/// rather than reading it once. The error carries the last exposition read.
pub async fn wait_metric<F, Fut>(sample: &str, want: f64, timeout: std::time::Duration, scrape: F) -> Result<String>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<String>>,
{
    crate::services::wait_until(&format!("{sample} to read {want}"), timeout, || async {
        let text = scrape().await?;
        let got = metric(&text, sample);
        ensure!(got == want, "{sample} reads {got}\n{text}");
        Ok(text)
    })
    .await
}

/// The sum of every sample of metric `name` whose labels contain each of `labels`
/// (`key="value"` strings).
pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.split(['{', ' ']).next() == Some(name))
        .filter(|l| labels.iter().all(|w| l.contains(w)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP kuryr_cni_requests CNI operations by operation and CNI result code (0: success).
# TYPE kuryr_cni_requests counter
kuryr_cni_requests_total{op="ADD",code="0"} 3
kuryr_cni_requests_total{op="ADD",code="11"} 1
kuryr_cni_requests_total{op="DEL",code="0"} 4
# TYPE kuryr_allocator_queue_depth gauge
kuryr_allocator_queue_depth 0
# TYPE kuryr_cni_request_duration_seconds histogram
kuryr_cni_request_duration_seconds_sum{op="ADD",code="0"} 0.0123
kuryr_cni_request_duration_seconds_count{op="ADD",code="0"} 3
kuryr_cni_request_duration_seconds_bucket{le="0.005",op="ADD",code="0"} 1
kuryr_cni_request_duration_seconds_bucket{le="+Inf",op="ADD",code="0"} 3
weird{msg="a \"quoted\", {braced} \\ value\nnext",x="1"} NaN 1700000000
spaced { a = "1" , b="2" , } -Inf
# EOF
"#;

    #[test]
    fn parses_names_labels_values_and_escapes() {
        let s = Scrape::parse(PAGE).unwrap();
        assert_eq!(s.series.len(), 10);
        let w = s.select("weird", &[]).next().unwrap();
        assert_eq!(w.labels["msg"], "a \"quoted\", {braced} \\ value\nnext");
        assert_eq!(w.labels["x"], "1");
        assert!(w.value.is_nan());
        let sp = s.select("spaced", &[("a", "1"), ("b", "2")]).next().unwrap();
        assert_eq!(sp.value, f64::NEG_INFINITY);
        let inf = s.select("kuryr_cni_request_duration_seconds_bucket", &[("le", "+Inf")]).next().unwrap();
        assert_eq!(inf.value, 3.0);
    }

    #[test]
    fn sums_by_label_subset_and_reads_histograms() {
        let s = Scrape::parse(PAGE).unwrap();
        assert_eq!(s.sum("kuryr_cni_requests_total", &[]), 8.0);
        assert_eq!(s.sum("kuryr_cni_requests_total", &[("op", "ADD")]), 4.0);
        assert_eq!(s.sum("kuryr_cni_requests_total", &[("op", "ADD"), ("code", "11")]), 1.0);
        assert_eq!(s.sum("kuryr_cni_requests_total", &[("op", "GC")]), 0.0);
        assert_eq!(s.sum("kuryr_cni_requests", &[]), 0.0, "a name is matched whole, not as a prefix");
        assert_eq!(s.value("kuryr_allocator_queue_depth", &[]).unwrap(), 0.0);
        assert!(s.value("kuryr_cni_requests_total", &[("op", "ADD")]).is_err(), "two series match");
        let missing = s.value("kuryr_cni_nothing", &[]).unwrap_err().to_string();
        assert!(missing.contains("kuryr_cni_requests_total"), "the message lists similar series: {missing}");
        assert_eq!(s.count("kuryr_cni_request_duration_seconds", &[("op", "ADD")]), 3.0);
        assert!((s.hist_sum("kuryr_cni_request_duration_seconds", &[]) - 0.0123).abs() < 1e-12);
        assert!(s.has("kuryr_allocator_queue_depth"));
        assert!(!s.has("kuryr_allocator_queue"));
    }

    #[test]
    fn moved_between_scrapes() {
        let before = Scrape::parse(PAGE).unwrap();
        let after = Scrape::parse(&PAGE.replace(r#"{op="ADD",code="0"} 3"#, r#"{op="ADD",code="0"} 5"#)).unwrap();
        let adds = [("op", "ADD"), ("code", "0")];
        assert_eq!(after.moved(&before, "kuryr_cni_requests_total", &adds).at_least(2.0).unwrap(), 2.0);
        assert!(after.moved(&before, "kuryr_cni_requests_total", &adds).at_least(3.0).is_err());
        assert!(after.moved(&before, "kuryr_cni_requests_total", &[("op", "DEL")]).at_least(1.0).is_err());
        after.moved(&before, "kuryr_cni_requests_total", &[("op", "DEL")]).exactly(0.0).unwrap();
        let hist = after.moved_count(&before, "kuryr_cni_request_duration_seconds", &adds);
        assert_eq!(hist.at_least(2.0).unwrap(), 2.0);
        let err = after.moved(&before, "kuryr_cni_requests_total", &adds).at_least(9.0).unwrap_err().to_string();
        assert!(err.contains("3 → 5"), "{err}");
    }

    #[test]
    fn malformed_lines_are_named() {
        for bad in ["name{a=\"1\"", "name{a=1} 2", "name{a=\"1\"} x", "bad-name 1", "name{a=\"1\",a=\"2\"} 1", "name"] {
            let err = Scrape::parse(&format!("ok 1\n{bad}\n")).unwrap_err();
            assert!(format!("{err:#}").contains("line 2"), "{bad}: {err:#}");
        }
    }

    #[test]
    fn urls() {
        assert_eq!(metrics_url("127.0.0.1:9611"), "http://127.0.0.1:9611/metrics");
        assert_eq!(metrics_url("http://127.0.0.1:9611"), "http://127.0.0.1:9611/metrics");
        assert_eq!(metrics_url("http://127.0.0.1:9611/metrics"), "http://127.0.0.1:9611/metrics");
    }

    #[test]
    fn metrics_are_read_by_sample_and_summed_by_label() {
        let text = "# HELP openstack_requests_total x\n\
            openstack_requests_total{service=\"network\",operation=\"ports.update\",method=\"PUT\",code=\"200\"} 3\n\
            openstack_requests_total{service=\"network\",operation=\"ports.list\",method=\"GET\",code=\"200\"} 5\n\
            openstack_requests_total{service=\"identity\",operation=\"tokens.create\",method=\"POST\",code=\"201\"} 1\n\
            openstack_requests_total_extra 9\n\
            kuryr_allocator_neutron_status_polls_total 7\n";
        assert_eq!(metric_sum(text, "openstack_requests_total", &[r#"service="network""#]), 8.0);
        assert_eq!(metric_sum(text, "openstack_requests_total", &[r#"operation="ports.update""#]), 3.0);
        assert_eq!(metric_sum(text, "openstack_requests_total", &[]), 9.0);
        assert_eq!(metric(text, "kuryr_allocator_neutron_status_polls_total"), 7.0);
        assert_eq!(metric(text, "kuryr_allocator_neutron_status_polls"), 0.0, "a prefix is not a sample");
    }
}
