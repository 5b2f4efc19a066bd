//! [`metric_set!`](crate::metric_set): a struct of metrics declared once, each field with its
//! Prometheus name and help next to it, instead of three times (the field, its constructor, its
//! registration).

/// Declares a struct of Prometheus metrics, cheap to clone (each field is a handle to shared
/// state), with
/// - `Default`: every metric made but exported nowhere (for tests and for parts built without a
///   registry); a field is made with `Default::default()` unless `= EXPR` says how;
/// - `register(&mut Registry) -> Self`: the same, each field registered under its name and help,
///   and each set named in `nested { .. }` made by its own `register`.
///
/// ```
/// use prometheus_client::metrics::{counter::Counter, histogram::Histogram};
///
/// kuryr_runtime::metric_set! {
///     /// What the example counts.
///     pub struct Example {
///         /// Things done.
///         pub done: Counter => "example_done", "Things done";
///         /// How long each took.
///         pub took: Histogram = kuryr_runtime::metrics::latency_histogram()
///             => "example_seconds", "How long each thing took";
///     }
/// }
///
/// let mut registry = prometheus_client::registry::Registry::default();
/// let m = Example::register(&mut registry);
/// m.done.inc();
/// let mut text = String::new();
/// prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
/// assert!(text.contains("example_done_total 1"));
/// ```
#[macro_export]
macro_rules! metric_set {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[$fmeta:meta])*
                $fvis:vis $field:ident : $ty:ty $(= $init:expr)? => $metric:literal, $help:literal;
            )*
        }
        $(nested {
            $( $(#[$nmeta:meta])* $nvis:vis $nfield:ident : $nty:ty, )*
        })?
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug)]
        $vis struct $name {
            $( $(#[$fmeta])* $fvis $field: $ty, )*
            $($( $(#[$nmeta])* $nvis $nfield: $nty, )*)?
        }

        impl ::core::default::Default for $name {
            fn default() -> Self {
                Self {
                    $( $field: $crate::metric_set!(@make $ty $(, $init)?), )*
                    $($( $nfield: <$nty as ::core::default::Default>::default(), )*)?
                }
            }
        }

        impl $name {
            /// Creates the metrics and registers them.
            #[allow(clippy::needless_update)]
            pub fn register(registry: &mut $crate::metrics::Registry) -> Self {
                let m = Self { $($( $nfield: <$nty>::register(registry), )*)? ..Self::default() };
                $( registry.register($metric, $help, m.$field.clone()); )*
                m
            }
        }
    };
    (@make $ty:ty) => { <$ty as ::core::default::Default>::default() };
    (@make $ty:ty, $init:expr) => { $init };
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::Histogram;
    use prometheus_client::registry::Registry;

    use crate::metrics::{MethodLabels, latency_histogram};

    crate::metric_set! {
        struct Inner {
            seen: Gauge => "inner_seen", "Things seen";
        }
    }

    crate::metric_set! {
        struct Outer {
            calls: Family<MethodLabels, Counter> => "outer_calls", "Calls";
            took: Family<MethodLabels, Histogram, fn() -> Histogram> = Family::new_with_constructor(latency_histogram)
                => "outer_seconds", "Time of calls";
        }
        nested {
            inner: Inner,
        }
    }

    fn encode(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap_or_default();
        text
    }

    #[test]
    fn every_field_and_nested_set_is_registered_under_its_name() {
        let mut registry = Registry::default();
        let m = Outer::register(&mut registry);
        let labels = MethodLabels { service: "s".into(), method: "m".into() };
        m.calls.get_or_create(&labels).inc();
        m.took.get_or_create(&labels).observe(0.0007);
        m.inner.seen.set(3);
        let text = encode(&registry);
        assert!(text.contains("# HELP outer_calls Calls."), "{text}");
        assert!(text.contains(r#"outer_calls_total{service="s",method="m"} 1"#), "{text}");
        assert!(text.contains(r#"outer_seconds_bucket{le="0.001",service="s",method="m"} 1"#), "{text}");
        assert!(text.contains("inner_seen 3"), "{text}");
    }

    #[test]
    fn a_default_set_counts_but_is_exported_nowhere() {
        let registry = Registry::default();
        let m = Outer::default();
        m.inner.seen.set(1);
        assert_eq!(m.inner.seen.get(), 1);
        assert_eq!(encode(&registry).trim(), "# EOF");
    }
}
