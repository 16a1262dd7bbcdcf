//! `weft doctor`: checks this node against what the agent planned and what its peers
//! published, and prints one verdict per check with the fix. Exits 1 if any check fails.
//!
//! The local checks come first (they read the kernel only): the device carries the
//! published key; the device's peers are exactly the planned ones; the masquerade rules
//! are in place; for vxlan, the neighbour and FDB entries match the peers' published VTEP
//! MACs. Then the network checks, per peer: a fresh handshake (after nudging the peer with
//! a packet through the tunnel), or for ipsec both ESP states present with traffic moving
//! through them and no replays or integrity failures; the peer's UDP port answers no ICMP
//! error; the path carries the tunnel's largest packets with DF set.

mod esp;
mod liveness;
mod local;
mod path_mtu;
mod post_quantum;
mod probe;

use std::fmt;
use std::io::Write;

use weft_backends::apply::wireguard::read::read_device;

use crate::observe::snapshot::Snapshot;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Warn,
    Fail,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Pass => "PASS",
            Verdict::Warn => "WARN",
            Verdict::Fail => "FAIL",
        })
    }
}

/// One check's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub name: &'static str,
    pub verdict: Verdict,
    pub detail: String,
    /// What to do about it (for WARN and FAIL).
    pub fix: Option<String>,
}

impl Check {
    pub fn pass(name: &'static str, detail: impl Into<String>) -> Self {
        Check {
            name,
            verdict: Verdict::Pass,
            detail: detail.into(),
            fix: None,
        }
    }

    pub fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Check {
            name,
            verdict: Verdict::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    pub fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Check {
            verdict: Verdict::Warn,
            ..Check::fail(name, detail, fix)
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct DoctorArgs {
    /// Seconds to wait for a handshake after nudging a peer.
    #[arg(long, default_value = "5")]
    pub handshake_wait: u64,
    /// weft-cni's data directory (the conflist's `dataDir`), for leaked pod addresses.
    #[arg(long, default_value = crate::cni::conf::DEFAULT_DATA_DIR)]
    pub cni_data_dir: std::path::PathBuf,
}

/// Pod addresses held for containers that are gone.
fn leaked_addresses(data_dir: &std::path::Path) -> Check {
    const NAME: &str = "pod addresses";
    if !data_dir.is_dir() {
        return Check::pass(
            NAME,
            format!(
                "no weft-cni data directory {} here: no pod attached yet, or not visible \
                 from where doctor runs (the agent's container does not mount it; run doctor \
                 on the node to check pod addresses)",
                data_dir.display()
            ),
        );
    }
    let (leaks, held) = crate::cni::leaks::find(data_dir);
    if leaks.is_empty() {
        return Check::pass(
            NAME,
            format!("{held} attachments in {}, none leaked", data_dir.display()),
        );
    }
    let list: Vec<String> = leaks.iter().map(ToString::to_string).collect();
    Check::warn(
        NAME,
        format!("{} leaked: {}", leaks.len(), list.join("; ")),
        "`weft cleanup --leaked-addresses` frees them (a runtime speaking CNI 1.1 frees them by its GC)",
    )
}

/// How each WireGuard pair across zones is carried: a pair with no path fails, naming why.
fn pair_paths(snapshot: &Snapshot) -> Check {
    const NAME: &str = "pair paths";
    let paths: Vec<(&str, &str)> = snapshot
        .peers
        .iter()
        .filter_map(|p| Some((p.node.as_str(), p.path.as_deref()?)))
        .collect();
    let none: Vec<String> = paths
        .iter()
        .filter_map(|(n, p)| Some(format!("{n}: {}", p.strip_prefix("no path: ")?)))
        .collect();
    let relayed: Vec<String> = paths
        .iter()
        .filter_map(|(n, p)| Some(format!("{n} via {}", p.strip_prefix("via ")?)))
        .collect();
    if !none.is_empty() {
        return Check::fail(
            NAME,
            format!("{} pair(s) have no path: {}", none.len(), none.join("; ")),
            "make a node with a public address in either zone a gateway (`--gateway`, or the Node annotation weft.dev/gateway: \"true\") and open its relay port (UDP 51824), or give one of the two nodes an address the other zone reaches (--public-ip, public-ip-overwrite)",
        );
    }
    let direct = paths.len() - relayed.len();
    match relayed.is_empty() {
        true => Check::pass(NAME, format!("{direct} pair(s), all direct")),
        false => Check::pass(
            NAME,
            format!("{direct} direct, {} through a gateway's relay (end to end encrypted; the gateway holds no key): {}", relayed.len(), relayed.join(", ")),
        ),
    }
}

/// While the cluster changes backend: which pairs run on which backend, and every pair in
/// clear named with why (a warning: the rollout has not reached its peer).
fn backend_change(snapshot: &Snapshot) -> Option<Check> {
    const NAME: &str = "backend change";
    let b = &snapshot.backends;
    let others: Vec<String> = b
        .peers
        .iter()
        .filter(|(k, _)| **k != snapshot.backend)
        .map(|(k, n)| format!("{n} on {k}"))
        .collect();
    if others.is_empty() && b.clear.is_empty() && b.also.is_empty() {
        return None;
    }
    let counts: Vec<String> = b.peers.iter().map(|(k, n)| format!("{k} {n}")).collect();
    if !b.clear.is_empty() {
        let named: Vec<String> = b
            .clear
            .iter()
            .map(|c| format!("{}: {}", c.node, c.why))
            .collect();
        return Some(Check::warn(
            NAME,
            format!(
                "this node runs {}; {} pair(s) in clear: {}",
                snapshot.backend,
                b.clear.len(),
                named.join("; ")
            ),
            "the change has not reached those nodes: restart their agents with the new config (a DaemonSet rollout that stalled: `kubectl -n kube-flannel rollout status ds/kube-flannel-ds`); set RefuseClear in the Backend to keep such pairs down instead",
        ));
    }
    Some(Check::pass(
        NAME,
        match others.is_empty() {
            true => format!(
                "every peer runs {}; this node still speaks {} until its grace ends",
                snapshot.backend,
                b.also.join(", ")
            ),
            false => format!(
                "peers per backend: {} (every pair encrypted): {} still to move",
                counts.join(", "),
                others.join(", ")
            ),
        },
    ))
}

/// Runs every check that applies to `snapshot`'s backend.
pub async fn checks(snapshot: &Snapshot, args: &DoctorArgs) -> Vec<Check> {
    let mut out = Vec::new();
    let wireguard = matches!(snapshot.implementation.as_str(), "kernel" | "userspace");
    let device = match (&snapshot.device, wireguard) {
        (Some(name), true) => match read_device(name).await {
            Ok(Some(d)) => Some(d),
            Ok(None) => {
                out.push(Check::fail(
                    "device",
                    format!("{name} does not exist"),
                    "the agent recreates it within a second: look at its log for why it cannot",
                ));
                None
            }
            Err(e) => {
                out.push(Check::fail(
                    "device",
                    format!("reading {name}: {e}"),
                    "run as root on the node",
                ));
                None
            }
        },
        _ => None,
    };
    // The config's WireGuard device: a node that keeps WireGuard only while the cluster
    // changes backend publishes its key beside another backend's data.
    if let Some(d) = device.as_ref().filter(|_| snapshot.backend == "wireguard") {
        out.push(local::published_key(snapshot, d));
        out.push(local::peers_on_device(snapshot, d));
    }
    if !snapshot.last_errors.is_empty() {
        out.push(local::dataplane_errors(snapshot));
    }
    if !snapshot.left_out.is_empty() {
        out.push(local::left_out(snapshot));
    }
    out.extend(backend_change(snapshot));
    if snapshot.ip_masq {
        out.push(local::masquerade(snapshot).await);
    }
    if snapshot.vxlan_port.is_some() {
        out.push(local::vxlan_entries(snapshot));
    }
    if snapshot.backend == "ipsec" {
        out.push(esp::esp(snapshot).await);
    }
    if !snapshot.post_quantum.is_empty() {
        out.push(post_quantum::pairs(snapshot, std::time::SystemTime::now()));
    }
    if wireguard {
        out.push(pair_paths(snapshot));
        out.push(liveness::pairs(snapshot, std::time::SystemTime::now()));
        out.push(
            probe::handshakes(
                snapshot,
                std::time::Duration::from_secs(args.handshake_wait),
            )
            .await,
        );
    }
    out.push(leaked_addresses(&args.cni_data_dir));
    out.push(probe::reachability(snapshot).await);
    out.push(path_mtu::mtu(snapshot).await);
    out
}

pub fn render(checks: &[Check]) -> String {
    let mut out = String::new();
    for c in checks {
        out += &format!("{}  {}: {}\n", c.verdict, c.name, c.detail);
        if let Some(fix) = &c.fix {
            out += &format!("      fix: {fix}\n");
        }
    }
    let failed = checks.iter().filter(|c| c.verdict == Verdict::Fail).count();
    out += &match failed {
        0 => format!("all {} checks passed\n", checks.len()),
        n => format!("{n} of {} checks failed\n", checks.len()),
    };
    out
}

pub fn run(args: &DoctorArgs, out: &mut dyn Write) -> anyhow::Result<i32> {
    let snapshot =
        crate::observe::control_socket::fetch(&crate::observe::control_socket::socket_path())?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let checks = runtime.block_on(checks(&snapshot, args));
    write!(out, "{}", render(&checks))?;
    Ok(i32::from(checks.iter().any(|c| c.verdict == Verdict::Fail)))
}

#[cfg(test)]
mod pair_path_tests {
    use super::*;
    use crate::observe::snapshot::PeerInfo;

    fn snapshot(paths: &[(&str, &str)]) -> Snapshot {
        Snapshot {
            peers: paths
                .iter()
                .map(|(n, p)| PeerInfo {
                    node: n.to_string(),
                    path: Some(p.to_string()),
                    ..PeerInfo::default()
                })
                .collect(),
            ..Snapshot::default()
        }
    }

    #[test]
    fn a_pair_with_no_path_fails_naming_why_and_relayed_pairs_are_listed() {
        let ok = pair_paths(&snapshot(&[("a", "direct"), ("b", "via g1")]));
        assert_eq!(ok.verdict, Verdict::Pass);
        assert!(
            ok.detail.contains("1 direct, 1 through a gateway's relay"),
            "{}",
            ok.detail
        );
        assert!(ok.detail.contains("b via g1"), "{}", ok.detail);
        let none = pair_paths(&snapshot(&[
            ("a", "direct"),
            ("c", "no path: n1 and c cannot reach each other"),
        ]));
        assert_eq!(none.verdict, Verdict::Fail);
        assert!(
            none.detail.contains("c: n1 and c cannot reach each other"),
            "{}",
            none.detail
        );
        assert!(none.fix.unwrap_or_default().contains("weft.dev/gateway"));
    }

    #[test]
    fn a_backend_change_names_clear_pairs_and_passes_once_every_pair_encrypts() {
        use crate::observe::snapshot::{BackendsInfo, ClearPairInfo};
        let mut s = Snapshot {
            backend: "wireguard".into(),
            backends: BackendsInfo {
                peers: [("wireguard".to_string(), 3)].into(),
                ..BackendsInfo::default()
            },
            ..Snapshot::default()
        };
        assert!(backend_change(&s).is_none(), "one backend: no check");
        s.backends.peers.insert("vxlan".into(), 1);
        s.backends.also = vec!["vxlan".into()];
        s.backends.clear = vec![ClearPairInfo {
            node: "n4".into(),
            why: "it publishes no encrypting backend (it runs vxlan)".into(),
        }];
        let stalled = backend_change(&s).unwrap();
        assert_eq!(stalled.verdict, Verdict::Warn);
        assert!(
            stalled
                .detail
                .contains("1 pair(s) in clear: n4: it publishes no encrypting backend"),
            "{}",
            stalled.detail
        );
        assert!(stalled.fix.unwrap_or_default().contains("rollout status"));
        s.backends.clear.clear();
        s.backends.peers.remove("vxlan");
        let retiring = backend_change(&s).unwrap();
        assert_eq!(retiring.verdict, Verdict::Pass);
        assert!(
            retiring.detail.contains("still speaks vxlan"),
            "{}",
            retiring.detail
        );
    }
}
