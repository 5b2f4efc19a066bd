//! Shutdown: one signal, observed by every server and long-lived stream, raised by SIGTERM or
//! SIGINT (or by a test).

use tokio::sync::watch;

/// Raises shutdown.
#[derive(Debug)]
pub struct ShutdownTrigger(watch::Sender<bool>);

/// Observes shutdown; cheap to clone into every task and stream.
#[derive(Clone, Debug)]
pub struct Shutdown(watch::Receiver<bool>);

/// A linked trigger and signal.
pub fn channel() -> (ShutdownTrigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (ShutdownTrigger(tx), Shutdown(rx))
}

impl ShutdownTrigger {
    /// Begins shutdown.
    pub fn trigger(&self) {
        let _ = self.0.send(true);
    }

    /// A signal linked to this trigger.
    pub fn signal(&self) -> Shutdown {
        Shutdown(self.0.subscribe())
    }
}

impl Shutdown {
    /// Completes once shutdown has begun (at once if it already has).
    pub async fn wait(mut self) {
        // An error means the trigger was dropped, which also ends the process's life.
        let _ = self.0.wait_for(|v| *v).await;
    }

    /// Whether shutdown has begun.
    pub fn is_triggered(&self) -> bool {
        *self.0.borrow()
    }
}

/// Completes on SIGTERM or SIGINT.
pub async fn os_signal() -> std::io::Result<&'static str> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    })
}
