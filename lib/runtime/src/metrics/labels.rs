//! Label sets the services' metrics share. Each value is one of a fixed few (`&'static str`), so
//! a family's series stay bounded; what the values are is said in the help of the metric that
//! uses the set.

use prometheus_client::encoding::EncodeLabelSet;

/// How a stream began: `snapshot` (no resume point), `resume`, `reset` (a resume point that could
/// not be honoured) or `lagged` (a stream fell out of the history and was sent a new snapshot).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StartLabels {
    pub start: &'static str,
}

/// A kind of thing (of object, of change, of transaction).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

/// How something ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

/// A kind of thing and how it ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindResultLabels {
    pub kind: &'static str,
    pub result: &'static str,
}

/// Why something failed.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

/// What was being done.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub op: &'static str,
}

/// What was being done, and why it failed.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    pub op: &'static str,
    pub reason: &'static str,
}
