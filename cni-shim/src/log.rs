//! Log lines: to `logFile` when the configuration names one, else to stderr; never to stdout,
//! which belongs to the CNI result. One `write` per line, so concurrent shims appending to the same
//! file do not interleave within a line.

use std::fmt;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

/// Where log lines go.
#[derive(Clone, Debug, Default)]
pub struct Log {
    file: Option<PathBuf>,
}

impl Log {
    /// Logs to stderr.
    pub fn stderr() -> Self {
        Self { file: None }
    }

    /// Logs to `file`, appending; falls back to stderr when it cannot be opened.
    pub fn to_file(file: PathBuf) -> Self {
        Self { file: Some(file) }
    }

    /// Writes one line: an RFC 3339 UTC timestamp, `kuryr-cni[pid]`, and `msg`.
    pub fn line(&self, msg: fmt::Arguments<'_>) {
        let line = format!("{} kuryr-cni[{}] {msg}\n", rfc3339_now(), std::process::id());
        if let Some(path) = &self.file {
            let written =
                OpenOptions::new().create(true).append(true).open(path).and_then(|mut f| f.write_all(line.as_bytes()));
            match written {
                Ok(()) => return,
                Err(e) => {
                    let _ = writeln!(std::io::stderr(), "kuryr-cni: cannot write to logFile {}: {e}", path.display());
                }
            }
        }
        let _ = std::io::stderr().write_all(line.as_bytes());
    }
}

fn rfc3339_now() -> String {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    rfc3339(d.as_secs(), d.subsec_millis())
}

/// `secs` since the epoch as `YYYY-MM-DDTHH:MM:SS.mmmZ`, without a date crate: the civil date from
/// a day count (the "days from civil" algorithm, run backwards).
fn rfc3339(secs: u64, millis: u32) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Shift the epoch to 0000-03-01 so that leap days fall at the end of a 400-year era.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400, 5), "2000-02-29T00:00:00.005Z");
        assert_eq!(rfc3339(1_709_251_199, 999), "2024-02-29T23:59:59.999Z");
        assert_eq!(rfc3339(4_102_444_800, 0), "2100-01-01T00:00:00.000Z");
    }

    #[test]
    fn writes_to_the_log_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cni.log");
        let log = Log::to_file(path.clone());
        log.line(format_args!("one {}", 1));
        log.line(format_args!("two"));
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].ends_with("] one 1") && lines[0].contains(" kuryr-cni["), "{text}");
    }
}
