//! The install manifests: each kustomize overlay renders, the real API server accepts every object
//! (`kubectl apply --dry-run=server -k`), and every container's command line is accepted by the
//! binary it runs — so a renamed or removed flag breaks this test, not a user's rollout.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use kuryr_tests::kube::KubeEnv;
use kuryr_tests::services::bin_path;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn kubectl(kubeconfig: Option<&Path>, args: &[&str]) -> (bool, String) {
    let mut cmd = std::process::Command::new("kubectl");
    if let Some(k) = kubeconfig {
        cmd.arg("--kubeconfig").arg(k);
    }
    let out = cmd.args(args).current_dir(repo()).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// The objects of an overlay as the API server accepts them (`apply --dry-run=server`, as JSON).
fn dry_run(kubeconfig: &Path, overlay: &str) -> Vec<serde_json::Value> {
    let (ok, out) = kubectl(
        Some(kubeconfig),
        &["apply", "--dry-run=server", "-o", "json", "-k", &format!("deploy/overlays/{overlay}")],
    );
    assert!(ok, "{overlay}: the API server refused: {out}");
    let list: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{overlay}: {e}: {out}"));
    list["items"].as_array().unwrap().clone()
}

fn kinds(objs: &[serde_json::Value], kind: &str) -> Vec<String> {
    let mut v: Vec<String> = objs
        .iter()
        .filter(|o| o["kind"] == kind)
        .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}

/// Runs each container's binary with the manifest's arguments (and the env values that name flags
/// are checked the same way by clap) plus `--help`: clap parses every argument before it acts on
/// `--help`, so an unknown flag or a bad value fails.
fn check_command_lines(overlay: &str, objs: &[serde_json::Value]) {
    let mut checked = 0;
    for o in objs.iter().filter(|o| o["kind"] == "Deployment" || o["kind"] == "DaemonSet") {
        for c in o["spec"]["template"]["spec"]["containers"].as_array().unwrap() {
            let command = c["command"][0].as_str().unwrap();
            let bin = Path::new(command).file_name().unwrap().to_str().unwrap();
            let args: Vec<&str> = c["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
            let out = std::process::Command::new(bin_path(bin).unwrap())
                .args(&args)
                .arg("--help")
                .env_clear()
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{overlay}: {bin} rejects the manifest's arguments {args:?}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 5, "{overlay}: expected 5 service containers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlays_render_are_accepted_by_the_api_server_and_match_the_binaries() {
    let kube = KubeEnv::start().await.unwrap();
    let kc = kube.kubeconfig_path();
    // Server-side dry run needs the namespace to exist for namespaced objects.
    let (ok, out) = kubectl(Some(kc), &["apply", "-f", "deploy/base/namespace.yaml"]);
    assert!(ok, "{out}");
    for overlay in ["embedded", "openstack"] {
        let objs = dry_run(kc, overlay);
        assert_eq!(
            kinds(&objs, "CustomResourceDefinition"),
            [
                "addressblocks.kuryr.openstack.org",
                "namespacenetworks.kuryr.openstack.org",
                "network-attachment-definitions.k8s.cni.cncf.io",
                "podnetworks.kuryr.openstack.org",
                "podvifs.kuryr.openstack.org",
                "serviceloadbalancers.kuryr.openstack.org"
            ]
        );
        assert_eq!(
            kinds(&objs, "ServiceAccount"),
            [
                "kuryr-binder",
                "kuryr-lbaas",
                "kuryr-policy",
                "kuryr-pool-manager",
                "kuryr-vif-allocator",
                "kuryr-watcher"
            ]
        );
        assert_eq!(kinds(&objs, "Deployment"), ["kuryr-lbaas", "kuryr-policy", "kuryr-vif-allocator", "kuryr-watcher"]);
        assert_eq!(kinds(&objs, "DaemonSet"), ["kuryr-binder"]);
        // Each service runs under its own account.
        for o in objs.iter().filter(|o| o["kind"] == "Deployment" || o["kind"] == "DaemonSet") {
            let name = o["metadata"]["name"].as_str().unwrap();
            assert_eq!(o["spec"]["template"]["spec"]["serviceAccountName"], name, "{overlay}: {name}");
            assert_eq!(o["metadata"]["namespace"], "kuryr-system", "{overlay}: {name}");
        }
        // Whoever calls another kuryr service gets a projected token for the kuryr audience
        // only, where --auth-token-file expects it.
        for name in ["kuryr-binder", "kuryr-vif-allocator", "kuryr-lbaas", "kuryr-policy"] {
            let o = objs.iter().find(|o| o["metadata"]["name"] == name && o["spec"]["template"].is_object()).unwrap();
            let spec = &o["spec"]["template"]["spec"];
            let volume = spec["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "kuryr-token");
            let source = &volume.unwrap_or_else(|| panic!("{overlay}: {name} has no kuryr-token volume"))["projected"]
                ["sources"][0]["serviceAccountToken"];
            assert_eq!(
                (source["audience"].as_str(), source["path"].as_str()),
                (Some("kuryr"), Some("token")),
                "{name}"
            );
            let mounted = spec["containers"][0]["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["name"] == "kuryr-token" && m["mountPath"] == "/var/run/secrets/kuryr");
            assert!(mounted, "{overlay}: {name} does not mount its kuryr token at /var/run/secrets/kuryr");
        }
        // Nothing needs cluster DNS or the `kubernetes` ClusterIP to start: the services find each
        // other through their EndpointSlices (k8s: targets), and the API server's address comes
        // from the overlay's kuryr-apiserver ConfigMap.
        for o in objs.iter().filter(|o| o["kind"] == "Deployment" || o["kind"] == "DaemonSet") {
            let name = o["metadata"]["name"].as_str().unwrap();
            let c = &o["spec"]["template"]["spec"]["containers"][0];
            let args: Vec<&str> = c["args"].as_array().unwrap().iter().filter_map(|a| a.as_str()).collect();
            for a in &args {
                if let Some(t) =
                    ["--watcher=", "--allocator=", "--lbaas=", "--policy="].iter().find_map(|f| a.strip_prefix(f))
                {
                    assert!(t.starts_with("k8s:"), "{overlay}: {name} reaches {a} through DNS");
                }
            }
            assert_eq!(
                o["spec"]["template"]["spec"]["dnsPolicy"], "Default",
                "{overlay}: {name} would resolve through cluster DNS, which runs on kuryr's own network"
            );
            let env_from = c["envFrom"].as_array().unwrap();
            assert!(
                env_from
                    .iter()
                    .any(|e| e["configMapRef"]["name"].as_str().is_some_and(|n| n.starts_with("kuryr-apiserver"))),
                "{overlay}: {name} lacks the API server's address"
            );
            assert!(
                o["spec"]["template"]["spec"]["tolerations"].as_array().is_some_and(|t| t
                    .iter()
                    .any(|t| t["key"] == "node.kubernetes.io/not-ready" || t["operator"] == "Exists")),
                "{overlay}: {name} does not tolerate not-ready nodes"
            );
        }
        check_openstack_credentials(overlay, &objs);
        check_command_lines(overlay, &objs);
    }
}

/// With OpenStack, every service that calls it (the allocator on Neutron, lbaas on Octavia,
/// kuryr-policy on Neutron security groups) is switched to that backend and gets the cloud's
/// configuration and clouds.yaml; on the embedded overlay none of them is.
fn check_openstack_credentials(overlay: &str, objs: &[serde_json::Value]) {
    let openstack = overlay == "openstack";
    for (name, backend) in [
        ("kuryr-vif-allocator", "--backend=neutron"),
        ("kuryr-lbaas", "--backend=octavia"),
        ("kuryr-policy", "--backend=neutron"),
    ] {
        let o = objs.iter().find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == name).unwrap();
        let spec = &o["spec"]["template"]["spec"];
        let c = &spec["containers"][0];
        let args: Vec<&str> = c["args"].as_array().unwrap().iter().filter_map(|a| a.as_str()).collect();
        assert_eq!(args.contains(&backend), openstack, "{overlay}: {name} {backend}: {args:?}");
        let config = c["envFrom"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["configMapRef"]["name"].as_str())
            .find(|n| n.starts_with("kuryr-openstack"));
        assert_eq!(config.is_some(), openstack, "{overlay}: {name} and the kuryr-openstack ConfigMap");
        let mounted = c["volumeMounts"].as_array().unwrap().iter().any(|m| m["mountPath"] == "/etc/openstack");
        let secret = spec["volumes"].as_array().unwrap().iter().any(|v| v["secret"]["secretName"] == "kuryr-openstack");
        assert_eq!((mounted, secret), (openstack, openstack), "{overlay}: {name} and clouds.yaml at /etc/openstack");
        if let Some(config) = config {
            let cm = objs.iter().find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == config).unwrap();
            assert_eq!(cm["data"]["KURYR_OS_CLOUD"], "kuryr", "{overlay}: the cloud of the Secret's clouds.yaml");
        }
    }
}
