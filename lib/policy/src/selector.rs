//! Label selector matching, as `metav1.LabelSelector` defines it: every `matchLabels` pair and
//! every `matchExpressions` requirement must hold (AND); the empty selector matches everything.

use crate::model::{LabelSelector, Labels, Operator, Requirement};

impl LabelSelector {
    /// The selector that matches everything (`{}`).
    pub fn everything() -> Self {
        Self::default()
    }

    /// Whether `labels` satisfy the selector.
    pub fn matches(&self, labels: &Labels) -> bool {
        self.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| r.matches(labels))
    }
}

impl Requirement {
    /// Whether `labels` satisfy the requirement. `NotIn` holds when the key is absent, as in
    /// Kubernetes; `In` with no values holds for nothing.
    pub fn matches(&self, labels: &Labels) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.contains(v)),
            Operator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn req(key: &str, operator: Operator, values: &[&str]) -> Requirement {
        Requirement { key: key.into(), operator, values: values.iter().map(|v| v.to_string()).collect() }
    }

    #[test]
    fn operators_follow_the_api() {
        let web = labels(&[("app", "web"), ("tier", "front")]);
        let bare = labels(&[]);
        let cases = [
            (req("app", Operator::In, &["web", "db"]), true, false),
            (req("app", Operator::In, &["db"]), false, false),
            (req("app", Operator::In, &[]), false, false),
            (req("app", Operator::NotIn, &["db"]), true, true),
            (req("app", Operator::NotIn, &["web"]), false, true),
            (req("tier", Operator::Exists, &[]), true, false),
            (req("tier", Operator::DoesNotExist, &[]), false, true),
        ];
        for (r, on_web, on_bare) in cases {
            assert_eq!(r.matches(&web), on_web, "{r:?} on {web:?}");
            assert_eq!(r.matches(&bare), on_bare, "{r:?} on no labels");
        }
    }

    #[test]
    fn labels_and_expressions_must_all_hold() {
        let sel = LabelSelector {
            match_labels: labels(&[("app", "web")]),
            match_expressions: vec![req("env", Operator::NotIn, &["prod"])],
        };
        assert!(sel.matches(&labels(&[("app", "web")])));
        assert!(sel.matches(&labels(&[("app", "web"), ("env", "dev")])));
        assert!(!sel.matches(&labels(&[("app", "web"), ("env", "prod")])));
        assert!(!sel.matches(&labels(&[("env", "dev")])));
        assert!(LabelSelector::everything().matches(&labels(&[])));
    }
}
