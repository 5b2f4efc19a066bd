//! A TCP forwarder from the host's loopback into a network namespace: how the test process, the
//! lab's user and their `kubectl` reach an API server that lives inside a node's namespace,
//! without giving the host a route or an address in the cluster's networks.
//!
//! Connections are accepted on `127.0.0.1:<port>`; each is connected onward to the target from a
//! socket created inside the namespace (by one thread that entered it; a socket keeps the
//! namespace it was created in), then bytes are copied both ways until either side closes.

use std::fs::File;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long a connection attempt inside the namespace may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

type Reply = oneshot::Sender<std::io::Result<std::net::TcpStream>>;

/// A running forwarder; stops accepting when dropped (connections in flight end with the task).
#[derive(Debug)]
pub struct NetnsForwarder {
    local: SocketAddr,
    target: SocketAddr,
    accept: JoinHandle<()>,
}

impl NetnsForwarder {
    /// Forwards `127.0.0.1:<free port>` to `target` inside the network namespace at `netns`.
    pub async fn start(netns: &Path, target: SocketAddr) -> Result<Self> {
        let ns = File::open(netns).with_context(|| format!("opening {}", netns.display()))?;
        let (requests, incoming) = mpsc::channel::<Reply>();
        let (entered_tx, entered_rx) = oneshot::channel::<Result<(), String>>();
        std::thread::Builder::new()
            .name("netns-connect".into())
            .spawn(move || {
                if let Err(e) = nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET) {
                    let _ = entered_tx.send(Err(format!("setns: {e}")));
                    return;
                }
                let _ = entered_tx.send(Ok(()));
                // Ends when the forwarder (the last sender) is gone.
                while let Ok(reply) = incoming.recv() {
                    let _ = reply.send(std::net::TcpStream::connect_timeout(&target, CONNECT_TIMEOUT));
                }
            })
            .context("spawning the namespace connector thread")?;
        entered_rx
            .await
            .context("the namespace connector thread ended")?
            .map_err(|e| anyhow::anyhow!("entering {}: {e}", netns.display()))?;
        let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the forwarder")?;
        let local = listener.local_addr()?;
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else { continue };
                let (tx, rx) = oneshot::channel();
                if requests.send(tx).is_err() {
                    return;
                }
                tokio::spawn(async move {
                    let Ok(Ok(upstream)) = rx.await else { return };
                    if upstream.set_nonblocking(true).is_err() {
                        return;
                    }
                    let Ok(mut upstream) = TcpStream::from_std(upstream) else { return };
                    let mut client = client;
                    let _ = client.set_nodelay(true);
                    let _ = upstream.set_nodelay(true);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                });
            }
        });
        Ok(Self { local, target, accept })
    }

    /// The host-side address (`127.0.0.1:<port>`).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Where connections go, inside the namespace.
    pub fn target(&self) -> SocketAddr {
        self.target
    }
}

impl Drop for NetnsForwarder {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// The other way round: a TCP listener on `127.0.0.1:<port>` inside a network namespace whose
/// connections go to unix sockets of services on the host — how a node's binder reaches the
/// replicas of a service by `HOST:PORT` (a replica's advertised endpoint, or a Service-like
/// address that reaches any replica). Each connection tries the sockets from a random one on
/// and takes the first that accepts, as a Service's load balancing would.
#[derive(Debug)]
pub struct UnixForwarder {
    accept: JoinHandle<()>,
}

impl UnixForwarder {
    /// Listens on `127.0.0.1:port` inside the namespace at `netns`, forwarding to `sockets`.
    pub async fn start(netns: &Path, port: u16, sockets: Vec<std::path::PathBuf>) -> Result<Self> {
        anyhow::ensure!(!sockets.is_empty(), "no socket to forward to");
        let ns = File::open(netns).with_context(|| format!("opening {}", netns.display()))?;
        let bound = std::thread::Builder::new()
            .name("netns-listen".into())
            .spawn(move || -> Result<std::net::TcpListener> {
                nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
                let l = std::net::TcpListener::bind(("127.0.0.1", port)).context("binding")?;
                l.set_nonblocking(true)?;
                Ok(l)
            })
            .context("spawning the namespace listener thread")?
            .join()
            .map_err(|_| anyhow::anyhow!("the namespace listener thread panicked"))?
            .with_context(|| format!("listening on 127.0.0.1:{port} in {}", netns.display()))?;
        let listener = TcpListener::from_std(bound)?;
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else { continue };
                let sockets = sockets.clone();
                tokio::spawn(async move {
                    let first = fastrand::usize(..sockets.len());
                    for k in 0..sockets.len() {
                        let path = &sockets[(first + k) % sockets.len()];
                        let Ok(Ok(mut upstream)) =
                            tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::UnixStream::connect(path)).await
                        else {
                            continue;
                        };
                        let _ = client.set_nodelay(true);
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                        return;
                    }
                });
            }
        });
        Ok(Self { accept })
    }
}

impl Drop for UnixForwarder {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
