//! The `kuryr-cni` binary: reads the process environment and stdin, prints one JSON document or
//! nothing, and exits 0 or 1. Everything else is in the library.

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let stdin = kuryr_cni::Stdin::read_from(std::io::stdin().lock());
    let outcome = kuryr_cni::run(&|k| std::env::var_os(k), &stdin);
    if let Some(out) = outcome.stdout {
        let mut stdout = std::io::stdout().lock();
        let written =
            stdout.write_all(out.as_bytes()).and_then(|()| stdout.write_all(b"\n")).and_then(|()| stdout.flush());
        if let Err(e) = written {
            // The runtime went away; stderr is all that is left.
            let _ = writeln!(std::io::stderr(), "kuryr-cni: cannot write to stdout: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::from(outcome.exit_code)
}
