//! The shim as the runtime sees it, with no binder running: VERSION, validation errors, and an
//! unreachable binder (or one that drops the connection) failing fast.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{config, env_for, shim};
use serde_json::json;

const ALL: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

#[test]
fn version_answers_for_every_cni_version() {
    for v in ALL {
        let r = shim(&[("CNI_COMMAND", "VERSION")], format!(r#"{{"cniVersion":"{v}"}}"#).as_bytes());
        assert_eq!(r.status, 0, "{r:?}");
        assert_eq!(r.json(), json!({"cniVersion": v, "supportedVersions": ALL}), "{v}");
    }
    // No stdin at all, and a version we do not speak: the latest is named.
    for stdin in [&b""[..], br#"{"cniVersion":"0.2.0"}"#] {
        let r = shim(&[("CNI_COMMAND", "VERSION")], stdin);
        assert_eq!(r.json(), json!({"cniVersion": "1.1.0", "supportedVersions": ALL}));
    }
}

#[test]
fn each_missing_variable_is_code_4_naming_it() {
    let sock = Path::new("/nonexistent/kuryr/binder.sock");
    let required: &[(&str, &[&str])] = &[
        ("ADD", &["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"]),
        ("CHECK", &["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"]),
        ("DEL", &["CNI_COMMAND", "CNI_CONTAINERID", "CNI_IFNAME"]),
        ("GC", &["CNI_COMMAND", "CNI_PATH"]),
        ("STATUS", &["CNI_COMMAND"]),
        ("VERSION", &["CNI_COMMAND"]),
    ];
    for (cmd, vars) in required {
        for var in *vars {
            let env: Vec<_> = env_for(cmd).into_iter().filter(|(k, _)| k != var).collect();
            let r = shim(&env, config("1.0.0", sock, 5).as_bytes());
            let v = r.assert_error(4, var);
            assert_eq!(v["cniVersion"], "1.0.0", "{r:?}");
            // Empty counts as missing.
            let mut env = env_for(cmd);
            env.retain(|(k, _)| k != var);
            env.push((var, ""));
            shim(&env, config("1.0.0", sock, 5).as_bytes()).assert_error(4, var);
        }
    }
}

#[test]
fn del_without_netns_reaches_for_the_binder() {
    let env: Vec<_> = env_for("DEL").into_iter().filter(|(k, _)| *k != "CNI_NETNS").collect();
    let r = shim(&env, config("1.1.0", Path::new("/nonexistent/b.sock"), 5).as_bytes());
    r.assert_error(11, "kuryr-binder is not reachable at /nonexistent/b.sock");
}

#[test]
fn unparsable_stdin_is_code_6() {
    let r = shim(&env_for("ADD"), b"{\"cniVersion\": \"1.0.0\",");
    let v = r.assert_error(6, "EOF while parsing a value at line 1 column 23");
    assert_eq!(v["cniVersion"], "1.1.0", "the version could not be read: the latest is used");
}

#[test]
fn unsupported_cni_version_is_code_1() {
    let r = shim(&env_for("ADD"), br#"{"cniVersion":"0.2.0","name":"kuryr","type":"kuryr-cni"}"#);
    r.assert_error(1, "unsupported cniVersion \"0.2.0\"; supported: 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0");
}

#[test]
fn missing_name_is_code_7() {
    shim(&env_for("ADD"), br#"{"cniVersion":"1.0.0","type":"kuryr-cni"}"#).assert_error(7, "\"name\"");
}

#[test]
fn oversized_config_is_code_7_with_its_size() {
    let mut big = config("1.0.0", Path::new("/nonexistent/b.sock"), 5).into_bytes();
    big.resize(3 * 1024 * 1024 + 1, b' ');
    let r = shim(&env_for("ADD"), &big);
    r.assert_error(7, &format!("oversized config: {} bytes", big.len()));
}

#[test]
fn malformed_cni_args_is_code_4() {
    let mut env = env_for("ADD");
    env.retain(|(k, _)| *k != "CNI_ARGS");
    env.push(("CNI_ARGS", "K8S_POD_NAME=web-0;oops"));
    shim(&env, config("1.0.0", Path::new("/nonexistent/b.sock"), 5).as_bytes()).assert_error(4, "\"oops\"");
}

#[test]
fn absent_binder_socket_is_code_11_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("binder.sock");
    for cmd in ["ADD", "DEL", "CHECK", "GC"] {
        let r = shim(&env_for(cmd), config("1.1.0", &sock, 120).as_bytes());
        r.assert_error(11, &format!("kuryr-binder is not reachable at {}: No such file or directory", sock.display()));
        assert!(r.took < Duration::from_secs(1), "{cmd} took {:?}", r.took);
        assert!(r.stderr.contains("failed"), "the failure is logged on stderr: {r:?}");
    }
    let r = shim(&env_for("STATUS"), config("1.1.0", &sock, 120).as_bytes());
    r.assert_error(50, "kuryr-binder is not reachable");
}

#[test]
fn refused_connection_is_code_11_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("binder.sock");
    // A socket file nobody listens on any more: connecting is refused.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let r = shim(&env_for("ADD"), config("0.4.0", &sock, 120).as_bytes());
    let v = r.assert_error(11, "Connection refused");
    assert_eq!(v["cniVersion"], "0.4.0");
    assert!(r.took < Duration::from_secs(1), "took {:?}", r.took);
}

#[test]
fn a_binder_that_drops_the_connection_is_code_11_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("binder.sock");
    // Accepts, reads what the shim sends, and closes, as a binder going down mid-call does.
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let server = std::thread::spawn(move || {
        for _ in 0..2 {
            let (mut conn, _) = listener.accept().unwrap();
            let _ = std::io::Read::read(&mut conn, &mut [0u8; 65536]);
        }
    });
    let r = shim(&env_for("ADD"), config("1.1.0", &sock, 120).as_bytes());
    r.assert_error(11, &format!("kuryr-binder is not reachable at {}: the binder connection failed", sock.display()));
    assert!(r.took < Duration::from_secs(1), "took {:?}", r.took);
    let r = shim(&env_for("STATUS"), config("1.1.0", &sock, 120).as_bytes());
    r.assert_error(50, "kuryr-binder is not reachable");
    server.join().unwrap();
}

#[test]
fn log_file_takes_the_logs() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("kuryr-cni.log");
    let conf = json!({
        "cniVersion": "1.0.0", "name": "kuryr", "type": "kuryr-cni",
        "binderSocket": dir.path().join("absent.sock"), "logFile": log,
    });
    let r = shim(&env_for("ADD"), conf.to_string().as_bytes());
    r.assert_error(11, "not reachable");
    assert_eq!(r.stderr, "", "logs went to the file");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("ADD failed") && text.contains("not reachable"), "{text}");
}
