//! VMs for nested pods (`kuryr-vif-allocator --nested-trunks`) on the harness of
//! [`crate::neutron`]: each VM is a network namespace standing in for a Nova instance whose
//! Neutron port (bound to the agent's host) is the parent of a trunk, plugged as os-vif plugs a
//! VLAN-aware instance — a trunk bridge `tbr-<trunk id>` on the node's Open vSwitch holding the
//! VM's tap (a veth whose other end is the VM's `eth0`), which the OVS agent's trunk driver
//! wires to `br-int`, one patch port per subport and VLAN id. Inside the VM runs its own Open
//! vSwitch (a second ovsdb-server/ovs-vswitchd, userspace datapath, in the VM's namespace) with
//! a bridge `br-vm` on `eth0`, for a binder with `--nested-plug ovs`. The VM's Kubernetes Node
//! has the parent port's IPv4 address as InternalIP: how the allocator finds its trunk.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kuryr_openstack::neutron::{Port, PortCreate, PortUpdate, TrunkCreate};
use serde_json::json;

use crate::binder::Binder;
use crate::netns::Netns;
use crate::neutron::{NeutronCluster, SYSTEM_NAMESPACE, Svc};
use crate::util::unique_id;

/// The VM's Open vSwitch bridge, on its `eth0`.
pub const VM_BRIDGE: &str = "br-vm";

/// `ovs-vsctl --db=<db> <args>`; its stdout.
pub fn vsctl(db: &str, args: &[&str]) -> Result<String> {
    let out = Command::new("ovs-vsctl").arg(format!("--db={db}")).arg("--timeout=30").args(args).output()?;
    ensure!(out.status.success(), "ovs-vsctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs a command in the Neutron node's namespace (the OpenStack env's: never deleted here).
fn in_node(c: &NeutronCluster, argv: &[&str]) -> Result<()> {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", c.node.netns_path().display()))
        .arg("--")
        .args(argv)
        .output()?;
    ensure!(out.status.success(), "{argv:?} in the node: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// A private Open vSwitch (ovsdb-server + ovs-vswitchd, userspace datapath) running inside a
/// network namespace: the VM's own switch. Stopped on drop.
#[derive(Debug)]
pub struct VmSwitch {
    dir: tempfile::TempDir,
    children: Vec<Child>,
}

impl VmSwitch {
    /// Starts the switch in `netns` and waits until its database answers.
    pub fn start(netns: &Netns) -> Result<VmSwitch> {
        let dir = tempfile::Builder::new().prefix("kuryr-vmovs-").tempdir_in("/tmp")?;
        let d = dir.path().to_path_buf();
        let db = d.join("conf.db");
        let st = Command::new("ovsdb-tool")
            .arg("create")
            .arg(&db)
            .arg("/usr/share/openvswitch/vswitch.ovsschema")
            .status()?;
        ensure!(st.success(), "ovsdb-tool create {}", db.display());
        let spawn = |argv: Vec<String>| -> Result<Child> {
            let log = std::fs::File::create(d.join(format!("{}.out", argv[0])))?;
            Command::new("nsenter")
                .arg(format!("--net={}", netns.path().display()))
                .arg("--")
                .arg("env")
                .arg(format!("OVS_RUNDIR={}", d.display()))
                .arg(format!("OVS_DBDIR={}", d.display()))
                .arg(format!("OVS_LOGDIR={}", d.display()))
                .arg(format!("OVS_SYSCONFDIR={}", d.display()))
                .args(&argv)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting {}", argv[0]))
        };
        let sock = d.join("db.sock");
        let mut children = vec![spawn(vec![
            "ovsdb-server".into(),
            db.display().to_string(),
            format!("--remote=punix:{}", sock.display()),
            format!("--pidfile={}", d.join("ovsdb-server.pid").display()),
            format!("--log-file={}", d.join("ovsdb-server.log").display()),
        ])?];
        let mut switch = Self { dir, children: Vec::new() };
        let t0 = Instant::now();
        while !sock.exists() {
            if t0.elapsed() > Duration::from_secs(30) {
                for c in &mut children {
                    let _ = c.kill();
                }
                bail!("the VM's ovsdb-server did not start");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        switch.children = children;
        vsctl(&switch.db(), &["--no-wait", "init"])?;
        switch.children.push(spawn(vec![
            "ovs-vswitchd".into(),
            format!("unix:{}", sock.display()),
            format!("--pidfile={}", d.join("ovs-vswitchd.pid").display()),
            format!("--log-file={}", d.join("ovs-vswitchd.log").display()),
        ])?);
        Ok(switch)
    }

    /// `unix:<dir>/db.sock`, for `ovs-vsctl --db=` and the binder's `--ovs-db`.
    pub fn db(&self) -> String {
        format!("unix:{}", self.dir.path().join("db.sock").display())
    }

    /// ovs-vswitchd's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("ovs-vswitchd.log")).unwrap_or_default()
    }
}

impl Drop for VmSwitch {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A VM: its parent port and trunk in Neutron, its Kubernetes Node, its namespace and switch,
/// and (once started) its binder.
#[derive(Debug)]
pub struct Vm {
    /// The Node's name (and the parent port's name and device id).
    pub name: String,
    pub parent: Port,
    /// The trunk id.
    pub trunk: String,
    pub netns: Arc<Netns>,
    pub switch: VmSwitch,
    pub binder: Option<Arc<Binder>>,
}

impl Vm {
    /// Makes VM number `i`: parent port and trunk (as Nova boots a VLAN-aware instance: the
    /// trunk on an unused port, then the port bound to the host), the Node, the namespace with
    /// its switch, and the tap on the node's trunk bridge.
    pub async fn start(c: &NeutronCluster, i: u32) -> Result<Vm> {
        let name = format!("vm{i}-{}", unique_id());
        let create = PortCreate {
            network_id: c.net.network_id.clone(),
            name: Some(name.clone()),
            project_id: Some(c.net.project_id.clone()),
            admin_state_up: Some(true),
            ..PortCreate::default()
        };
        let parent = c.neutron.create_port(create).await?;
        let trunk = c
            .neutron
            .create_trunk(TrunkCreate {
                port_id: parent.id.clone(),
                name: Some(name.clone()),
                project_id: Some(c.net.project_id.clone()),
                ..TrunkCreate::default()
            })
            .await?;
        let update = PortUpdate {
            device_id: Some(name.clone()),
            device_owner: Some("compute:nova".into()),
            binding_host_id: Some(c.node.host.clone()),
            ..PortUpdate::default()
        };
        let parent = c.neutron.update_port(&parent.id, &update, None).await?;
        let ip = parent
            .fixed_ips
            .iter()
            .filter_map(|f| f.ip_address.clone())
            .find(|a| !a.contains(':'))
            .context("the parent port has no IPv4 address")?;
        let nodes: Api<Node> = Api::all(c.admin.clone());
        let meta = ObjectMeta { name: Some(name.clone()), ..Default::default() };
        nodes.create(&PostParams::default(), &Node { metadata: meta, ..Default::default() }).await?;
        let status = json!({"status": {"addresses": [{"type": "InternalIP", "address": ip}]}});
        nodes.patch_status(&name, &PatchParams::default(), &Patch::Merge(status)).await?;

        let netns = Arc::new(Netns::new("vm")?);
        let switch = VmSwitch::start(&netns)?;
        let tap = format!("vt{}", unique_id());
        in_node(c, &["ip", "link", "add", &tap, "type", "veth", "peer", "name", "eth0", "netns", &netns.name])?;
        netns.exec(&["ip", "link", "set", "eth0", "up"])?;
        in_node(c, &["ip", "link", "set", &tap, "up"])?;
        // os-vif's name for the trunk bridge, which the agent's trunk driver watches for.
        let tbr: String = format!("tbr-{}", trunk.id).chars().take(14).collect();
        let ext = |k: &str, v: &str| format!("external_ids:{k}=\"{v}\"");
        let (iface, mac, vm) =
            (ext("iface-id", &parent.id), ext("attached-mac", &parent.mac_address), ext("vm-uuid", &name));
        let status = ext("iface-status", "active");
        vsctl(
            &c.node.ovsdb(),
            &[
                "--may-exist",
                "add-br",
                &tbr,
                "--",
                "set",
                "Bridge",
                &tbr,
                "datapath_type=netdev",
                "--",
                "add-port",
                &tbr,
                &tap,
                "--",
                "set",
                "Interface",
                &tap,
                &iface,
                &mac,
                &status,
                &vm,
            ],
        )?;
        let db = switch.db();
        vsctl(&db, &["add-br", VM_BRIDGE, "--", "set", "Bridge", VM_BRIDGE, "datapath_type=netdev"])?;
        vsctl(&db, &["add-port", VM_BRIDGE, "eth0"])?;
        Ok(Vm { name, parent, trunk: trunk.id, netns, switch, binder: None })
    }

    /// Starts the VM's binder (`--nested-plug ovs` on [`VM_BRIDGE`]) following `alloc` over its
    /// unix socket, under a binder token bound to the VM's Node.
    pub async fn start_binder(&mut self, c: &NeutronCluster, alloc: &Svc, vif_wait: Duration) -> Result<()> {
        let token = c.kube.kuryr_token_file(SYSTEM_NAMESPACE, crate::cluster::BINDER_ACCOUNT, Some(&self.name)).await?;
        let args: Vec<String> = [
            "--ovs-db",
            &self.switch.db(),
            "--nested-plug",
            "ovs",
            "--nested-ovs-bridge",
            VM_BRIDGE,
            "--vif-wait-timeout",
            &format!("{}s", vif_wait.as_secs().max(1)),
            "--auth-token-file",
            &token.display().to_string(),
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        let b = Binder::start(&self.name, &self.netns.path(), &format!("unix:{}", alloc.sock.display()), &args).await?;
        self.binder = Some(Arc::new(b));
        Ok(())
    }

    /// The binder, once started.
    pub fn binder(&self) -> Result<Arc<Binder>> {
        self.binder.clone().context("the VM's binder is not started")
    }

    /// The subports of the VM's trunk: port id → VLAN id.
    pub async fn subports(&self, c: &NeutronCluster) -> Result<BTreeMap<String, u32>> {
        let t = c.neutron.get_trunk(&self.trunk).await?;
        Ok(t.sub_ports.into_iter().map(|s| (s.port_id, s.segmentation_id)).collect())
    }

    /// The VM namespace's path.
    pub fn netns_path(&self) -> PathBuf {
        self.netns.path()
    }
}
