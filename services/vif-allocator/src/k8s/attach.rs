//! The API side of further interfaces ([`crate::core::attach`]): read the pod's
//! NetworkAttachmentDefinitions and the PodNetworks they name, allocate an address per network
//! from the embedded IPAM (keyed by the pod's uid, as the primary one), and give them back; with
//! the Neutron backend, hand the Neutron networks they name to [`crate::backend::neutron::attach`].
//!
//! Allocation is all or nothing: when one network fails, the addresses this call took on the
//! others are released before the error is returned, so a pod with a bad annotation holds no
//! further address while it waits to be fixed or deleted.

use std::collections::BTreeSet;

use kube::api::Api;

use crate::backend::any::AnyBackend;
use crate::backend::ipam::IpamStore;
use crate::backend::neutron::attach::ExtraRequest;
use crate::core::PodKey;
use crate::core::attach::{self, Target};
use crate::core::ipam::ipnet::IpNet;
use crate::core::{AttachedRecord, VifIp, VifRoute};
use crate::error::ClusterError;
use crate::k8s::crd::{NetworkAttachmentDefinition, PodNetwork};

/// Reads the definition a request names.
async fn definition(client: &kube::Client, r: &attach::Request) -> Result<Target, ClusterError> {
    let what = r.attachment();
    let api: Api<NetworkAttachmentDefinition> = Api::namespaced(client.clone(), &r.namespace);
    let nad = api
        .get_opt(&r.name)
        .await
        .map_err(|e| ClusterError::Api {
            action: format!("reading NetworkAttachmentDefinition {what}"),
            source: Box::new(e),
        })?
        .ok_or_else(|| {
            ClusterError::Attachment(format!(
                "annotation {}: NetworkAttachmentDefinition {what} does not exist",
                attach::NETWORKS_ANNOTATION
            ))
        })?;
    attach::parse_config(&what, nad.spec.config.as_deref()).map_err(ClusterError::Attachment)
}

/// Allocates the further interfaces the `networks` annotation of `pod` asks for.
pub async fn attach(
    client: &kube::Client,
    backend: &AnyBackend,
    primary: &str,
    pod: &PodKey,
    node: &str,
    networks: &str,
) -> Result<Vec<AttachedRecord>, ClusterError> {
    let requests = attach::parse_networks(networks, &pod.namespace).map_err(ClusterError::Attachment)?;
    let embedded = match backend {
        AnyBackend::Embedded(embedded) => embedded,
        AnyBackend::Neutron(neutron) => {
            // Every definition read first: nothing is made for a pod whose request is bad.
            let mut extras = Vec::with_capacity(requests.len());
            for r in &requests {
                let what = r.attachment();
                match definition(client, r).await? {
                    Target::Neutron { network, subnets, security_groups } => extras.push(ExtraRequest {
                        attachment: what,
                        ifname: r.ifname.clone(),
                        network,
                        subnets,
                        security_groups,
                    }),
                    Target::PodNetwork(n) => {
                        return Err(ClusterError::Attachment(format!(
                            "NetworkAttachmentDefinition {what} names PodNetwork {n}, but this allocator runs the \
                             Neutron backend: name a Neutron network (\"neutronNetwork\")"
                        )));
                    }
                }
            }
            return neutron.attach_ports(pod, node, &extras).await;
        }
    };
    let store = embedded.store();
    // Resolve every definition first: nothing is allocated for a pod whose request is bad.
    let mut targets = Vec::with_capacity(requests.len());
    let mut seen = BTreeSet::new();
    for r in &requests {
        let what = r.attachment();
        let network = match definition(client, r).await? {
            Target::PodNetwork(n) => n,
            Target::Neutron { .. } => {
                return Err(ClusterError::Attachment(format!(
                    "NetworkAttachmentDefinition {what} names a Neutron network, but this allocator runs the embedded \
                     backend: name a PodNetwork (\"podNetwork\")"
                )));
            }
        };
        if network == primary {
            return Err(ClusterError::Attachment(format!(
                "NetworkAttachmentDefinition {what} names PodNetwork {network}, the pods' primary network: a further \
                 interface needs another network"
            )));
        }
        if !seen.insert(network.clone()) {
            return Err(ClusterError::Attachment(format!(
                "annotation {}: PodNetwork {network} is asked for twice (through {what}); a pod gets one interface per \
                 network",
                attach::NETWORKS_ANNOTATION
            )));
        }
        let pn: Api<PodNetwork> = Api::all(client.clone());
        let spec = pn
            .get_opt(&network)
            .await
            .map_err(|e| ClusterError::Api { action: format!("reading PodNetwork {network}"), source: Box::new(e) })?
            .ok_or_else(|| {
                ClusterError::Attachment(format!(
                    "NetworkAttachmentDefinition {what} names PodNetwork {network}, which does not exist"
                ))
            })?
            .spec;
        targets.push((r, network, spec.cidrs));
    }
    let mut out = Vec::with_capacity(targets.len());
    for (r, network, cidrs) in &targets {
        match allocate(store, r, network, cidrs, pod, node).await {
            Ok(a) => out.push(a),
            Err(e) => {
                let taken: Vec<String> = out.iter().map(|a| a.network.clone()).collect();
                if let Err(undo) = release(store, pod, node, &taken).await {
                    tracing::warn!(uid = %pod.uid, error = %crate::error::chain(&undo),
                        "cannot give back the further addresses yet; the pod's cleanup will");
                }
                return Err(e);
            }
        }
    }
    Ok(out)
}

async fn allocate(
    store: &IpamStore,
    r: &attach::Request,
    network: &str,
    cidrs: &[String],
    pod: &PodKey,
    node: &str,
) -> Result<AttachedRecord, ClusterError> {
    let a = store.allocate(network, node, pod).await.map_err(ClusterError::Ipam)?;
    let v = &a.vif;
    // No default route through a further interface (the primary one has it): a route to the
    // whole network through this interface's gateway instead, then the network's own routes.
    let mut routes = Vec::new();
    for ip in &v.ips {
        for cidr in cidrs.iter().filter_map(|c| c.parse::<IpNet>().ok()) {
            if cidr.addr().is_ipv4() == ip.address.addr().is_ipv4() && cidr != ip.address.trunc() {
                routes.push(VifRoute { destination: cidr.to_string(), gateway: Some(ip.gateway.to_string()) });
            }
        }
    }
    routes.extend(
        v.routes
            .iter()
            .map(|rt| VifRoute { destination: rt.destination.to_string(), gateway: rt.gateway.map(|g| g.to_string()) }),
    );
    Ok(AttachedRecord {
        attachment: r.attachment(),
        ifname: r.ifname.clone(),
        network: network.to_string(),
        vif_id: a.vif_id.clone(),
        mac: v.mac.to_string(),
        mtu: v.mtu,
        ips: v
            .ips
            .iter()
            .map(|c| VifIp { address: c.address.to_string(), gateway: Some(c.gateway.to_string()) })
            .collect(),
        routes,
        bridge: v.bridge.clone(),
        ..AttachedRecord::default()
    })
}

async fn release(store: &IpamStore, pod: &PodKey, node: &str, networks: &[String]) -> Result<(), ClusterError> {
    for network in networks {
        let released = if node.is_empty() {
            store.release(network, &pod.uid).await
        } else {
            store.release_on_node(network, node, &pod.uid).await
        };
        released.map_err(ClusterError::Ipam)?;
    }
    Ok(())
}

/// Gives back the pod's addresses on `networks` (embedded), or deletes every further port of the
/// pod (Neutron: whatever `networks` says, so that ports made by an allocation that never got
/// recorded go too).
pub async fn detach(backend: &AnyBackend, pod: &PodKey, node: &str, networks: &[String]) -> Result<(), ClusterError> {
    match backend {
        AnyBackend::Embedded(embedded) => release(embedded.store(), pod, node, networks).await,
        AnyBackend::Neutron(neutron) => neutron.detach_ports(pod).await.map(drop),
    }
}

/// The networks the `networks` annotation of `pod` names now — PodNetworks, or with `neutron`
/// Neutron networks as the definitions name them — leaving out whatever does not resolve (for
/// cleanup, where an unknown definition means nothing was taken through it; further Neutron
/// ports left by one are deleted by the orphan rounds).
pub async fn resolve(client: &kube::Client, neutron: bool, pod: &PodKey, networks: &str) -> Vec<String> {
    let Ok(requests) = attach::parse_networks(networks, &pod.namespace) else { return Vec::new() };
    let mut out = Vec::new();
    for r in &requests {
        let n = match definition(client, r).await {
            Ok(Target::PodNetwork(n)) if !neutron => n,
            Ok(Target::Neutron { network, .. }) if neutron => network,
            _ => continue,
        };
        if !out.contains(&n) {
            out.push(n);
        }
    }
    out
}
