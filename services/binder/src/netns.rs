//! Running code inside a network namespace.
//!
//! `setns(2)` changes the namespace of the *calling thread* only, and every socket the thread
//! opens afterwards (netlink included) belongs to that namespace. A tokio worker or a
//! `spawn_blocking` thread is shared with unrelated tasks, so entering a namespace there would
//! leak it into whatever runs next on that thread: no tokio thread ever enters one.
//!
//! Namespace work runs instead on the binder's *namespace workers* ([`on_worker`]): dedicated OS
//! threads that run nothing else, kept between jobs so that a CNI call does not pay for a thread
//! (and the runtime and host netlink socket it keeps, see `crate::plug`) each time. A job may
//! enter a namespace ([`visit`], [`run_in_netns`]); whatever it did, the worker checks after
//! each job that it is back in its home namespace (the one the binder runs in, compared by
//! device and inode), moves back if it is not, and retires — the thread ends, never to run
//! another job — if it cannot. Workers are started from tokio threads, which are always in the
//! binder's namespace, so a new worker is born at home. At most [`MAX_WORKERS`] are kept; when
//! all of them are busy a job gets a thread of its own that ends with it, as every job did
//! before the pool, so a slow job never queues another behind it.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Mutex, PoisonError};

use nix::errno::Errno;
use nix::sched::{CloneFlags, setns};
use tokio::sync::oneshot;

/// Why code could not be run inside a network namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file does not exist (or the path is empty): the sandbox is gone. CNI ADD maps
    /// this to code 4 (invalid environment); DEL treats it as success.
    #[error("network namespace {} does not exist", path.display())]
    NotFound { path: PathBuf },
    /// The path exists but is not a network namespace, e.g. the bind mount behind it was already
    /// unmounted and only the empty placeholder file remains. As good as gone for DEL.
    #[error("{} is not a network namespace", path.display())]
    NotANetns {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    /// The namespace file could not be opened for another reason (permissions, I/O).
    #[error("cannot open network namespace {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// `setns(2)` failed for another reason (typically missing CAP_SYS_ADMIN).
    #[error("cannot enter network namespace {}", path.display())]
    Enter {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    /// No thread could be started for the work.
    #[error("cannot start a thread for network namespace work")]
    Spawn(#[source] io::Error),
    /// The thread ended without an answer: the closure panicked.
    #[error("the network namespace thread ended without an answer (it panicked)")]
    ThreadDied,
    /// The path is a namespace, but not one a pod may be given: the binder's own or the host's
    /// (`/proc/self/ns/net`, `/proc/1/ns/net`). Plugging or unplugging there would rewire the
    /// node itself.
    #[error("{} is the {which} network namespace, not a pod's", path.display())]
    NotAPod { path: PathBuf, which: &'static str },
}

impl NetnsError {
    /// True when the namespace is gone for good (missing file, or no longer a namespace): the
    /// cases where CNI DEL must report success.
    pub fn is_gone(&self) -> bool {
        matches!(self, Self::NotFound { .. } | Self::NotANetns { .. })
    }
}

/// Runs `f` on a namespace worker inside the network namespace at `netns`, or in the namespace
/// the binder itself runs in (the host's) when `netns` is `None`, and returns its result without
/// blocking the caller's executor.
///
/// Sockets `f` opens live in the target namespace. Errors entering the namespace are converted
/// with `E::from`, so callers keep their own error type. If the caller's future is dropped, `f`
/// still runs to completion and its result is discarded, so `f` must bound its own waits. The
/// worker returns home afterwards (see the module documentation).
pub async fn run_in_netns<F, T, E>(netns: Option<PathBuf>, f: F) -> Result<T, E>
where
    F: FnOnce() -> Result<T, E> + Send + 'static,
    T: Send + 'static,
    E: From<NetnsError> + Send + 'static,
{
    on_worker(move || match netns.as_deref().map(enter) {
        Some(Err(e)) => Err(E::from(e)),
        Some(Ok(())) | None => f(),
    })
    .await
    .map_err(E::from)?
}

/// How many namespace workers are kept between jobs.
pub const MAX_WORKERS: usize = 4;

type Job = Box<dyn FnOnce() + Send>;

/// The kept workers: the job senders of the idle ones, and how many exist.
struct Pool {
    idle: Mutex<Vec<mpsc::Sender<Job>>>,
    kept: AtomicUsize,
}

static POOL: Pool = Pool { idle: Mutex::new(Vec::new()), kept: AtomicUsize::new(0) };

/// Runs `f` on a namespace worker: a dedicated OS thread in the binder's own namespace, kept
/// between jobs (see the module documentation). `f` may enter a namespace; the worker goes back
/// home afterwards or retires.
pub async fn on_worker<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, NetnsError> {
    let (tx, rx) = oneshot::channel();
    submit(move || {
        // A closed channel means the caller went away; there is nobody left to tell.
        let _ = tx.send(f());
    })?;
    rx.await.map_err(|_| NetnsError::ThreadDied)
}

/// Hands `job` to a namespace worker and returns at once; the job reports back itself.
pub fn submit(job: impl FnOnce() + Send + 'static) -> Result<(), NetnsError> {
    dispatch(Box::new(job))
}

fn dispatch(mut job: Job) -> Result<(), NetnsError> {
    let born_in = path_ns_id(THREAD_NETNS);
    // Kept workers live in the binder's namespace; a caller elsewhere (only tests run async code
    // on a thread that entered another) gets a thread of its own, born in the caller's.
    let pooled = born_in.is_some() && born_in == path_ns_id("/proc/self/ns/net");
    if pooled {
        loop {
            let idle = POOL.idle.lock().unwrap_or_else(PoisonError::into_inner).pop();
            let Some(worker) = idle else { break };
            match worker.send(job) {
                Ok(()) => return Ok(()),
                // That worker is gone (it retired): try the next one.
                Err(mpsc::SendError(j)) => job = j,
            }
        }
    }
    let keep = pooled && POOL.kept.fetch_add(1, Ordering::AcqRel) < MAX_WORKERS;
    if pooled && !keep {
        POOL.kept.fetch_sub(1, Ordering::AcqRel);
    }
    let spawned = std::thread::Builder::new().name("kuryr-netns".to_string()).spawn(move || {
        BORN_IN.with(|b| b.set(born_in));
        if keep {
            // Counted out however the thread ends, a panicking job included.
            let _kept = Kept;
            worker(job);
        } else {
            job();
        }
    });
    spawned.map(drop).map_err(|e| {
        if keep {
            POOL.kept.fetch_sub(1, Ordering::AcqRel);
        }
        NetnsError::Spawn(e)
    })
}

/// Counts a kept worker out of the pool when its thread ends.
struct Kept;

impl Drop for Kept {
    fn drop(&mut self) {
        POOL.kept.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The loop of a kept worker: runs `first`, then whatever it is given while idle, and checks
/// after each job that it is at home (moving back if need be). Returns when it cannot be sure of
/// its namespace: the thread then ends.
fn worker(first: Job) {
    let home = match File::open(THREAD_NETNS) {
        Ok(f) => f,
        Err(e) => {
            tracing::error!(error = %e, "a namespace worker cannot open its own namespace; running one job only");
            first();
            return;
        }
    };
    let Some(home_id) = ns_id(&home) else { return first() };
    let (tx, rx) = mpsc::channel::<Job>();
    let mut job = first;
    loop {
        job();
        if !back_home(&home, home_id) {
            return;
        }
        POOL.idle.lock().unwrap_or_else(PoisonError::into_inner).push(tx.clone());
        match rx.recv() {
            Ok(j) => job = j,
            Err(_) => return,
        }
    }
}

fn path_ns_id(p: &str) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

thread_local! {
    /// The namespace a namespace thread was started in (its home).
    static BORN_IN: std::cell::Cell<Option<(u64, u64)>> = const { std::cell::Cell::new(None) };
}

/// Whether the calling thread is at home: in the namespace it was started in, for a namespace
/// thread; in the binder's own (its main thread's, which never enters another) for any other.
pub fn at_home() -> bool {
    let home = BORN_IN.with(std::cell::Cell::get).or_else(|| path_ns_id("/proc/self/ns/net"));
    let here = path_ns_id(THREAD_NETNS);
    here.is_some() && here == home
}

/// (device, inode) of a namespace file: how the kernel identifies a namespace.
fn ns_id(file: &File) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    file.metadata().ok().map(|m| (m.dev(), m.ino()))
}

/// Whether the calling thread is in the namespace `home_id`, moving it back to `home` if it is
/// not; false (and logged) when that cannot be done or checked.
fn back_home(home: &File, home_id: (u64, u64)) -> bool {
    let here = File::open(THREAD_NETNS).ok().as_ref().and_then(ns_id);
    if here == Some(home_id) {
        return true;
    }
    tracing::warn!("a namespace worker was left outside its namespace; moving it back");
    let back = setns(home, CloneFlags::CLONE_NEWNET).is_ok()
        && File::open(THREAD_NETNS).ok().as_ref().and_then(ns_id) == Some(home_id);
    if !back {
        tracing::error!("a namespace worker cannot return to its namespace; retiring it");
    }
    back
}

/// Moves the calling thread into the network namespace at `path`. Only for threads that are
/// never reused for anything else (see the module documentation).
fn enter(path: &Path) -> Result<(), NetnsError> {
    enter_file(&open(path)?, path)
}

/// Moves the calling thread into the network namespace open as `file` (from `path`, for errors).
fn enter_file(file: &File, path: &Path) -> Result<(), NetnsError> {
    setns(file, CloneFlags::CLONE_NEWNET).map_err(|source| match source {
        Errno::EINVAL => NetnsError::NotANetns { path: path.to_path_buf(), source },
        source => NetnsError::Enter { path: path.to_path_buf(), source },
    })
}

/// The file system type of namespace files (`NSFS_MAGIC`): what `/proc/<pid>/ns/*` and their
/// bind mounts under `/var/run/netns` are.
fn is_nsfs(file: &File) -> bool {
    nix::sys::statfs::fstatfs(file).is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::NSFS_MAGIC)
}

/// Namespaces a pod may never be given, with what to call them in an error.
const FORBIDDEN: &[(&str, &str)] = &[("/proc/self/ns/net", "binder's own"), ("/proc/1/ns/net", "host's")];

/// Checks that `file` (opened from `path`) is a network namespace a pod may own: a namespace
/// file (nsfs; [`NetnsError::NotANetns`] otherwise) that is neither the binder's own nor the
/// host's ([`NetnsError::NotAPod`]), compared by device and inode as the kernel identifies
/// namespaces. That it is a *network* namespace, not another kind, is checked by `setns`
/// (`CLONE_NEWNET`) when it is entered.
pub fn check_pod_file(file: &File, path: &Path) -> Result<(), NetnsError> {
    use std::os::unix::fs::MetadataExt;
    if !is_nsfs(file) {
        return Err(NetnsError::NotANetns { path: path.to_path_buf(), source: Errno::EINVAL });
    }
    let meta = file.metadata().map_err(|source| NetnsError::Open { path: path.to_path_buf(), source })?;
    for (forbidden, which) in FORBIDDEN {
        // A /proc entry that cannot be read cannot be the one given either.
        if let Ok(m) = std::fs::metadata(forbidden)
            && (m.dev(), m.ino()) == (meta.dev(), meta.ino())
        {
            return Err(NetnsError::NotAPod { path: path.to_path_buf(), which });
        }
    }
    Ok(())
}

/// [`check_pod_file`] on the file at `path`; a missing path is [`NetnsError::NotFound`].
pub fn check_pod(path: &Path) -> Result<(), NetnsError> {
    check_pod_file(&open(path)?, path)
}

/// The calling thread's own network namespace, as `/proc` shows it.
const THREAD_NETNS: &str = "/proc/thread-self/ns/net";

/// Runs `f` with the calling thread inside the network namespace open as `ns` (from `path`, for
/// errors), then moves the thread back to the namespace it was in. Sockets `f` opens stay in
/// `ns`; this is how one thread holds netlink sockets in two namespaces. `f` must be synchronous
/// (nothing else may run on the thread meanwhile), and the thread must be a dedicated one, as for
/// [`run_in_netns`]: should the way back fail, the thread is left in `ns` and the error says so.
pub fn visit<T>(ns: &File, path: &Path, f: impl FnOnce() -> T) -> Result<T, NetnsError> {
    let home = open(Path::new(THREAD_NETNS))?;
    enter_file(ns, path)?;
    let out = f();
    enter_file(&home, Path::new(THREAD_NETNS))?;
    Ok(out)
}

/// Opens a network namespace file, mapping a missing (or empty) path to
/// [`NetnsError::NotFound`].
pub fn open(path: &Path) -> Result<File, NetnsError> {
    if path.as_os_str().is_empty() {
        return Err(NetnsError::NotFound { path: path.to_path_buf() });
    }
    File::open(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => NetnsError::NotFound { path: path.to_path_buf() },
        _ => NetnsError::Open { path: path.to_path_buf(), source },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inode(p: &str) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(p).unwrap().ino()
    }

    #[tokio::test]
    async fn none_runs_in_the_callers_namespace_on_another_thread() {
        let caller = std::thread::current().id();
        let (thread, ns) = run_in_netns::<_, _, NetnsError>(None, move || {
            Ok((std::thread::current().id(), inode("/proc/thread-self/ns/net")))
        })
        .await
        .unwrap();
        assert_ne!(thread, caller);
        assert_eq!(ns, inode("/proc/thread-self/ns/net"));
    }

    #[tokio::test]
    async fn missing_and_empty_paths_are_not_found() {
        for p in ["/nonexistent/kuryr-netns-test", ""] {
            let err = run_in_netns::<_, (), NetnsError>(Some(PathBuf::from(p)), || Ok(())).await.unwrap_err();
            assert!(matches!(err, NetnsError::NotFound { .. }), "{p}: {err:?}");
            assert!(err.is_gone());
        }
    }

    #[tokio::test]
    async fn a_regular_file_is_not_a_netns() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let err = run_in_netns::<_, (), NetnsError>(Some(f.path().to_path_buf()), || Ok(())).await.unwrap_err();
        // EINVAL as root; EPERM without CAP_SYS_ADMIN.
        assert!(matches!(err, NetnsError::NotANetns { .. } | NetnsError::Enter { .. }), "{err:?}");
    }

    #[test]
    fn visit_runs_inside_and_comes_back() {
        // A namespace of our own (needs CAP_SYS_ADMIN), entered by a visit from a dedicated thread.
        let seen = std::thread::spawn(|| {
            let home = inode("/proc/thread-self/ns/net");
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).ok()?;
            let other = File::open("/proc/thread-self/ns/net").unwrap();
            let other_ino = inode("/proc/thread-self/ns/net");
            // Back where we started (the main thread's namespace), then visit the new one.
            setns(File::open("/proc/self/ns/net").unwrap(), CloneFlags::CLONE_NEWNET).unwrap();
            assert_eq!(inode("/proc/thread-self/ns/net"), home);
            let inside = visit(&other, Path::new("test"), || inode("/proc/thread-self/ns/net")).unwrap();
            Some((home, other_ino, inside, inode("/proc/thread-self/ns/net")))
        })
        .join()
        .unwrap();
        let (home, other, inside, after) =
            seen.expect("prerequisite missing: creating a network namespace needs CAP_SYS_ADMIN");
        assert_ne!(home, other);
        assert_eq!(inside, other);
        assert_eq!(after, home);
    }

    #[tokio::test]
    async fn visiting_a_non_namespace_fails_and_stays_home() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let file = File::open(f.path()).unwrap();
        let before = inode("/proc/thread-self/ns/net");
        let mut ran = false;
        let err = visit(&file, f.path(), || ran = true).unwrap_err();
        assert!(matches!(err, NetnsError::NotANetns { .. } | NetnsError::Enter { .. }), "{err:?}");
        assert!(!ran);
        assert_eq!(inode("/proc/thread-self/ns/net"), before);
    }

    #[test]
    fn own_and_host_namespaces_are_not_pods() {
        for p in ["/proc/self/ns/net", "/proc/thread-self/ns/net"] {
            let err = check_pod(Path::new(p)).unwrap_err();
            assert!(matches!(err, NetnsError::NotAPod { .. }), "{p}: {err:?}");
        }
        // Where pid 1 lives outside this process's reach (a container without hostPID) its
        // namespace cannot even be opened.
        let err = check_pod(Path::new("/proc/1/ns/net")).unwrap_err();
        assert!(matches!(err, NetnsError::NotAPod { .. } | NetnsError::Open { .. }), "{err:?}");
        // Another kind of file is not a namespace at all.
        let f = tempfile::NamedTempFile::new().unwrap();
        assert!(matches!(check_pod(f.path()).unwrap_err(), NetnsError::NotANetns { .. }));
        assert!(matches!(check_pod(Path::new("/proc/self/status")).unwrap_err(), NetnsError::NotANetns { .. }));
        assert!(matches!(check_pod(Path::new("/nonexistent/ns")).unwrap_err(), NetnsError::NotFound { .. }));
    }

    #[test]
    fn a_namespace_of_its_own_is_a_pod() {
        let made = std::thread::spawn(|| {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).ok()?;
            Some(File::open("/proc/thread-self/ns/net").unwrap())
        })
        .join()
        .unwrap();
        let file = made.expect("prerequisite missing: creating a network namespace needs CAP_SYS_ADMIN");
        check_pod_file(&file, Path::new("new")).unwrap();
    }

    #[tokio::test]
    async fn a_worker_left_in_another_namespace_comes_home() {
        // A job that moves its thread into a new namespace (needs CAP_SYS_ADMIN, as the binder
        // has) and does not come back: the worker moves back before its next job.
        let moved = on_worker(|| nix::sched::unshare(CloneFlags::CLONE_NEWNET).map(|()| at_home())).await.unwrap();
        assert_eq!(moved, Ok(false), "unshare(CLONE_NEWNET) needs CAP_SYS_ADMIN");
        for _ in 0..2 * MAX_WORKERS {
            let (home, name) =
                on_worker(|| (at_home(), std::thread::current().name().map(str::to_string))).await.unwrap();
            assert!(home);
            assert_eq!(name.as_deref(), Some("kuryr-netns"));
        }
    }

    #[tokio::test]
    async fn the_closures_error_comes_back() {
        let err = run_in_netns::<_, (), NetnsError>(None, || Err(NetnsError::ThreadDied)).await.unwrap_err();
        assert!(matches!(err, NetnsError::ThreadDied));
    }
}
