//! Running `nft`: one script per transaction (`nft -f -` applies a whole file atomically, or
//! nothing of it), and listing the Service objects the table holds.
//!
//! The binder runs in the node's network namespace and so does every `nft` it starts.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use super::render::{Existing, TABLE};

/// How long one `nft` run may take before it is killed and the transaction counted as failed.
const NFT_TIMEOUT: Duration = Duration::from_secs(20);

/// Why `nft` failed.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("cannot run {program}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} {args} did not finish within {NFT_TIMEOUT:?}")]
    Timeout { program: String, args: String },
    #[error("{program} {args} failed: {stderr}")]
    Failed { program: String, args: String, stderr: String },
    #[error("unexpected output of {program} {args}: {why}")]
    Output { program: String, args: String, why: String },
}

/// The `nft` program to run.
#[derive(Clone, Debug)]
pub struct Nft {
    program: String,
}

impl Default for Nft {
    fn default() -> Self {
        Self { program: "nft".into() }
    }
}

impl Nft {
    /// Runs `program` (a path, or a name looked up in PATH).
    pub fn new(program: impl Into<String>) -> Self {
        Self { program: program.into() }
    }

    async fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<Vec<u8>, NftError> {
        let joined = args.join(" ");
        let mut child = Command::new(&self.program)
            .args(args)
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| NftError::Spawn { program: self.program.clone(), source })?;
        let work = async {
            if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
                // A write error means nft exited early; its status and stderr tell why.
                let _ = pipe.write_all(text.as_bytes()).await;
                drop(pipe);
            }
            child.wait_with_output().await
        };
        let out = tokio::time::timeout(NFT_TIMEOUT, work)
            .await
            .map_err(|_| NftError::Timeout { program: self.program.clone(), args: joined.clone() })?
            .map_err(|source| NftError::Spawn { program: self.program.clone(), source })?;
        if !out.status.success() {
            return Err(NftError::Failed {
                program: self.program.clone(),
                args: joined,
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(out.stdout)
    }

    /// Applies `script` as one transaction.
    pub async fn apply(&self, script: &str) -> Result<(), NftError> {
        self.run(&["-f", "-"], Some(script)).await.map(drop)
    }

    /// The version line of `nft`, to check at start that it can be run.
    pub async fn version(&self) -> Result<String, NftError> {
        let out = self.run(&["--version"], None).await?;
        Ok(String::from_utf8_lossy(&out).trim().to_string())
    }

    /// The chains and sets of the table (without set elements); empty when there is no table.
    pub async fn existing(&self) -> Result<Existing, NftError> {
        let args = ["-j", "-t", "list", "table", "inet", TABLE];
        match self.run(&args, None).await {
            Ok(out) => parse_existing(&out).map_err(|why| NftError::Output {
                program: self.program.clone(),
                args: args.join(" "),
                why,
            }),
            Err(NftError::Failed { stderr, .. }) if stderr.contains("No such file or directory") => {
                Ok(Existing::default())
            }
            Err(e) => Err(e),
        }
    }
}

/// Reads the chain and set names (and set timeouts) out of `nft -j list table`.
pub fn parse_existing(json: &[u8]) -> Result<Existing, String> {
    let v: serde_json::Value = serde_json::from_slice(json).map_err(|e| e.to_string())?;
    let items = v.get("nftables").and_then(|x| x.as_array()).ok_or("no \"nftables\" array")?;
    let mut existing = Existing::default();
    for item in items {
        if let Some(c) = item.get("chain") {
            if let Some(name) = c.get("name").and_then(|n| n.as_str()) {
                existing.chains.insert(name.to_string());
            }
        } else if let Some(s) = item.get("set").or_else(|| item.get("map"))
            && let Some(name) = s.get("name").and_then(|n| n.as_str())
        {
            let timeout = s.get("timeout").and_then(|t| t.as_u64()).and_then(|t| u32::try_from(t).ok());
            existing.sets.insert(name.to_string(), timeout);
        }
    }
    Ok(existing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn existing_objects_are_read_from_the_json_listing() {
        let json = br#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
            {"table": {"family": "inet", "name": "kuryr", "handle": 1}},
            {"map": {"family": "inet", "name": "services4", "table": "kuryr", "map": "verdict"}},
            {"set": {"family": "inet", "name": "aff/default/web/tcp/80/10.0.0.1/8080", "table": "kuryr",
                     "type": "ipv4_addr", "flags": ["timeout"], "timeout": 10800}},
            {"chain": {"family": "inet", "table": "kuryr", "name": "svc/default/web/tcp/80/v4", "handle": 9}},
            {"rule": {"family": "inet", "table": "kuryr", "chain": "services"}}]}"#;
        let e = parse_existing(json).unwrap();
        assert_eq!(e.chains.iter().collect::<Vec<_>>(), ["svc/default/web/tcp/80/v4"]);
        assert_eq!(e.sets.get("aff/default/web/tcp/80/10.0.0.1/8080"), Some(&Some(10800)));
        assert_eq!(e.sets.get("services4"), Some(&None));
        assert!(parse_existing(b"{}").is_err());
        assert!(parse_existing(b"not json").is_err());
    }

    #[tokio::test]
    async fn a_missing_program_is_a_clear_error() {
        let err = Nft::new("/nonexistent/nft").version().await.unwrap_err();
        assert!(err.to_string().contains("cannot run /nonexistent/nft"), "{err}");
    }
}
