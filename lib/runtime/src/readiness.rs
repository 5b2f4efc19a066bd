//! Readiness as a set of named conditions: a service is SERVING only while every one holds (its
//! records loaded, its upstream stream live, ...). Each service names its conditions in an enum
//! ([`Conditions`]); a driver task keeps the health of its gRPC services in line with them and
//! logs each change once, naming what is missing.

use std::fmt::Debug;

use tokio::sync::watch;
use tracing::Instrument as _;

use crate::{Health, Shutdown};

/// A service's readiness conditions: an enum listing them all in [`Conditions::ALL`] (at most 64).
pub trait Conditions: Copy + Debug + PartialEq + Send + Sync + 'static {
    /// Every condition.
    const ALL: &'static [Self];

    /// What the condition is, as the "not serving" log line names it ("a live watcher stream").
    fn describe(self) -> &'static str;
}

/// Which conditions hold; cheap to clone.
#[derive(Debug)]
pub struct Readiness<C: Conditions> {
    /// Bit `i` set: `C::ALL[i]` holds.
    met: watch::Sender<u64>,
    _conditions: std::marker::PhantomData<C>,
}

impl<C: Conditions> Clone for Readiness<C> {
    fn clone(&self) -> Self {
        Self { met: self.met.clone(), _conditions: std::marker::PhantomData }
    }
}

impl<C: Conditions> Default for Readiness<C> {
    fn default() -> Self {
        Self { met: watch::Sender::new(0), _conditions: std::marker::PhantomData }
    }
}

fn bit<C: Conditions>(c: C) -> u64 {
    C::ALL.iter().position(|x| *x == c).map_or(0, |i| 1 << i)
}

fn all<C: Conditions>() -> u64 {
    C::ALL.iter().fold(0, |acc, c| acc | bit(*c))
}

impl<C: Conditions> Readiness<C> {
    /// Marks `condition` as holding or not.
    pub fn set(&self, condition: C, holds: bool) {
        let b = bit(condition);
        self.met.send_if_modified(|m| {
            let before = *m;
            if holds {
                *m |= b;
            } else {
                *m &= !b;
            }
            *m != before
        });
    }

    /// Whether `condition` holds.
    pub fn holds(&self, condition: C) -> bool {
        *self.met.borrow() & bit(condition) != 0
    }

    /// Whether every condition holds.
    pub fn ready(&self) -> bool {
        *self.met.borrow() == all::<C>()
    }

    /// The conditions that do not hold.
    pub fn missing(&self) -> Vec<C> {
        let met = *self.met.borrow();
        C::ALL.iter().copied().filter(|c| met & bit(*c) == 0).collect()
    }

    /// Registers `services` (NOT_SERVING) and keeps their health in line with the conditions
    /// until shutdown (after which the runtime marks everything NOT_SERVING itself).
    pub fn spawn_driver(&self, health: Health, services: &'static [&'static str], shutdown: Shutdown) {
        let mut rx = self.met.subscribe();
        let this = self.clone();
        let drive = async move {
            for svc in services {
                health.register(svc).await;
            }
            let mut last = None;
            loop {
                rx.borrow_and_update();
                let ready = this.ready();
                if last != Some(ready) && !shutdown.is_triggered() {
                    if ready {
                        tracing::info!(conditions = ?C::ALL, "every condition holds: serving");
                    } else {
                        let missing: Vec<&str> = this.missing().into_iter().map(C::describe).collect();
                        tracing::info!(?missing, "not serving");
                    }
                    for svc in services {
                        if ready {
                            health.set_serving(svc).await;
                        } else {
                            health.set_not_serving(svc).await;
                        }
                    }
                    last = Some(ready);
                }
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { return },
                    () = shutdown.clone().wait() => return,
                }
            }
        };
        tokio::spawn(drive.instrument(tracing::info_span!("readiness")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Cond {
        Loaded,
        Live,
    }

    impl Conditions for Cond {
        const ALL: &'static [Self] = &[Cond::Loaded, Cond::Live];
        fn describe(self) -> &'static str {
            match self {
                Cond::Loaded => "the records",
                Cond::Live => "a live stream",
            }
        }
    }

    #[test]
    fn ready_only_while_every_condition_holds() {
        let r = Readiness::<Cond>::default();
        assert!(!r.ready());
        assert_eq!(r.missing(), [Cond::Loaded, Cond::Live]);
        r.set(Cond::Loaded, true);
        r.clone().set(Cond::Live, true);
        assert!(r.ready() && r.holds(Cond::Live));
        r.set(Cond::Live, false);
        assert!(!r.ready() && r.holds(Cond::Loaded) && !r.holds(Cond::Live));
        assert_eq!(r.missing(), [Cond::Live]);
    }
}
