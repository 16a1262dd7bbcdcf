//! What a lab node runs and publishes, read as a test checks it: the WireGuard
//! implementation behind its device, its lease in etcd, its device's public key.

use std::fs;
use std::time::Duration;

use anyhow::bail;

use super::{in_ns, Lab};

impl Lab {
    /// The WireGuard implementation node `i` was asked to run, if the lab chose one.
    pub fn implementation(&self, i: usize) -> Option<&str> {
        let all = &self.cfg.implementations;
        all.get(i % all.len().max(1)).map(String::as_str)
    }

    /// Fails unless node `i`'s WireGuard devices are of the kind its implementation makes (a
    /// `wireguard` link for kernel, a `tun` for userspace): a lab asked for kernel
    /// WireGuard must not pass on userspace.
    pub(super) fn check_implementation(&self, i: usize) -> anyhow::Result<()> {
        let Some(which) = self.implementation(i) else {
            return Ok(());
        };
        let kind = match which {
            "kernel" => "wireguard",
            "userspace" => "tun",
            _ => return Ok(()),
        };
        // The node's WireGuard devices: `flannel-wg`, and `flannel-wg-v6` with IPv6 on its
        // own device (an IPv6-only node has only that one).
        let links = crate::wait::first_within(Duration::from_secs(20), || {
            let links: Vec<String> = ["flannel-wg", "flannel-wg-v6"]
                .iter()
                .filter_map(|d| in_ns(&self.nodes[i].ns, &format!("ip -d -o link show {d}")).ok())
                .collect();
            (!links.is_empty()).then_some(links)
        });
        let Some(links) = links else {
            bail!("node {} has no WireGuard device after 20 s", i + 1);
        };
        for link in links {
            if !link.split_whitespace().any(|w| w == kind) {
                bail!(
                    "node {} should run {which} WireGuard, but its device is: {link}\n{}",
                    i + 1,
                    fs::read_to_string(self.nodes[i].agent_log()).unwrap_or_default()
                );
            }
        }
        Ok(())
    }

    /// Node `i`'s name among its peers in an etcd lab (its subnet key, `10.244.3.0-24`), as
    /// `weft status` shows it.
    pub fn node_name(&self, i: usize) -> String {
        self.nodes[i]
            .subnet
            .map(|s| format!("{}-{}", s.network(), s.prefix_len()))
            .unwrap_or_default()
    }

    /// The etcd key of node `i`'s lease (flannel's dual-stack form in a dual-stack lab).
    pub fn lease_key(&self, i: usize) -> Option<String> {
        let node = &self.nodes[i];
        let s = node.subnet?;
        let v6 = node
            .subnet_v6
            .map(|s6| format!("&{}-{}", s6.network(), s6.prefix_len()))
            .unwrap_or_default();
        Some(format!(
            "{}/subnets/{}-{}{v6}",
            self.cfg.etcd_prefix,
            s.network(),
            s.prefix_len()
        ))
    }

    /// Node `i`'s lease as etcd holds it now (its JSON value); `None` when it is absent or
    /// unreadable.
    pub fn published_lease(&self, i: usize) -> Option<serde_json::Value> {
        let key = self.lease_key(i)?;
        let value = self
            .etcd()
            .etcdctl(&["get", "--print-value-only", &key])
            .ok()?;
        serde_json::from_str(value.trim()).ok()
    }

    /// The public key node `i`'s `flannel-wg` holds.
    pub fn wg_public_key(&self, i: usize) -> anyhow::Result<String> {
        Ok(self
            .on_node(i, "wg show flannel-wg public-key")?
            .trim()
            .to_string())
    }

    /// The userspace device processes of node `i` (those in its network namespace).
    pub fn device_pids(&self, i: usize) -> Vec<u32> {
        device_pids_in(&self.nodes[i].ns)
    }
}

/// The userspace device processes (`weft userspace-device flannel-wg`) running in network
/// namespace `ns`.
pub fn device_pids_in(ns: &str) -> Vec<u32> {
    crate::netns::pids_in(ns)
        .into_iter()
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            cmdline.contains("userspace-device flannel-wg")
        })
        .filter_map(|pid| u32::try_from(pid).ok())
        .collect()
}
