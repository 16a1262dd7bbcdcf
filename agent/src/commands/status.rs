//! `weft status`: this node and every peer, from the local agent's snapshot (its control
//! socket) and the device itself (handshakes, transfer) or, for ipsec, the peer's two ESP
//! states: one table, or `--json`.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use weft_backends::apply::wireguard::read::read_device;
use weft_backends::apply::wireguard::WgDevice;
use weft_backends::apply::xfrm::{pairs, EspPair, Xfrm, XfrmSocket};
use weft_backends::plan::ipsec::IF_ID;
use weft_crypto::PublicKey;

use crate::observe::snapshot::{PairLiveness, PathInfo, PeerInfo, Snapshot};

/// WireGuard drops a session this long after its handshake (REJECT_AFTER_TIME).
pub const HANDSHAKE_FRESH: Duration = Duration::from_secs(180);

#[derive(Debug, Clone, clap::Args)]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub node: String,
    pub subnet: String,
    pub endpoint: String,
    pub public_key: Option<String>,
    /// Seconds since the last handshake; `None` if never (or not WireGuard).
    pub handshake_secs: Option<u64>,
    pub rx_bytes: Option<u64>,
    pub tx_bytes: Option<u64>,
    pub state: String,
    /// WireGuard: the pair's liveness (`alive`, `idle`, `waiting`, `dead`), as the agent's
    /// watcher last judged it; `None` before its first read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub liveness: Option<String>,
    /// Why a dead pair is dead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
    /// WireGuard: `direct`, `via <gateway>` (a gateway's relay carries the pair), or
    /// `no path: <why>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub node: String,
    pub subnet: String,
    pub backend: String,
    pub implementation: String,
    pub device: Option<String>,
    pub public_ip: Option<String>,
    pub peers: Vec<Row>,
    /// Each peer's underlay path and its measured MTU.
    pub paths: Vec<PathInfo>,
    /// With `PostQuantum`: each pair's protection.
    pub post_quantum: Vec<crate::observe::snapshot::PqPairInfo>,
    /// This node's relay, when it is a gateway.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub relay: Option<crate::observe::snapshot::RelayInfo>,
    /// Peers per backend, the pairs in clear and the old backends still spoken.
    pub backends: crate::observe::snapshot::BackendsInfo,
}

fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

/// The rows for `snapshot`, with its WireGuard devices as read now, by name, and its
/// ipsec peers' ESP states, by node.
pub fn rows(
    snapshot: &Snapshot,
    devices: &BTreeMap<String, WgDevice>,
    esp: &BTreeMap<String, EspPair>,
    now: SystemTime,
) -> Vec<Row> {
    let since_epoch = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let mut rows: Vec<Row> = snapshot
        .peers
        .iter()
        .map(|p| {
            if p.spi_in.is_some() {
                return esp_row(p, esp.get(&p.node));
            }
            let key: Option<PublicKey> = p.public_key.as_deref().and_then(|k| k.parse().ok());
            let device = p.device.as_ref().and_then(|d| devices.get(d));
            let on_device = match (key, device) {
                (Some(k), Some(d)) => d.peers.get(&k),
                _ => None,
            };
            let age = on_device
                .and_then(|w| w.last_handshake)
                .filter(|t| !t.is_zero())
                .map(|t| since_epoch.saturating_sub(t));
            let live = snapshot
                .liveness
                .iter()
                .find(|l| l.node == p.node && Some(&l.device) == p.device.as_ref());
            let state = match (key.is_some(), device, on_device, age) {
                (false, ..) => "programmed".to_string(),
                (true, None, ..) => "no device".to_string(),
                (true, Some(_), None, _) => "not on device".to_string(),
                // Sent to, and nothing came back: whatever its last handshake says.
                (true, Some(_), Some(_), _) if live.is_some_and(|l| l.state == "dead") => {
                    dead_state(live)
                }
                (true, Some(_), Some(_), Some(a)) if a <= HANDSHAKE_FRESH => "up".to_string(),
                (true, Some(_), Some(_), _) => "no handshake".to_string(),
            };
            Row {
                node: p.node.clone(),
                subnet: or_dash(p.subnet),
                endpoint: on_device
                    .and_then(|w| w.endpoint)
                    .map(|e| e.to_string())
                    .or_else(|| p.endpoint.clone())
                    .unwrap_or_else(|| "-".into()),
                public_key: p.public_key.clone(),
                handshake_secs: age.map(|a| a.as_secs()),
                rx_bytes: on_device.map(|w| w.rx_bytes),
                tx_bytes: on_device.map(|w| w.tx_bytes),
                state,
                liveness: live.map(|l| l.state.clone()),
                cause: live.and_then(|l| l.cause.clone()),
                path: p.path.clone(),
            }
        })
        .collect();
    for l in &snapshot.left_out {
        let entry = snapshot.registry.get(&l.node);
        rows.push(Row {
            node: l.node.clone(),
            subnet: or_dash(entry.and_then(|e| e.subnet)),
            endpoint: or_dash(entry.and_then(|e| e.public_ip)),
            public_key: None,
            handshake_secs: None,
            rx_bytes: None,
            tx_bytes: None,
            state: format!("left out: {}", l.reason),
            liveness: None,
            cause: None,
            path: None,
        });
    }
    rows
}

/// A dead pair's state: `dead: <cause>, <n> s`.
fn dead_state(live: Option<&PairLiveness>) -> String {
    let Some(l) = live else {
        return "dead".into();
    };
    let cause = l.cause.as_deref().unwrap_or("no answer");
    match l.dead_secs {
        Some(s) => format!("dead: {cause}, {s} s"),
        None => format!("dead: {cause}"),
    }
}

/// An ipsec peer's row: up when both its states are in the kernel.
fn esp_row(p: &PeerInfo, pair: Option<&EspPair>) -> Row {
    let (inbound, outbound) =
        pair.map_or((None, None), |e| (e.inbound.as_ref(), e.outbound.as_ref()));
    let state = match (inbound, outbound) {
        (Some(_), Some(_)) => "up",
        (None, Some(_)) => "no inbound SA",
        (Some(_), None) => "no outbound SA",
        (None, None) => "no SAs",
    };
    Row {
        node: p.node.clone(),
        subnet: or_dash(p.subnet),
        endpoint: p.endpoint.clone().unwrap_or_else(|| "-".into()),
        public_key: p.public_key.clone(),
        handshake_secs: None,
        rx_bytes: inbound.map(|s| s.bytes),
        tx_bytes: outbound.map(|s| s.bytes),
        state: state.to_string(),
        liveness: None,
        cause: None,
        path: None,
    }
}

/// Each ipsec peer's two ESP states as the kernel holds them now, by node.
pub fn esp_states(snapshot: &Snapshot) -> anyhow::Result<BTreeMap<String, EspPair>> {
    let Some(IpAddr::V4(local)) = snapshot.public_ip else {
        return Ok(BTreeMap::new());
    };
    let peers: Vec<(String, Ipv4Addr, u32, u32)> = snapshot
        .peers
        .iter()
        .filter_map(|p| {
            let remote = p.endpoint.as_deref()?.parse().ok()?;
            Some((p.node.clone(), remote, p.spi_in?, p.spi_out?))
        })
        .collect();
    if peers.is_empty() {
        return Ok(BTreeMap::new());
    }
    let mut xfrm = XfrmSocket::open()?;
    let states = xfrm.states(IF_ID)?;
    Ok(pairs(&states, local, peers))
}

fn bytes(n: Option<u64>) -> String {
    match n {
        None => "-".into(),
        Some(n) if n < 1024 => format!("{n} B"),
        Some(n) if n < 1024 * 1024 => format!("{:.1} KiB", n as f64 / 1024.0),
        Some(n) if n < 1024 * 1024 * 1024 => format!("{:.1} MiB", n as f64 / 1048576.0),
        Some(n) => format!("{:.2} GiB", n as f64 / 1073741824.0),
    }
}

/// The table, columns padded to their widest cell.
pub fn table(report: &Report) -> String {
    let device = report.device.as_deref().unwrap_or("no device");
    let runs = match report.implementation.as_str() {
        "kernel" | "userspace" => format!("{} WireGuard on {device}", report.implementation),
        _ => device.to_string(),
    };
    let mut out = format!(
        "node {} ({}), backend {}, {runs}, endpoint {}\n\n",
        report.node,
        report.subnet,
        report.backend,
        report.public_ip.as_deref().unwrap_or("-"),
    );
    let header = [
        "NODE",
        "SUBNET",
        "ENDPOINT",
        "PATH",
        "HANDSHAKE",
        "TRANSFER (rx / tx)",
        "STATE",
    ];
    let cells: Vec<[String; 7]> = report
        .peers
        .iter()
        .map(|r| {
            let path = match r.path.as_deref() {
                None => "-".to_string(),
                Some(p) if p.starts_with("no path") => "no path".to_string(),
                Some(p) => p.to_string(),
            };
            [
                r.node.clone(),
                r.subnet.clone(),
                r.endpoint.clone(),
                path,
                r.handshake_secs
                    .map_or_else(|| "-".into(), |s| format!("{s} s ago")),
                if r.rx_bytes.is_some() {
                    format!("{} / {}", bytes(r.rx_bytes), bytes(r.tx_bytes))
                } else {
                    "-".into()
                },
                r.state.clone(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cols: Vec<&str>| {
        let mut l: String = cols
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}  "))
            .collect();
        l.truncate(l.trim_end().len());
        l + "\n"
    };
    out += &line(header.to_vec());
    for row in &cells {
        out += &line(row.iter().map(String::as_str).collect());
    }
    if cells.is_empty() {
        out += "(no peers)\n";
    }
    out += &backend_lines(&report.backends, &report.backend);
    for r in &report.peers {
        if let Some(why) = r.path.as_deref().and_then(|p| p.strip_prefix("no path: ")) {
            out += &format!("{}: no path: {why}\n", r.node);
        }
    }
    if let Some(relay) = &report.relay {
        out += &relay_lines(relay);
    }
    out += &path_lines(&report.paths, SystemTime::now());
    out += &super::pq_status::lines(&report.post_quantum, SystemTime::now());
    out
}

/// Peers per backend while more than one is in use (or this node still speaks an old
/// one), and every pair in clear with why.
pub fn backend_lines(b: &crate::observe::snapshot::BackendsInfo, ours: &str) -> String {
    let changing = b.peers.keys().any(|k| k != ours) || !b.also.is_empty();
    if !changing && b.clear.is_empty() {
        return String::new();
    }
    let counts: Vec<String> = b.peers.iter().map(|(k, n)| format!("{k} {n}")).collect();
    let mut out = format!(
        "
backend change: peers per backend: {}",
        counts.join(", ")
    );
    if !b.also.is_empty() {
        out += &format!(
            "; this node also speaks {} while a peer runs it",
            b.also.join(", ")
        );
    }
    out += "
";
    for c in &b.clear {
        out += &format!("  in clear: {}: {}\n", c.node, c.why);
    }
    out
}

/// A gateway's relay: what it holds and carries, by pair.
pub fn relay_lines(relay: &crate::observe::snapshot::RelayInfo) -> String {
    let mut out = format!(
        "\nrelay (this node is a gateway, UDP port {}): {} pair routes, {} datagrams ({}) carried{}\n",
        relay.port,
        relay.routes,
        relay.datagrams,
        bytes(Some(relay.bytes)),
        match relay.restored {
            0 => String::new(),
            n => format!(", {n} routes taken back at start"),
        }
    );
    for p in &relay.pairs {
        out += &format!("  {} -> {}: {}\n", p.from, p.to, bytes(Some(p.bytes)));
    }
    out
}

/// A line per peer path: its measured MTU, when, and what weft did about a narrow one.
pub fn path_lines(paths: &[PathInfo], now: SystemTime) -> String {
    let mut out = String::new();
    if !paths.is_empty() {
        out += "\npaths (the underlay to each peer):\n";
    }
    for p in paths {
        let when = p.measured_ms.map_or_else(
            || "not measured yet".to_string(),
            |ms| {
                let at = SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
                let ago = now.duration_since(at).unwrap_or_default().as_secs();
                format!("measured {ago} s ago")
            },
        );
        let what = match (p.path_mtu, p.route_mtu) {
            (Some(m), _) if p.unanswered => {
                format!("the peer answers no probe now; its routes keep what path MTU {m} allows")
            }
            (None, _) if p.unanswered => {
                "the peer answers no probe; its routes keep the pod MTU".to_string()
            }
            (Some(m), Some(r)) => format!(
                "path MTU {m}, {when}; narrower than the pod MTU: its routes carry MTU {r} \
                 ({m} less {} of encapsulation)",
                p.overhead
            ),
            (Some(m), None) => format!("path MTU {m}, {when}"),
            (None, _) => when,
        };
        out += &format!("  {} ({}): {what}\n", p.node, p.address);
    }
    out
}

/// The report for the agent answering on the control socket.
pub async fn report(snapshot: Snapshot) -> anyhow::Result<Report> {
    // Every WireGuard device the peers are on (both families' with `Mode: separate`).
    let mut devices = BTreeMap::new();
    if matches!(snapshot.implementation.as_str(), "kernel" | "userspace") {
        // A node that speaks two backends during a change has peers on other devices too
        // (`flannel.1`, `flannel-ipsec`), which are not WireGuard's to read.
        let names: std::collections::BTreeSet<&String> = snapshot
            .peers
            .iter()
            .filter_map(|p| p.device.as_ref())
            .filter(|d| d.starts_with(weft_backends::plan::WG_DEVICE))
            .collect();
        for name in names {
            if let Some(d) = read_device(name).await? {
                devices.insert(name.clone(), d);
            }
        }
    }
    let esp = esp_states(&snapshot)?;
    Ok(Report {
        peers: rows(&snapshot, &devices, &esp, SystemTime::now()),
        node: snapshot.node.clone(),
        subnet: or_dash(snapshot.subnet),
        backend: snapshot.backend.clone(),
        implementation: snapshot.implementation.clone(),
        device: snapshot.device.clone(),
        public_ip: snapshot.public_ip.map(|i| i.to_string()),
        paths: snapshot.paths.clone(),
        post_quantum: snapshot.post_quantum.clone(),
        relay: snapshot.relay.clone(),
        backends: snapshot.backends.clone(),
    })
}

pub fn run(args: &StatusArgs, out: &mut dyn Write) -> anyhow::Result<i32> {
    let snapshot =
        crate::observe::control_socket::fetch(&crate::observe::control_socket::socket_path())?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let report = runtime.block_on(report(snapshot))?;
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        write!(out, "{}", table(&report))?;
    }
    Ok(0)
}

#[cfg(test)]
#[path = "status_tests.rs"]
mod tests;
