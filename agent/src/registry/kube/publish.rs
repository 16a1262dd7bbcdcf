//! Writing to this node's Node: the lease (subnets from `spec.podCIDRs`, checked against
//! the config), flannel's annotations, and the `NetworkUnavailable` condition.
//!
//! Annotations are written as a JSON merge patch on `nodes/<name>/status` (as flannel
//! does, so the same RBAC works) that names the resourceVersion it was computed from: a
//! concurrent writer makes it fail with `409 Conflict`, and it is computed again from a
//! fresh read. Nothing is written when the annotations already say what we would write.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use tracing::{debug, info, warn};
use weft_backends::model::{annotations, Lease};
use weft_backends::netconf::NetConf;

use super::node::ENDPOINTS_ANNOTATION;
use super::{KubeError, KubeRegistry, SlimNode};
use crate::registry::{AcquireRequest, LocalAttrs};

/// Conflicting writes in a row before `publish` gives up (the caller retries later).
const MAX_CONFLICTS: u32 = 8;

impl KubeRegistry {
    pub(super) async fn get_node(&self) -> Result<SlimNode, KubeError> {
        self.nodes
            .get(&self.cfg.node_name)
            .await
            .map_err(KubeError::api("getting node", self.cfg.node_name.clone()))
    }

    pub(super) async fn acquire_lease(
        &mut self,
        net: &NetConf,
        request: &AcquireRequest,
    ) -> Result<Lease, KubeError> {
        let node = self.get_node().await?;
        let (v4, v6) = subnets(&node, net)?;
        let attrs = self.effective_attrs(&node, &request.attrs);
        self.publish(&attrs).await?;
        info!(node = %self.cfg.node_name, subnet = ?v4, subnet_v6 = ?v6, public_ip = ?attrs.public_ip, "acquired the node's pod CIDRs and published its annotations");
        let mut lease = attrs
            .to_lease_attrs()
            .into_lease(self.cfg.node_name.clone(), v4, v6);
        lease.reach.zone = node.zone();
        lease.reach.internal_ip = attrs.internal_ip.map(std::net::IpAddr::V4);
        lease.reach.gateway = attrs
            .gateway
            .or_else(|| weft_backends::model::annotations::gateway(&node.annotations()));
        Ok(lease)
    }

    /// `attrs` with the operator's `node-public-ip` / `node-public-ipv6` annotations (use
    /// this local address) applied; a value that is not an address is logged and ignored.
    pub(super) fn effective_attrs(&self, node: &SlimNode, attrs: &LocalAttrs) -> LocalAttrs {
        let mut attrs = attrs.clone();
        let annotations = node.annotations();
        let get = |name: &str| {
            let key = format!("{}/{name}", self.cfg.prefix);
            annotations.get(&key).map(|v| (key, v.clone()))
        };
        if let Some((key, value)) = get("node-public-ip") {
            match value.parse::<Ipv4Addr>() {
                Ok(ip) => attrs.public_ip = Some(ip),
                Err(_) => {
                    warn!(node = %self.cfg.node_name, annotation = %key, %value, "not an IPv4 address; ignored")
                }
            }
        }
        if let Some((key, value)) = get("node-public-ipv6") {
            match value.parse::<Ipv6Addr>() {
                Ok(ip) => attrs.public_ipv6 = Some(ip),
                Err(_) => {
                    warn!(node = %self.cfg.node_name, annotation = %key, %value, "not an IPv6 address; ignored")
                }
            }
        }
        attrs
    }

    /// The annotations `attrs` calls for: flannel's, and weft's endpoint candidates
    /// (`None`: must be absent, so a stale one is removed).
    pub(super) fn wanted(&self, attrs: &LocalAttrs) -> BTreeMap<String, Option<String>> {
        let mut want: BTreeMap<String, Option<String>> =
            annotations::publish(&self.cfg.prefix, &attrs.to_lease_attrs())
                .into_iter()
                .map(|(k, v)| (k, Some(v)))
                .collect();
        let candidates = attrs.internal_ip.map(|internal| {
            json!({"internal": internal.to_string(), "external": attrs.public_ip.map(|i| i.to_string())})
                .to_string()
        });
        want.insert(ENDPOINTS_ANNOTATION.to_string(), candidates);
        let next = attrs
            .next_key
            .as_ref()
            .and_then(|n| serde_json::to_string(n).ok());
        want.insert(annotations::NEXT_KEY.to_string(), next);
        want.insert(annotations::KEY_PROOF.to_string(), attrs.key_proof.clone());
        want.insert(
            annotations::ML_KEM_KEY.to_string(),
            attrs.ml_kem_key.clone(),
        );
        let also = (!attrs.also.is_empty())
            .then(|| serde_json::to_string(&attrs.also).ok())
            .flatten();
        want.insert(annotations::ALSO_BACKENDS.to_string(), also);
        // `--gateway` says so on the Node; without it, an operator's annotation stays.
        if let Some(port) = attrs.gateway {
            want.insert(annotations::GATEWAY.to_string(), Some("true".into()));
            let port = (port != weft_backends::model::DEFAULT_RELAY_PORT).then(|| port.to_string());
            want.insert(annotations::RELAY_PORT.to_string(), port);
        }
        want
    }

    /// Publishes `attrs` as annotations, retrying on conflict with a fresh read.
    pub(super) async fn publish(&self, attrs: &LocalAttrs) -> Result<(), KubeError> {
        let want = self.wanted(attrs);
        let name = &self.cfg.node_name;
        for attempt in 0..MAX_CONFLICTS {
            let node = if attempt == 0 {
                self.get_node().await?
            } else {
                tokio::time::sleep(Duration::from_millis(20 << attempt.min(5))).await;
                self.get_node().await?
            };
            if up_to_date(&node, &want) {
                debug!(node = %name, "annotations already published");
                return Ok(());
            }
            let patch = json!({"metadata": {
                "resourceVersion": node.metadata.resource_version,
                "annotations": want,
            }});
            match self
                .nodes
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    info!(node = %name, attempt = attempt + 1, "the node changed while publishing (409 Conflict); reading it again");
                }
                Err(e) => return Err(KubeError::api("annotating node", name.clone())(e)),
            }
        }
        Err(KubeError::Conflicts {
            node: name.clone(),
            attempts: MAX_CONFLICTS,
        })
    }

    /// Sets the node's `NetworkUnavailable` condition to False (flannel's
    /// `--set-node-network-unavailable`): a strategic merge patch, which merges the
    /// conditions list by `type` and leaves the kubelet's own conditions alone.
    pub(super) async fn set_network_available(&self) -> Result<(), KubeError> {
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let patch = json!({"status": {"conditions": [{
            "type": "NetworkUnavailable",
            "status": "False",
            "reason": "WeftIsUp",
            "message": "weft is running on this node",
            "lastTransitionTime": now,
            "lastHeartbeatTime": now,
        }]}});
        self.nodes
            .patch_status(
                &self.cfg.node_name,
                &PatchParams::default(),
                &Patch::Strategic(&patch),
            )
            .await
            .map_err(KubeError::api(
                "setting NetworkUnavailable=False on node",
                self.cfg.node_name.clone(),
            ))?;
        info!(node = %self.cfg.node_name, "NetworkUnavailable set to False");
        Ok(())
    }
}

/// True when every annotation in `want` is on the node with that value (and those
/// wanted absent are absent).
pub(super) fn up_to_date(node: &SlimNode, want: &BTreeMap<String, Option<String>>) -> bool {
    let have = node.annotations();
    want.iter().all(|(k, v)| have.get(k) == v.as_ref())
}

/// The node's IPv4 and IPv6 subnets for the enabled families: each must exist and lie
/// inside the config's network.
pub(super) fn subnets(
    node: &SlimNode,
    net: &NetConf,
) -> Result<(Option<IpNet>, Option<IpNet>), KubeError> {
    let cidrs = node.pod_cidrs()?;
    let pick = |v6: bool, family: &'static str, field: &'static str| {
        let Some(pod) = net.network(v6) else {
            return Ok(None);
        };
        let cidr = cidrs
            .iter()
            .find(|c| matches!(c.addr(), IpAddr::V6(_)) == v6)
            .copied()
            .ok_or_else(|| KubeError::NoPodCidr {
                node: node.name().to_string(),
                family,
            })?;
        if !pod.network.contains(&cidr) {
            return Err(KubeError::OutsideNetwork {
                node: node.name().to_string(),
                cidr,
                field,
                network: pod.network,
            });
        }
        Ok(Some(cidr))
    };
    Ok((
        pick(false, "IPv4", "Network")?,
        pick(true, "IPv6", "IPv6Network")?,
    ))
}
