//! A real Kubernetes control plane for one test: etcd and `kube-apiserver` on loopback, started by
//! `tests/env/kube-up.sh` into a private state directory and stopped (by pid) when dropped.
//!
//! The cluster is the API alone: RBAC and the TokenRequest API are real, but there is no
//! controller-manager, scheduler or kubelet. Pods are stored, watched and deleted, never run; a
//! namespace has no `default` ServiceAccount unless a test makes one (the ServiceAccount admission
//! plugin is off for that reason); a deleted namespace stays `Terminating`; the aggregated
//! ClusterRoles `admin`/`edit`/`view` are empty, so tests grant rights with explicit Roles. See
//! `kube-up.sh`.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! let env = kuryr_tests::kube::KubeEnv::start().await?;
//! let admin = env.client().await?;
//! let reader = env.service_account_client("ns1", "reader").await?;
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::sync::Once;
use std::time::Duration;

use anyhow::{Context, Result};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::process::Command;

use crate::util::{env_script, parse_env_file, run_command as run, run_down_script};

/// Bound on `kube-up.sh`. Normally 3–15 s; but when the tools are not built yet the script builds
/// them first, and a cold `kube-apiserver` build is 10+ minutes on two cores.
const KUBE_UP_TIMEOUT: Duration = Duration::from_secs(40 * 60);
/// Bound on one `kubectl` call or `kube-sa.sh` run (a few kubectl calls).
const KUBECTL_TIMEOUT: Duration = Duration::from_secs(60);

/// A running etcd + kube-apiserver pair with its state directory (certificates, kubeconfigs,
/// logs, pid files). Dropping it stops both servers and removes the directory, unless
/// `KURYR_KEEP_STATE=1` is set, in which case the directory is kept for inspection.
#[derive(Debug)]
pub struct KubeEnv {
    /// The directory `kube-up.sh` owns; removed on drop.
    state_dir: PathBuf,
    /// Admin kubeconfig (client certificate in `system:masters`).
    kubeconfig: PathBuf,
    /// The `KEY=VALUE` pairs of `state_dir/env`.
    env: Vec<(String, String)>,
    /// `KURYR_KEEP_STATE=1`: leave the state directory behind after stopping the servers.
    keep_state: bool,
}

impl KubeEnv {
    /// Starts etcd and kube-apiserver on free loopback ports and waits until `/readyz` is ok.
    ///
    /// Builds the tools first (via `tools.sh`) if they are not installed. A watchdog tied to this
    /// process stops the servers even if the test binary dies without running `Drop`.
    pub async fn start() -> Result<KubeEnv> {
        install_crypto_provider();
        let (state_dir, keep_state) = crate::util::state_dir("kuryr-kube-")?;

        let mut cmd = Command::new("bash");
        cmd.arg(env_script("kube-up.sh")).arg(&state_dir).env("KUBE_UP_OWNER_PID", std::process::id().to_string());
        // Constructed before the script runs so that a failure below still cleans up via Drop.
        let mut env = KubeEnv { kubeconfig: state_dir.join("kubeconfig"), state_dir, env: Vec::new(), keep_state };
        run(cmd, None, KUBE_UP_TIMEOUT).await.context("starting the Kubernetes API server (tests/env/kube-up.sh)")?;
        let text =
            std::fs::read_to_string(env.state_dir.join("env")).context("reading the env file written by kube-up.sh")?;
        env.env = parse_env_file(&text);
        Ok(env)
    }

    /// The state directory (certificates under `pki/`, server logs under `logs/`).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The admin kubeconfig (client certificate, `O=system:masters`).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// A value from the env file (`KUBE_APISERVER_URL`, `KUBE_CA_FILE`, `ETCD_URL`, `*_PID`, ...).
    pub fn env_value(&self, key: &str) -> Option<&str> {
        self.env.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// The API server's URL, `https://127.0.0.1:<port>`.
    pub fn apiserver_url(&self) -> &str {
        self.env_value("KUBE_APISERVER_URL").unwrap_or_default()
    }

    /// A client with cluster-admin rights.
    pub async fn client(&self) -> Result<kube::Client> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// Writes (or rewrites, with a fresh token) a kubeconfig that authenticates as the
    /// ServiceAccount `ns/sa`, creating the namespace and account if missing. The token comes
    /// from the TokenRequest API. Grants nothing by itself.
    ///
    /// Next to it, `<kubeconfig>.kuryr-token` holds a token of the same account for the kuryr
    /// audience: what a kuryr service sends to the others (see [`crate::services::ServiceProcess::spawn`]).
    pub async fn service_account_kubeconfig(&self, ns: &str, sa: &str) -> Result<PathBuf> {
        let out = self.state_dir.join("sa").join(format!("{ns}.{sa}.kubeconfig"));
        let mut cmd = Command::new("bash");
        cmd.arg(env_script("kube-sa.sh")).arg(&self.state_dir).args([ns, sa]).arg(&out);
        run(cmd, None, KUBECTL_TIMEOUT)
            .await
            .with_context(|| format!("making a kubeconfig for service account {ns}/{sa}"))?;
        let token = self.kuryr_token(ns, sa, None).await?;
        write_private(&kuryr_token_path(&out), &token)?;
        Ok(out)
    }

    /// A token of the ServiceAccount `ns/sa` (made if missing) for the kuryr audience, as a
    /// projected token of a kuryr pod is; bound to the Node `node` when given (its TokenReview
    /// then names that node), as a binder's is.
    pub async fn kuryr_token(&self, ns: &str, sa: &str, node: Option<&str>) -> Result<String> {
        match self.kubectl(&["create", "serviceaccount", sa, "-n", ns]).await {
            Ok(_) => {}
            Err(e) if format!("{e:#}").contains("already exists") => {}
            Err(e) => return Err(e.context(format!("creating the ServiceAccount {ns}/{sa}"))),
        }
        let mut args = vec!["create", "token", sa, "-n", ns, "--audience", KURYR_AUDIENCE, "--duration", "24h"];
        if let Some(n) = node {
            args.extend(["--bound-object-kind", "Node", "--bound-object-name", n]);
        }
        let token = self.kubectl(&args).await.with_context(|| format!("a kuryr token for {ns}/{sa}"))?;
        let token = token.trim().to_string();
        anyhow::ensure!(!token.is_empty(), "TokenRequest for {ns}/{sa} returned nothing");
        Ok(token)
    }

    /// [`KubeEnv::kuryr_token`] written to a private file in the state directory; its path.
    pub async fn kuryr_token_file(&self, ns: &str, sa: &str, node: Option<&str>) -> Result<PathBuf> {
        let token = self.kuryr_token(ns, sa, node).await?;
        let out = self.state_dir.join("tokens").join(format!("{ns}.{sa}.{}.token", node.unwrap_or("unbound")));
        write_private(&out, &token)?;
        Ok(out)
    }

    /// Writes a kubeconfig that authenticates as the user `user` in `groups` with a client
    /// certificate signed by the cluster's CA — how control-plane components such as
    /// kube-controller-manager (`system:kube-controller-manager`) are credentialed. The user's
    /// rights are whatever RBAC grants that name (the bootstrap policy has roles for the
    /// `system:` components). The key stays in the state directory's `pki/`.
    pub async fn user_kubeconfig(&self, user: &str, groups: &[&str]) -> Result<PathBuf> {
        anyhow::ensure!(
            !user.is_empty() && user.chars().all(|c| c.is_ascii_alphanumeric() || ":-_.@".contains(c)),
            "user name {user:?} must be non-empty ASCII letters, digits and :-_.@"
        );
        let pki = self.state_dir.join("pki");
        let file = user.replace(':', "-");
        let (key, csr, cert) =
            (pki.join(format!("{file}.key")), pki.join(format!("{file}.csr")), pki.join(format!("{file}.crt")));
        let ext = pki.join(format!("{file}.ext"));
        let subject: String = groups.iter().map(|g| format!("/O={g}")).chain([format!("/CN={user}")]).collect();
        std::fs::write(
            &ext,
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
        )?;
        let p = |p: &Path| p.display().to_string();
        let steps: [Vec<String>; 3] = [
            ["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out"]
                .iter()
                .map(ToString::to_string)
                .chain([p(&key)])
                .collect(),
            vec!["req".into(), "-new".into(), "-key".into(), p(&key), "-subj".into(), subject, "-out".into(), p(&csr)],
            vec![
                "x509".into(),
                "-req".into(),
                "-in".into(),
                p(&csr),
                "-CA".into(),
                p(&pki.join("ca.crt")),
                "-CAkey".into(),
                p(&pki.join("ca.key")),
                "-CAcreateserial".into(),
                "-days".into(),
                "365".into(),
                "-sha256".into(),
                "-extfile".into(),
                p(&ext),
                "-out".into(),
                p(&cert),
            ],
        ];
        for args in steps {
            let mut cmd = Command::new("openssl");
            cmd.args(&args);
            run(cmd, None, KUBECTL_TIMEOUT).await.with_context(|| format!("a client certificate for {user}"))?;
        }
        let _ = std::fs::remove_file(&csr);
        let _ = std::fs::remove_file(&ext);
        // Paths rather than inlined data: the files stay in the state directory as long as the
        // cluster does.
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: kuryr-test\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: {file}\n  user:\n    client-certificate: {crt}\n    client-key: {key}\ncontexts:\n- name: {file}@kuryr-test\n  context:\n    cluster: kuryr-test\n    user: {file}\ncurrent-context: {file}@kuryr-test\n",
            server = self.apiserver_url(),
            ca = p(&pki.join("ca.crt")),
            crt = p(&cert),
            key = p(&key),
        );
        let out = self.state_dir.join("users").join(format!("{file}.kubeconfig"));
        std::fs::create_dir_all(out.parent().context("no parent")?)?;
        std::fs::write(&out, kubeconfig).with_context(|| format!("writing {}", out.display()))?;
        Ok(out)
    }

    /// A client authenticated as the ServiceAccount `ns/sa` (see
    /// [`service_account_kubeconfig`](Self::service_account_kubeconfig)).
    pub async fn service_account_client(&self, ns: &str, sa: &str) -> Result<kube::Client> {
        let path = self.service_account_kubeconfig(ns, sa).await?;
        client_from_kubeconfig(&path).await
    }

    /// Runs `kubectl` as admin against this cluster and returns its stdout.
    pub async fn kubectl(&self, args: &[&str]) -> Result<String> {
        let mut cmd = Command::new("kubectl");
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display())).args(args);
        run(cmd, None, KUBECTL_TIMEOUT).await
    }

    /// Applies `deploy/crds` as admin and waits (on a watch, at most 90 s each) until each CRD
    /// named in `names` is Established.
    pub async fn install_crds(&self, names: &[String]) -> Result<()> {
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
        use kube::runtime::wait::{await_condition, conditions};
        const CRD_TIMEOUT: Duration = Duration::from_secs(90);
        self.apply_file(&crate::util::repo_root().join("deploy/crds")).await?;
        let crds: kube::Api<CustomResourceDefinition> = kube::Api::all(self.client().await?);
        for name in names {
            tokio::time::timeout(CRD_TIMEOUT, await_condition(crds.clone(), name, conditions::is_crd_established()))
                .await
                .map_err(|_| anyhow::anyhow!("CRD {name} not Established within {CRD_TIMEOUT:?}"))?
                .with_context(|| format!("watching CRD {name}"))?;
        }
        Ok(())
    }

    /// `kubectl apply -f PATH` as admin (a file or a directory of manifests); a directory
    /// holding a `kustomization.yaml` is applied as the kustomization it is (`-k`), as users do.
    pub async fn apply_file(&self, path: &Path) -> Result<String> {
        let flag = if path.join("kustomization.yaml").is_file() { "-k" } else { "-f" };
        let path = path.to_str().context("manifest path is not UTF-8")?;
        self.kubectl(&["apply", flag, path]).await
    }

    /// `kubectl apply -f -` as admin, with the manifests (YAML or JSON) on stdin.
    pub async fn apply_yaml(&self, manifests: &str) -> Result<String> {
        let mut cmd = Command::new("kubectl");
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display())).args(["apply", "-f", "-"]);
        run(cmd, Some(manifests.as_bytes()), KUBECTL_TIMEOUT).await
    }
}

impl Drop for KubeEnv {
    fn drop(&mut self) {
        run_down_script(&env_script("kube-down.sh"), "kube-down.sh", &self.state_dir, self.keep_state);
    }
}

/// The audience of the tokens kuryr's services exchange (their `--auth-audience` default).
pub const KURYR_AUDIENCE: &str = "kuryr";

/// Where [`KubeEnv::service_account_kubeconfig`] puts the account's kuryr token.
pub fn kuryr_token_path(kubeconfig: &Path) -> PathBuf {
    let mut p = kubeconfig.as_os_str().to_owned();
    p.push(".kuryr-token");
    PathBuf::from(p)
}

fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(path.parent().context("no parent")?)?;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new().create(true).truncate(true).write(true).mode(0o600).open(&tmp)?;
    f.write_all(text.as_bytes())?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

/// Builds a client from a kubeconfig file, the way a service run with `--kubeconfig` would.
pub async fn client_from_kubeconfig(path: &Path) -> Result<kube::Client> {
    install_crypto_provider();
    let kubeconfig = Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("loading kubeconfig {}", path.display()))?;
    kube::Client::try_from(config).context("building a Kubernetes client")
}

/// kube's `rustls-tls` feature builds its TLS config from rustls' process-wide default crypto
/// provider and does not pick one itself; install ring's (the provider this workspace compiles)
/// once. Losing the race to another installer is fine: any installed provider will do.
fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
