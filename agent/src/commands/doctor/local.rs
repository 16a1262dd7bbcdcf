//! The checks that read only this node's kernel: key, peers, masquerade rules, vxlan
//! entries, and the peers the plan leaves out.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;
use weft_backends::apply::wireguard::WgDevice;
use weft_backends::apply::{listed_rules, Nft, NftCli};
use weft_backends::model::Family;
use weft_crypto::PublicKey;

use super::Check;
use crate::observe::snapshot::Snapshot;

pub fn published_key(snapshot: &Snapshot, device: &WgDevice) -> Check {
    const NAME: &str = "published key";
    let published = snapshot
        .published_key()
        .map(|k| k.to_string())
        .unwrap_or_default();
    let dev = snapshot.device.as_deref().unwrap_or("the device");
    match device.public_key.map(|k| k.to_string()) {
        Some(k) if k == published => Check::pass(NAME, format!("{dev} carries the published key {k}")),
        Some(k) => Check::fail(
            NAME,
            format!("{dev} carries {k}, but this node publishes {published}: peers cannot reach it"),
            "something set the device's key behind weft's back; restart the agent (it sets the key from /var/lib/weft/wireguard.key), and find what touched the device",
        ),
        None => Check::fail(
            NAME,
            format!("{dev} has no private key"),
            "restart the agent; it sets the key on its first pass",
        ),
    }
}

pub fn peers_on_device(snapshot: &Snapshot, device: &WgDevice) -> Check {
    const NAME: &str = "peers on device";
    let planned: BTreeMap<PublicKey, &str> = snapshot
        .peers
        .iter()
        .filter_map(|p| Some((p.public_key.as_deref()?.parse().ok()?, p.node.as_str())))
        .collect();
    let on_device: BTreeSet<&PublicKey> = device.peers.keys().collect();
    let missing: Vec<String> = planned
        .iter()
        .filter(|(k, _)| !on_device.contains(k))
        .map(|(k, n)| format!("{n} ({k})"))
        .collect();
    let extra: Vec<String> = on_device
        .iter()
        .filter(|k| !planned.contains_key(**k))
        .map(|k| k.to_string())
        .collect();
    let dev = snapshot.device.as_deref().unwrap_or("the device");
    if missing.is_empty() && extra.is_empty() {
        return Check::pass(
            NAME,
            format!(
                "{dev} holds exactly the {} peers in the registry",
                planned.len()
            ),
        );
    }
    let mut detail = Vec::new();
    if !missing.is_empty() {
        detail.push(format!("missing from {dev}: {}", missing.join(", ")));
    }
    if !extra.is_empty() {
        detail.push(format!(
            "on {dev} but no node publishes it: {}",
            extra.join(", ")
        ));
    }
    Check::fail(
        NAME,
        detail.join("; "),
        "the agent repairs this at its next full resync (--resync-period); if it persists, its log says why a write fails",
    )
}

/// What the agent's last pass could not do (a tunnel port taken, a route refused).
pub fn dataplane_errors(snapshot: &Snapshot) -> Check {
    Check::fail(
        "data plane",
        format!(
            "the agent's last pass left {} error(s): {}",
            snapshot.last_errors.len(),
            snapshot.last_errors.join("; ")
        ),
        "each error says what failed and why; the agent retries at every pass",
    )
}

pub fn left_out(snapshot: &Snapshot) -> Check {
    let list: Vec<String> = snapshot
        .left_out
        .iter()
        .map(|l| format!("{}: {}", l.node, l.reason))
        .collect();
    Check::warn(
        "left out",
        format!("{} node(s) in the registry are not peers: {}", list.len(), list.join("; ")),
        "fix what each of those nodes publishes (the reason says what); weft adds it as soon as it is usable",
    )
}

pub async fn masquerade(snapshot: &Snapshot) -> Check {
    let mut nft = NftCli::default();
    let mut listed = Vec::new();
    for t in &snapshot.masquerade {
        let family = if t.family == "ip6" {
            Family::Ipv6
        } else {
            Family::Ipv4
        };
        listed.push(nft.list(family, &t.table).await.map_err(|e| e.to_string()));
    }
    let now = crate::keys::rotation::ms(std::time::SystemTime::now());
    masquerade_verdict(snapshot, &listed, now)
}

/// The masquerade check from each planned table's listing (in `snapshot.masquerade`'s
/// order; `None`: no such table), at `now_ms`.
fn masquerade_verdict(
    snapshot: &Snapshot,
    listed: &[Result<Option<Value>, String>],
    now_ms: u64,
) -> Check {
    const NAME: &str = "masquerade";
    let mut problems = Vec::new();
    for (t, listing) in snapshot.masquerade.iter().zip(listed) {
        match listing {
            Ok(Some(listing)) if listed_rules(listing) == t.rules => {}
            Ok(Some(_)) => problems.push(format!(
                "table {} {} has other rules than planned",
                t.family, t.table
            )),
            Ok(None) => problems.push(format!("table {} {} is missing", t.family, t.table)),
            Err(e) => problems.push(format!("listing {} {}: {e}", t.family, t.table)),
        }
    }
    if problems.is_empty() {
        let names: Vec<String> = snapshot
            .masquerade
            .iter()
            .map(|t| format!("{} {}", t.family, t.table))
            .collect();
        let in_place = format!("{} in place with the planned rules", names.join(", "));
        match recently_restored(snapshot, &names, now_ms) {
            Some(restored) => Check::warn(
                NAME,
                format!("{in_place}, but the agent had to put them back: {restored}"),
                "another tool (a firewall manager, `nft flush ruleset`) removed or changed them; the agent restores them, but traffic leaving the pod network goes out unmasqueraded meanwhile",
            ),
            None => Check::pass(NAME, in_place),
        }
    } else {
        Check::fail(
            NAME,
            problems.join("; "),
            "the agent restores its tables within 2 s; if they keep disappearing, another tool (a firewall manager, `nft flush ruleset`) is removing them",
        )
    }
}

/// How long a repair the agent made counts as recent.
const RECENT: std::time::Duration = std::time::Duration::from_secs(300);

/// The agent's repairs of `tables` in the last `RECENT` before `now`, as `what (N s ago)`.
fn recently_restored(snapshot: &Snapshot, tables: &[String], now: u64) -> Option<String> {
    let recent: Vec<String> = snapshot
        .repairs
        .iter()
        .filter(|r| now.saturating_sub(r.at_ms) < RECENT.as_millis() as u64)
        .filter(|r| tables.iter().any(|t| r.what.contains(t.as_str())))
        .map(|r| format!("{} ({} s ago)", r.what, now.saturating_sub(r.at_ms) / 1000))
        .collect();
    (!recent.is_empty()).then(|| recent.join("; "))
}

fn ip_json(args: &[&str]) -> Result<Vec<Value>, String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("running {}: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    serde_json::from_slice::<Vec<Value>>(&out.stdout)
        .map_err(|e| format!("{}: {e}", args.join(" ")))
}

pub fn vxlan_entries(snapshot: &Snapshot) -> Check {
    const NAME: &str = "vxlan entries";
    // Each vxlan device the peers are on: `flannel.<VNI>`, and `flannel-v6.<VNI>` with IPv6.
    let mut devices: Vec<&str> = Vec::new();
    for p in snapshot.peers.iter().filter(|p| p.vtep_mac.is_some()) {
        if let Some(d) = p.device.as_deref().filter(|d| !devices.contains(d)) {
            devices.push(d);
        }
    }
    let devices: Vec<&str> = match (devices.is_empty(), snapshot.device.as_deref()) {
        (false, _) => devices,
        (true, Some(dev)) => vec![dev],
        (true, None) => {
            return Check::fail(
                NAME,
                "no vxlan device in the plan",
                "look at the agent's log",
            )
        }
    };
    let (mut problems, mut count) = (Vec::new(), 0);
    for dev in &devices {
        match device_entries(snapshot, dev, &mut problems) {
            Ok(n) => count += n,
            Err(e) => return Check::fail(NAME, e, "run as root on the node"),
        }
    }
    if problems.is_empty() {
        Check::pass(
            NAME,
            format!(
                "{}: neighbour and FDB entries match the published VTEP MACs of {count} peers",
                devices.join(", ")
            ),
        )
    } else {
        Check::fail(
            NAME,
            problems.join("; "),
            "the agent rewrites these at its next full resync; if a peer's MAC is what changed, that peer restarted without /var/lib/weft",
        )
    }
}

/// Checks the neighbour and FDB entries of vxlan device `dev` against the peers on it;
/// returns how many peers it checked.
fn device_entries(
    snapshot: &Snapshot,
    dev: &str,
    problems: &mut Vec<String>,
) -> Result<usize, String> {
    let neigh = ip_json(&["ip", "-j", "neigh", "show", "dev", dev])?;
    let fdb = ip_json(&["bridge", "-j", "fdb", "show", "dev", dev])?;
    let neigh_mac: BTreeMap<String, String> = neigh
        .iter()
        .filter_map(|n| {
            Some((
                n["dst"].as_str()?.to_string(),
                n["lladdr"].as_str()?.to_lowercase(),
            ))
        })
        .collect();
    let fdb_dst: BTreeMap<String, String> = fdb
        .iter()
        .filter_map(|f| {
            Some((
                f["mac"].as_str()?.to_lowercase(),
                f["dst"].as_str()?.to_string(),
            ))
        })
        .collect();
    let mut count = 0;
    let on_dev = snapshot
        .peers
        .iter()
        .filter(|p| p.vtep_mac.is_some() && p.device.as_deref().is_none_or(|d| d == dev));
    for p in on_dev {
        count += 1;
        let v6 = p.subnet.is_some_and(|s| s.addr().is_ipv6());
        let published = snapshot
            .registry
            .get(&p.node)
            .and_then(|e| {
                let data = if v6 {
                    &e.backend_v6_data
                } else {
                    &e.backend_data
                };
                data.as_ref()?
                    .get("VtepMAC")?
                    .as_str()
                    .map(str::to_lowercase)
            })
            .unwrap_or_default();
        let gateway = p
            .subnet
            .map(|s| s.network().to_string())
            .unwrap_or_default();
        match neigh_mac.get(&gateway) {
            Some(mac) if *mac == published => {}
            Some(mac) => problems.push(format!(
                "{}: neighbour {gateway} is {mac}, published VtepMAC {published}",
                p.node
            )),
            None => problems.push(format!("{}: no neighbour entry for {gateway}", p.node)),
        }
        let ip = p.endpoint.clone().unwrap_or_default();
        match fdb_dst.get(&published) {
            Some(dst) if *dst == ip => {}
            Some(dst) => problems.push(format!(
                "{}: FDB sends {published} to {dst}, the node is at {ip}",
                p.node
            )),
            None => problems.push(format!("{}: no FDB entry for {published}", p.node)),
        }
    }
    Ok(count)
}

#[cfg(test)]
mod masquerade_tests {
    use super::*;
    use crate::observe::snapshot::{NftTable, Repair};

    fn listing() -> Value {
        serde_json::json!({"nftables": [
            {"chain": {"family": "ip", "table": "flannel-ipv4", "name": "postrouting", "handle": 1}},
            {"rule": {"family": "ip", "table": "flannel-ipv4", "chain": "postrouting",
                      "expr": [{"return": null}]}}
        ]})
    }

    fn snapshot(repairs: Vec<Repair>) -> Snapshot {
        Snapshot {
            masquerade: vec![NftTable {
                family: "ip".into(),
                table: "flannel-ipv4".into(),
                rules: listed_rules(&listing()),
            }],
            repairs,
            ..Snapshot::default()
        }
    }

    /// A missing table fails; one in place passes, or warns while the agent's putting it
    /// back is recent (5 minutes), naming what was put back.
    #[test]
    fn masquerade_verdicts() {
        let now = 1_000_000_000;
        let missing = masquerade_verdict(&snapshot(vec![]), &[Ok(None)], now);
        assert_eq!(missing.verdict, super::super::Verdict::Fail);
        assert!(missing.detail.contains("table ip flannel-ipv4 is missing"));
        let fine = masquerade_verdict(&snapshot(vec![]), &[Ok(Some(listing()))], now);
        assert_eq!(fine.verdict, super::super::Verdict::Pass, "{}", fine.detail);
        let restored = |ago_ms: u64| {
            let repair = Repair {
                what: "replace nftables table ip flannel-ipv4".into(),
                at_ms: now - ago_ms,
            };
            masquerade_verdict(&snapshot(vec![repair]), &[Ok(Some(listing()))], now)
        };
        let recent = restored(3_000);
        assert_eq!(recent.verdict, super::super::Verdict::Warn);
        assert!(
            recent.detail.contains("flannel-ipv4 (3 s ago)"),
            "{}",
            recent.detail
        );
        assert_eq!(restored(600_000).verdict, super::super::Verdict::Pass);
    }
}
