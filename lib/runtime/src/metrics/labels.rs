//! Label sets the services' metrics share, and [`label_set!`](crate::label_set) to declare more.
//! Each value is one of a fixed few (`&'static str`), so a family's series stay bounded; what
//! the values are is said in the help of the metric that uses the set.

/// Declares label sets whose every label is a `&'static str`: one of a fixed few values, so the
/// series of a family stay bounded.
///
/// ```
/// kuryr_runtime::label_set! {
///     /// Where a port came from.
///     pub struct PathLabels { path }
/// }
/// let _ = PathLabels { path: "pool" };
/// ```
#[macro_export]
macro_rules! label_set {
    ($( $(#[$meta:meta])* $vis:vis struct $name:ident { $( $(#[$fmeta:meta])* $field:ident ),+ $(,)? } )*) => {
        $(
            $(#[$meta])*
            #[derive(Clone, Debug, Hash, PartialEq, Eq, $crate::metrics::EncodeLabelSet)]
            $vis struct $name {
                $( $(#[$fmeta])* pub $field: &'static str, )+
            }
        )*
    };
}

crate::label_set! {
    /// How a stream began: `snapshot` (no resume point), `resume`, `reset` (a resume point that
    /// could not be honoured) or `lagged` (a stream fell out of the history and was sent a new
    /// snapshot).
    pub struct StartLabels { start }
    /// A kind of thing (of object, of change, of transaction).
    pub struct KindLabels { kind }
    /// How something ended.
    pub struct ResultLabels { result }
    /// A kind of thing and how it ended.
    pub struct KindResultLabels { kind, result }
    /// Why something failed.
    pub struct ReasonLabels { reason }
    /// What was being done.
    pub struct OpLabels { op }
    /// What was being done, and why it failed.
    pub struct FailureLabels { op, reason }
}
