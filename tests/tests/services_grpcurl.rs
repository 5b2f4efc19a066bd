//! Every service can be inspected with grpcurl over TCP and over its unix socket — health,
//! reflection v1 and v1alpha, and its own APIs (reflection lists exactly those: no other service's
//! API) — even while what it depends on is unreachable;
//! it reports NOT_SERVING meanwhile, answers malformed requests with INVALID_ARGUMENT, counts
//! calls by status code in its metrics, flips to SERVING once its dependencies are up, and exits
//! promptly on SIGTERM, removing its socket.

use std::collections::BTreeSet;
use std::time::Duration;

use kuryr_tests::kube::KubeEnv;
use kuryr_tests::services::{ServiceProcess, grpcurl, wait_until};
use kuryr_tests::util::free_port;
use kuryr_tests::vifserver::ScriptedAllocator;

struct Svc {
    bin: &'static str,
    api: &'static str,
    /// The other kuryr APIs the binary serves.
    also: &'static [&'static str],
    /// The flag naming the dependency (pointed at a dead port in the first test).
    dep_flag: Option<&'static str>,
    /// A malformed request and the method it is sent to.
    bad_call: (&'static str, &'static str),
}

const SERVICES: &[Svc] = &[
    Svc {
        bin: "kuryr-watcher",
        api: "kuryr.watcher.v1.Watcher",
        also: &[],
        dep_flag: None,
        bad_call: ("kuryr.watcher.v1.Watcher/Subscribe", r#"{"kinds":["KIND_UNSPECIFIED"]}"#),
    },
    Svc {
        bin: "kuryr-vif-allocator",
        api: "kuryr.allocator.v1.VifAllocator",
        also: &["kuryr.allocator.v1.PoolManager"],
        dep_flag: Some("--watcher"),
        bad_call: ("kuryr.allocator.v1.VifAllocator/WatchVifs", r#"{"node_name":""}"#),
    },
    Svc {
        bin: "kuryr-lbaas",
        api: "kuryr.lbaas.v1.LoadBalancers",
        also: &[],
        dep_flag: Some("--watcher"),
        bad_call: ("kuryr.lbaas.v1.LoadBalancers/GetLoadBalancer", r#"{"name":"x"}"#),
    },
    Svc {
        bin: "kuryr-binder",
        api: "kuryr.binder.v1.Cni",
        also: &[],
        dep_flag: Some("--allocator"),
        bad_call: ("kuryr.binder.v1.Cni/Add", r#"{"shim_version":"0.0.0-not-this"}"#),
    },
    Svc {
        bin: "kuryr-policy",
        api: "kuryr.policy.v1.Policies",
        also: &[],
        dep_flag: Some("--watcher"),
        bad_call: ("kuryr.policy.v1.Policies/GetNodePolicy", r#"{"node_name":"Not_A_Node"}"#),
    },
];

struct Running {
    proc: ServiceProcess,
    tcp: String,
    unix: String,
    socket: std::path::PathBuf,
    metrics: String,
    /// After `proc`: dropped once the process is.
    _host_table: Option<kuryr_tests::binder::HostTable>,
}

fn start(svc: &Svc, dir: &std::path::Path, extra: &[String]) -> anyhow::Result<Running> {
    let port = free_port()?;
    let mport = free_port()?;
    let socket = dir.join(format!("{}.sock", svc.bin));
    // The binder serves on its unix socket only: there its "TCP" target is the socket too.
    let (tcp, listen) = if svc.bin == "kuryr-binder" {
        (format!("unix://{}", socket.display()), format!("unix:{}", socket.display()))
    } else {
        let tcp = format!("127.0.0.1:{port}");
        (tcp.clone(), format!("{tcp},unix:{}", socket.display()))
    };
    let mut args = vec![
        "--listen".to_string(),
        listen,
        "--metrics-listen".to_string(),
        format!("127.0.0.1:{mport}"),
        "--shutdown-grace".to_string(),
        "3s".to_string(),
    ];
    args.extend_from_slice(extra);
    // A binder here runs in the host's network namespace.
    let host_table = if svc.bin == "kuryr-binder" { Some(kuryr_tests::binder::HostTable::claim()?) } else { None };
    let proc = ServiceProcess::spawn(svc.bin, &args, dir)?;
    Ok(Running {
        proc,
        _host_table: host_table,
        tcp,
        unix: format!("unix://{}", socket.display()),
        socket,
        metrics: format!("http://127.0.0.1:{mport}/metrics"),
    })
}

async fn health(target: &str, service: &str) -> anyhow::Result<String> {
    let body = format!(r#"{{"service":"{service}"}}"#);
    let (ok, out) = grpcurl(&["-plaintext", "-d", &body, target, "grpc.health.v1.Health/Check"]).await?;
    anyhow::ensure!(ok, "health check failed: {out}");
    Ok(out)
}

async fn http_get(url: &str) -> anyhow::Result<String> {
    let out = tokio::process::Command::new("curl").args(["-sf", url]).output().await?;
    anyhow::ensure!(out.status.success(), "GET {url} failed");
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test]
async fn every_service_is_inspectable_while_its_dependencies_are_down() {
    let dir = tempfile::tempdir().unwrap();
    let dead = format!("127.0.0.1:{}", free_port().unwrap());
    for svc in SERVICES {
        let mut extra = Vec::new();
        if svc.bin == "kuryr-binder" {
            extra.extend(["--state-dir".to_string(), dir.path().join("binder-state").display().to_string()]);
        }
        match svc.dep_flag {
            Some(flag) => extra.extend([flag.to_string(), dead.clone()]),
            None => {
                extra.extend(["--kubeconfig".to_string(), dir.path().join("missing-kubeconfig").display().to_string()])
            }
        }
        let mut r = start(svc, dir.path(), &extra).unwrap();

        for target in [r.tcp.as_str(), r.unix.as_str()] {
            let listed = wait_until(&format!("{} to answer on {target}", svc.bin), Duration::from_secs(20), || async {
                let (ok, out) = grpcurl(&["-plaintext", target, "list"]).await?;
                anyhow::ensure!(ok, "{out}");
                Ok(out)
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", r.proc.logs()));
            // Exactly what the binary serves: health, reflection and its own APIs, no other's.
            let mut want: BTreeSet<&str> = [
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
                svc.api,
            ]
            .into();
            want.extend(svc.also);
            let got: BTreeSet<&str> = listed.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
            assert_eq!(got, want, "{}: services listed over {target}", svc.bin);
            // Reflection describes the service's own APIs, and not the others'.
            for api in std::iter::once(&svc.api).chain(svc.also) {
                let (ok, described) = grpcurl(&["-plaintext", target, "describe", api]).await.unwrap();
                assert!(ok && described.contains("is a service"), "{}: describe {api} failed: {described}", svc.bin);
            }
            for other in SERVICES.iter().filter(|o| o.bin != svc.bin) {
                let (ok, described) = grpcurl(&["-plaintext", target, "describe", other.api]).await.unwrap();
                assert!(!ok, "{}: describes {}, which it does not serve: {described}", svc.bin, other.api);
            }
        }
        // The older reflection protocol answers too.
        let (ok, out) = grpcurl(&[
            "-plaintext",
            "-d",
            r#"{"list_services":""}"#,
            &r.tcp,
            "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        ])
        .await
        .unwrap();
        assert!(ok && out.contains(svc.api), "{}: v1alpha reflection: {out}", svc.bin);

        // The unix socket is private.
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&r.socket).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}: socket mode", svc.bin);

        // Dependencies are unreachable: NOT_SERVING, overall and for the API.
        let h = health(&r.tcp, svc.api).await.unwrap();
        assert!(h.contains("\"NOT_SERVING\""), "{}: {h}", svc.bin);
        let h = health(&r.tcp, "").await.unwrap();
        assert!(h.contains("\"NOT_SERVING\""), "{}: {h}", svc.bin);

        // A malformed request is refused naming the problem (the binder, root on its socket); the
        // services' APIs want a ServiceAccount token before anything else.
        let (method, body) = svc.bad_call;
        let (ok, out) = grpcurl(&["-plaintext", "-d", body, &r.tcp, method]).await.unwrap();
        assert!(!ok, "{}: {method} accepted {body}", svc.bin);
        let expected = if svc.bin == "kuryr-binder" { "FailedPrecondition" } else { "Unauthenticated" };
        assert!(out.contains(expected), "{}: {method} {body}: {out}", svc.bin);

        // Metrics count calls by code.
        let metrics = http_get(&r.metrics).await.unwrap();
        let (service, m) = method.split_once('/').unwrap();
        let code = if svc.bin == "kuryr-binder" { "FAILED_PRECONDITION" } else { "UNAUTHENTICATED" };
        let line = format!(r#"grpc_server_handled_total{{service="{service}",method="{m}",code="{code}"}} 1"#);
        assert!(metrics.contains(&line), "{}: metrics lack {line}:\n{metrics}", svc.bin);

        // SIGTERM: prompt exit, socket removed.
        let took = r.proc.terminate(Duration::from_secs(10)).await.unwrap();
        assert!(took < Duration::from_secs(5), "{}: took {took:?} to stop", svc.bin);
        assert!(!r.socket.exists(), "{}: socket left behind", svc.bin);
    }
}

#[tokio::test]
async fn services_become_serving_once_their_dependencies_are() {
    let kube = KubeEnv::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = kube.kubeconfig_path().display().to_string();
    // The allocator needs its CRDs Established and a PodNetwork (it creates one from --network-cidrs).
    kube.apply_file(&kuryr_tests::util::repo_root().join("deploy/crds")).await.unwrap();
    wait_until("CRDs Established", Duration::from_secs(30), || async {
        let out = kube.kubectl(&["wait", "--for=condition=Established", "crd", "--all", "--timeout=5s"]).await?;
        anyhow::ensure!(out.contains("condition met"), "{out}");
        Ok(())
    })
    .await
    .unwrap();
    // The allocator's and lbaas' shard Leases live in their namespace, as when deployed.
    kube.kubectl(&["create", "namespace", "kuryr-system"]).await.unwrap();
    let watcher = start(&SERVICES[0], dir.path(), &["--kubeconfig".into(), kubeconfig.clone()]).unwrap();
    // The services run with the admin kubeconfig here; towards each other they authenticate as
    // their own ServiceAccounts, with tokens for the kuryr audience.
    let token_of = async |sa: &str| {
        let f = kube.kuryr_token_file("kuryr-system", sa, None).await.unwrap();
        ["--auth-token-file".to_string(), f.display().to_string()]
    };
    let [af, allocator_token] = token_of("kuryr-vif-allocator").await;
    let [lf, lbaas_token] = token_of("kuryr-lbaas").await;
    let [pf, policy_token] = token_of("kuryr-policy").await;
    let allocator = start(
        &SERVICES[1],
        dir.path(),
        &[
            "--watcher".into(),
            watcher.unix.replace("unix://", "unix:"),
            "--kubeconfig".into(),
            kubeconfig.clone(),
            "--network-cidrs".into(),
            "10.244.0.0/16".into(),
            af,
            allocator_token,
        ],
    )
    .unwrap();
    // lbaas serves once its records (ServiceLoadBalancers) are loaded and the watcher is live.
    let lbaas = start(
        &SERVICES[2],
        dir.path(),
        &["--watcher".into(), watcher.tcp.clone(), "--kubeconfig".into(), kubeconfig.clone(), lf, lbaas_token],
    )
    .unwrap();
    // The binder serves once its VIF stream is live; the allocator's stream is served here by a
    // scripted allocator (the real one is covered by the end-to-end suite).
    let scripted = ScriptedAllocator::new(true).serve_unix(&dir.path().join("alloc.sock")).await.unwrap();
    let binder = start(
        &SERVICES[3],
        dir.path(),
        &[
            "--allocator".into(),
            scripted.target.clone(),
            "--node-name".into(),
            "n1".into(),
            "--state-dir".into(),
            dir.path().join("binder-state").display().to_string(),
        ],
    )
    .unwrap();
    // kuryr-policy serves once the watcher's first snapshot is compiled.
    let policy = start(
        &SERVICES[4],
        dir.path(),
        &["--watcher".into(), watcher.tcp.clone(), "--kubeconfig".into(), kubeconfig, pf, policy_token],
    )
    .unwrap();
    for (svc, r) in SERVICES.iter().zip([&watcher, &allocator, &lbaas, &binder, &policy]) {
        wait_until(&format!("{} SERVING", svc.bin), Duration::from_secs(30), || async {
            let h = health(&r.tcp, svc.api).await?;
            anyhow::ensure!(h.contains("\"SERVING\""), "{h}");
            Ok(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", r.proc.logs()));
    }
    // grpcurl calls the APIs with a ServiceAccount token for the kuryr audience, of the account
    // whose role the method is; without one it is told so.
    let binder_token = kube.kuryr_token("kuryr-system", "kuryr-binder", None).await.unwrap();
    let [h, header] = kuryr_tests::auth::grpcurl_header(&binder_token);
    let get_vif =
        ["-plaintext", "-d", r#"{"pod_uid":"nope"}"#, allocator.tcp.as_str(), "kuryr.allocator.v1.VifAllocator/GetVif"];
    let (ok, out) = grpcurl(&get_vif).await.unwrap();
    assert!(!ok && out.contains("Unauthenticated"), "{out}");
    let (ok, out) = grpcurl(&[&[h.as_str(), header.as_str()][..], &get_vif].concat()).await.unwrap();
    assert!(!ok && out.contains("NotFound"), "with the binder's token: {out}");
    // kuryr-policy's compiled policies are the binders' to read as well.
    let get_policy =
        ["-plaintext", "-d", r#"{"node_name":"n1"}"#, policy.tcp.as_str(), "kuryr.policy.v1.Policies/GetNodePolicy"];
    let (ok, out) = grpcurl(&get_policy).await.unwrap();
    assert!(!ok && out.contains("Unauthenticated"), "{out}");
    let (ok, out) = grpcurl(&[&[h.as_str(), header.as_str()][..], &get_policy].concat()).await.unwrap();
    assert!(ok && out.contains("\"nodeName\": \"n1\""), "with the binder's token: {out}");

    // The binder answers VERSION for its own shim version.
    let body = format!(r#"{{"shim_version":"{}"}}"#, env!("CARGO_PKG_VERSION"));
    let (ok, out) = grpcurl(&["-plaintext", "-d", &body, &binder.unix, "kuryr.binder.v1.Cni/Version"]).await.unwrap();
    assert!(ok && out.contains("1.1.0"), "{out}");

    // Losing the watcher takes its dependents out of service.
    let mut watcher = watcher;
    watcher.proc.kill().await.unwrap();
    for (name, addr, api) in
        [("allocator", &allocator.tcp, SERVICES[1].api), ("kuryr-policy", &policy.tcp, SERVICES[4].api)]
    {
        wait_until(&format!("{name} NOT_SERVING after the watcher died"), Duration::from_secs(30), || async {
            let h = health(addr, api).await?;
            anyhow::ensure!(h.contains("NOT_SERVING"), "{h}");
            Ok(())
        })
        .await
        .unwrap();
    }
}
