//! The binder's CNI metrics: requests by operation and CNI code, their latency (by operation and
//! code too: a fast failure and a slow success must not blur into one histogram) in millisecond
//! buckets, how long ADD waited for the VIF to be known, and how long it then waited for the
//! plugged VIF to be ready (the backend's confirmation: at once for the embedded IPAM, Neutron's
//! ACTIVE for ports), and the time of each step of ADD and DEL ([`Steps`]: the request's checks,
//! the attachment record, the VIF lookup, the hand-off to a namespace worker, each netlink
//! request, the namespace entries, the report to the allocator), so that the time budget of a
//! CNI call can be read off the binder itself.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use kuryr_runtime::metrics::latency_histogram;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

kuryr_runtime::label_set! {
    struct OpStep { op, step }
    struct Stage { stage }
}

/// Buckets of the per-step histogram, in seconds: 10 µs to 1 s (a step is mostly well under a
/// millisecond).
const STEP_BUCKETS: &[f64] =
    &[0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0];

fn step_histogram() -> Histogram {
    Histogram::new(STEP_BUCKETS.iter().copied())
}

/// The time of each step of one CNI operation, in the order they ran, measured where they run
/// (the netlink steps on the namespace worker that sends them). A step that runs twice adds up.
#[derive(Clone, Debug)]
pub struct Steps {
    steps: Vec<(&'static str, Duration)>,
    last: Instant,
}

impl Default for Steps {
    fn default() -> Self {
        Self::start()
    }
}

impl Steps {
    /// Starts timing: the first [`Steps::mark`] measures from now.
    pub fn start() -> Self {
        Self { steps: Vec::with_capacity(16), last: Instant::now() }
    }

    /// Ends step `name`: the time since the previous mark (or the start).
    pub fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.add(name, now.duration_since(self.last));
        self.last = now;
    }

    /// Restarts the clock without recording (time that belongs to no step of ours).
    pub fn skip(&mut self) {
        self.last = Instant::now();
    }

    /// Records `took` for step `name` (measured elsewhere).
    pub fn add(&mut self, name: &'static str, took: Duration) {
        match self.steps.iter_mut().find(|(n, _)| *n == name) {
            Some((_, d)) => *d += took,
            None => self.steps.push((name, took)),
        }
    }

    /// Appends the steps of `other` (a sub-operation timed on its own).
    pub fn extend(&mut self, other: &Steps) {
        for (name, took) in &other.steps {
            self.add(name, *took);
        }
    }

    /// Each step and its time, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, Duration)> + '_ {
        self.steps.iter().copied()
    }

    /// `name=milliseconds` pairs separated by commas, for a log line: `parse=0.010,record=0.041`.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (name, took) in &self.steps {
            if !out.is_empty() {
                out.push(',');
            }
            let _ = write!(out, "{name}={:.3}", took.as_secs_f64() * 1e3);
        }
        out
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpCode {
    op: String,
    /// The CNI error code, "0" for success.
    code: String,
}

kuryr_runtime::metric_set! {
    /// CNI metrics; cheap to clone.
    pub struct CniMetrics {
        requests: Family<OpCode, Counter>
            => "kuryr_cni_requests", "CNI operations by operation and CNI result code (0: success)";
        duration: Family<OpCode, Histogram, fn() -> Histogram> = Family::new_with_constructor(latency_histogram)
            => "kuryr_cni_request_duration_seconds",
            "CNI operation duration in the binder, by operation and CNI result code";
        vif_wait: Histogram = latency_histogram()
            => "kuryr_cni_add_vif_wait_seconds", "Time ADD waited for the pod's VIF to be known";
        ready_wait: Histogram = latency_histogram()
            => "kuryr_cni_add_ready_wait_seconds",
            "Time ADD waited, once the VIF was plugged and reported, for the backend to make it ready";
        waiting: Family<Stage, Gauge>
            => "kuryr_cni_adds_waiting",
            "CNI ADDs waiting now, by stage: for the pod's VIF (vif), or, plugged, for the backend to make it ready \
             (ready)";
        steps: Family<OpStep, Histogram, fn() -> Histogram> = Family::new_with_constructor(step_histogram)
            => "kuryr_cni_step_duration_seconds",
            "Time of each step of successful CNI ADDs and DELs in the binder, by operation and step \
             (docs: docs/benchmarks.md)";
    }
}

impl CniMetrics {
    pub fn observe(&self, op: &str, code: Option<u32>, took: Duration) {
        let labels = OpCode { op: op.into(), code: code.unwrap_or(0).to_string() };
        self.requests.get_or_create(&labels).inc();
        self.duration.get_or_create(&labels).observe(took.as_secs_f64());
    }

    /// Counts an ADD as waiting at `stage` (`vif`, `ready`) until the returned guard is dropped.
    pub fn waiting(&self, stage: &'static str) -> Waiting {
        let gauge = self.waiting.get_or_create(&Stage { stage }).clone();
        gauge.inc();
        Waiting(gauge)
    }

    pub fn observe_vif_wait(&self, vif_wait: Duration) {
        self.vif_wait.observe(vif_wait.as_secs_f64());
    }

    pub fn observe_ready_wait(&self, ready_wait: Duration) {
        self.ready_wait.observe(ready_wait.as_secs_f64());
    }

    /// Records the steps of one successful operation.
    pub fn observe_steps(&self, op: &'static str, steps: &Steps) {
        for (step, took) in steps.iter() {
            self.steps.get_or_create(&OpStep { op, step }).observe(took.as_secs_f64());
        }
    }
}

/// An ADD counted in `kuryr_cni_adds_waiting` until dropped (whether the wait ends or the call is
/// cancelled).
#[derive(Debug)]
pub struct Waiting(Gauge);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::registry::Registry;

    use super::*;

    #[test]
    fn steps_add_up_in_order_and_render() {
        let mut s = Steps::start();
        s.add("parse", Duration::from_micros(10));
        s.add("plug", Duration::from_micros(500));
        s.add("parse", Duration::from_micros(5));
        let mut other = Steps::start();
        other.add("nl_veth", Duration::from_micros(250));
        s.extend(&other);
        let names: Vec<_> = s.iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["parse", "plug", "nl_veth"]);
        assert_eq!(s.render(), "parse=0.015,plug=0.500,nl_veth=0.250");
        s.mark("rest");
        assert!(s.iter().any(|(n, _)| n == "rest"));
    }

    #[test]
    fn steps_are_exposed_by_op_and_step() {
        let mut registry = Registry::default();
        let m = CniMetrics::register(&mut registry);
        let mut s = Steps::start();
        s.add("nl_veth", Duration::from_micros(300));
        m.observe_steps("ADD", &s);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains(r#"kuryr_cni_step_duration_seconds_count{op="ADD",step="nl_veth"} 1"#), "{text}");
    }

    #[test]
    fn waiting_adds_are_counted_until_their_guards_drop() {
        let mut registry = Registry::default();
        let m = CniMetrics::register(&mut registry);
        let render = |registry: &Registry| {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
            text
        };
        let (a, b) = (m.waiting("vif"), m.waiting("vif"));
        let ready = m.waiting("ready");
        let text = render(&registry);
        assert!(text.contains(r#"kuryr_cni_adds_waiting{stage="vif"} 2"#), "{text}");
        assert!(text.contains(r#"kuryr_cni_adds_waiting{stage="ready"} 1"#), "{text}");
        drop((a, ready));
        let text = render(&registry);
        assert!(text.contains(r#"kuryr_cni_adds_waiting{stage="vif"} 1"#), "{text}");
        assert!(text.contains(r#"kuryr_cni_adds_waiting{stage="ready"} 0"#), "{text}");
        drop(b);
        assert!(render(&registry).contains(r#"kuryr_cni_adds_waiting{stage="vif"} 0"#));
    }
}
