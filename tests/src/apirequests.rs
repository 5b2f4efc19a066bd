//! The API server's request counters (`apiserver_request_total` on its `/metrics`), summed by
//! verb and resource, for benchmarks that say which requests a workload cost.

use std::collections::{BTreeMap, HashMap};

use anyhow::{Context, Result};

/// `apiserver_request_total`, summed by (verb, resource[/subresource]).
pub type Requests = BTreeMap<(String, String), f64>;

/// The API server's request counters now (its `/metrics`, read with the given client).
pub async fn apiserver_requests(client: &kube::Client) -> Result<Requests> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(req).await.context("GET /metrics of the API server")?;
    Ok(request_totals(&text))
}

/// Sums the `apiserver_request_total` series of a metrics page by (verb, resource[/subresource]).
pub fn request_totals(text: &str) -> Requests {
    let mut out = Requests::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else { continue };
        let Some((labels, value)) = rest.rsplit_once("} ") else { continue };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        let labels: HashMap<&str, &str> = labels
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.trim(), v.trim().trim_matches('"')))
            .collect();
        let get = |k: &str| labels.get(k).copied().unwrap_or_default();
        let resource = match get("subresource") {
            "" => get("resource").to_string(),
            sub => format!("{}/{sub}", get("resource")),
        };
        *out.entry((get("verb").to_string(), resource)).or_default() += value;
    }
    out
}

/// What was counted between `before` and `after`, largest first, without zeros.
pub fn requests_between(before: &Requests, after: &Requests) -> Vec<((String, String), f64)> {
    let mut v: Vec<_> = after
        .iter()
        .map(|(k, a)| (k.clone(), a - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d > 0.0)
        .collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_by_verb_and_resource_and_subtracts() {
        let page = |n: u32| {
            format!(
                "# HELP apiserver_request_total x\n\
                 apiserver_request_total{{code=\"200\",resource=\"pods\",subresource=\"\",verb=\"GET\"}} {n}\n\
                 apiserver_request_total{{code=\"404\",resource=\"pods\",subresource=\"\",verb=\"GET\"}} 1\n\
                 apiserver_request_total{{code=\"200\",resource=\"pods\",subresource=\"status\",verb=\"PATCH\"}} 3\n\
                 apiserver_request_duration_seconds_count{{verb=\"GET\"}} 99\n"
            )
        };
        let before = request_totals(&page(2));
        assert_eq!(before.get(&("GET".into(), "pods".into())), Some(&3.0));
        assert_eq!(before.get(&("PATCH".into(), "pods/status".into())), Some(&3.0));
        assert_eq!(before.len(), 2);
        let after = request_totals(&page(7));
        assert_eq!(requests_between(&before, &after), vec![(("GET".to_string(), "pods".to_string()), 5.0)]);
    }
}
