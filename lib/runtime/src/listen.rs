//! Listen addresses: `HOST:PORT` for TCP, `unix:/path` for a unix socket created mode 0600.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use tokio::net::{TcpListener, UnixListener};

/// Where a server listens. Parsed from `HOST:PORT` (`127.0.0.1:9600`, `[::1]:9600`,
/// `localhost:9600`) or `unix:/path/to.sock`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenAddr {
    /// A TCP host (name or address) and port; a port of 0 picks a free one.
    Tcp { host: String, port: u16 },
    /// A unix socket path.
    Unix(PathBuf),
}

/// Why a listen address could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseListenError {
    #[error("`{0}`: a unix socket address needs an absolute path, as in unix:/run/kuryr/binder.sock")]
    UnixPath(String),
    #[error("`{0}`: expected HOST:PORT (for example 127.0.0.1:9600) or unix:/path")]
    Shape(String),
    #[error("`{0}`: the port must be a number from 0 to 65535")]
    Port(String),
}

impl FromStr for ListenAddr {
    type Err = ParseListenError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            // Accept unix:///path as well as unix:/path.
            let path = path.strip_prefix("//").unwrap_or(path);
            if !path.starts_with('/') {
                return Err(ParseListenError::UnixPath(s.to_string()));
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let (host, port) = s.rsplit_once(':').ok_or_else(|| ParseListenError::Shape(s.to_string()))?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.is_empty() || host.contains(['/', ' ']) {
            return Err(ParseListenError::Shape(s.to_string()));
        }
        let port = port.parse().map_err(|_| ParseListenError::Port(s.to_string()))?;
        Ok(Self::Tcp { host: host.to_string(), port })
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp { host, port } if host.contains(':') => write!(f, "[{host}]:{port}"),
            Self::Tcp { host, port } => write!(f, "{host}:{port}"),
            Self::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// A bound listener.
#[derive(Debug)]
pub enum Bound {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Bound {
    /// The address actually bound (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> ListenAddr {
        match self {
            Self::Tcp(l) => match l.local_addr() {
                Ok(a) => ListenAddr::Tcp { host: a.ip().to_string(), port: a.port() },
                Err(_) => ListenAddr::Tcp { host: "?".into(), port: 0 },
            },
            Self::Unix(_, p) => ListenAddr::Unix(p.clone()),
        }
    }
}

impl ListenAddr {
    /// Binds the address. A unix socket is created mode 0600 without a window in which it is
    /// reachable with looser permissions: it is bound under a temporary name, restricted, then
    /// renamed into place. A stale socket file left by a crashed process is replaced; a socket
    /// that still answers is an error (another instance is running).
    pub async fn bind(&self) -> io::Result<Bound> {
        match self {
            Self::Tcp { host, port } => {
                let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), *port)).await?.collect();
                let mut last = io::Error::new(io::ErrorKind::AddrNotAvailable, format!("{self}: no address"));
                for a in addrs {
                    match TcpListener::bind(a).await {
                        Ok(l) => return Ok(Bound::Tcp(l)),
                        Err(e) => last = io::Error::new(e.kind(), format!("{self}: {e}")),
                    }
                }
                Err(last)
            }
            Self::Unix(path) => bind_unix(path).await.map(|l| Bound::Unix(l, path.clone())),
        }
    }
}

async fn bind_unix(path: &Path) -> io::Result<UnixListener> {
    let ctx = |e: io::Error| io::Error::new(e.kind(), format!("unix:{}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(ctx)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if tokio::net::UnixStream::connect(path).await.is_ok() {
                return Err(ctx(io::Error::new(io::ErrorKind::AddrInUse, "another process is serving on this socket")));
            }
            std::fs::remove_file(path).map_err(ctx)?;
        }
        Ok(_) => {
            return Err(ctx(io::Error::new(io::ErrorKind::AlreadyExists, "exists and is not a socket")));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(ctx(e)),
    }
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(ctx)?;
    let restrict = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = restrict {
        let _ = std::fs::remove_file(&tmp);
        return Err(ctx(e));
    }
    Ok(listener)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parses_tcp_and_unix() {
        assert_eq!(
            "127.0.0.1:9600".parse::<ListenAddr>().unwrap(),
            ListenAddr::Tcp { host: "127.0.0.1".into(), port: 9600 }
        );
        assert_eq!("[::1]:0".parse::<ListenAddr>().unwrap(), ListenAddr::Tcp { host: "::1".into(), port: 0 });
        assert_eq!(
            "unix:/run/kuryr/b.sock".parse::<ListenAddr>().unwrap(),
            ListenAddr::Unix("/run/kuryr/b.sock".into())
        );
        assert_eq!("unix:///run/b.sock".parse::<ListenAddr>().unwrap(), ListenAddr::Unix("/run/b.sock".into()));
        assert_eq!("[::1]:7".parse::<ListenAddr>().unwrap().to_string(), "[::1]:7");
    }

    #[test]
    fn rejects_bad_addresses_naming_them() {
        assert!(matches!("unix:rel.sock".parse::<ListenAddr>(), Err(ParseListenError::UnixPath(_))));
        assert!(matches!("9600".parse::<ListenAddr>(), Err(ParseListenError::Shape(_))));
        assert!(matches!(":9600".parse::<ListenAddr>(), Err(ParseListenError::Shape(_))));
        let e = "host:99999".parse::<ListenAddr>().unwrap_err();
        assert!(e.to_string().contains("host:99999"), "{e}");
    }

    #[tokio::test]
    async fn unix_socket_is_private_and_replaces_stale_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/x.sock");
        let addr = ListenAddr::Unix(path.clone());
        let bound = addr.bind().await.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // A live socket is refused.
        let err = addr.bind().await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
        // Once its owner is gone, the stale file is replaced.
        drop(bound);
        addr.bind().await.unwrap();
        // A regular file in the way is not deleted.
        let file = dir.path().join("plain");
        std::fs::write(&file, b"keep").unwrap();
        assert!(ListenAddr::Unix(file.clone()).bind().await.is_err());
        assert_eq!(std::fs::read(&file).unwrap(), b"keep");
    }
}
