//! The checks that send packets: handshakes (nudged through the tunnel) and reachability of
//! each peer's UDP port (an ICMP error means refused or unreachable; WireGuard itself
//! answers nothing to a stranger). The path MTU check is `path_mtu`.

use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant, SystemTime};

use weft_backends::apply::wireguard::read::read_device;
use weft_crypto::PublicKey;

use super::Check;
use crate::commands::status::HANDSHAKE_FRESH;
use crate::observe::snapshot::{PeerInfo, Snapshot};

/// Seconds since `peer`'s last handshake on the device, if it has had one.
async fn ages(snapshot: &Snapshot) -> Vec<(String, Option<u64>)> {
    let device = match &snapshot.device {
        Some(d) => read_device(d).await.ok().flatten(),
        None => None,
    };
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    snapshot
        .peers
        .iter()
        .map(|p| {
            let age = p
                .public_key
                .as_deref()
                .and_then(|k| k.parse::<PublicKey>().ok())
                .and_then(|k| device.as_ref()?.peers.get(&k)?.last_handshake)
                .filter(|t| !t.is_zero())
                .map(|t| now.saturating_sub(t).as_secs());
            (p.node.clone(), age)
        })
        .collect()
}

fn fresh(age: Option<u64>) -> bool {
    age.is_some_and(|a| a <= HANDSHAKE_FRESH.as_secs())
}

/// One datagram into the tunnel towards `peer` (its subnet's first address): WireGuard
/// starts a handshake for it if it has no session.
pub(super) fn nudge(peer: &PeerInfo) {
    let Some(subnet) = peer.subnet else { return };
    let target = SocketAddr::new(subnet.network(), 9);
    let bind = if target.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    if let Ok(s) = UdpSocket::bind(bind) {
        let _ = s.send_to(b"weft-doctor", target);
    }
}

pub async fn handshakes(snapshot: &Snapshot, wait: Duration) -> Check {
    const NAME: &str = "handshakes";
    let mut now = ages(snapshot).await;
    for (p, (_, age)) in snapshot.peers.iter().zip(&now) {
        if !fresh(*age) {
            nudge(p);
        }
    }
    let deadline = Instant::now() + wait;
    while now.iter().any(|(_, a)| !fresh(*a)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        now = ages(snapshot).await;
    }
    let stale: Vec<String> = snapshot
        .peers
        .iter()
        .zip(&now)
        .filter(|(_, (_, a))| !fresh(*a))
        .map(|(p, (_, a))| match a {
            Some(a) => format!(
                "{} (last {a} s ago, endpoint {})",
                p.node,
                p.endpoint.as_deref().unwrap_or("-")
            ),
            None => format!(
                "{} (never, endpoint {})",
                p.node,
                p.endpoint.as_deref().unwrap_or("-")
            ),
        })
        .collect();
    if stale.is_empty() {
        let oldest = now.iter().filter_map(|(_, a)| *a).max().unwrap_or(0);
        return Check::pass(
            NAME,
            format!(
                "all {} peers have a session (oldest handshake {oldest} s ago)",
                now.len()
            ),
        );
    }
    Check::fail(
        NAME,
        format!("no handshake within {} s of a nudge: {}", wait.as_secs(), stale.join(", ")),
        "check that the peer's agent runs and that its endpoint is reachable on UDP (see reachability); behind a NAT, set public-ip-overwrite on its Node and PersistentKeepaliveInterval",
    )
}

/// The UDP target of `peer`: its WireGuard endpoint, or its address and the vxlan port.
pub(super) fn target(snapshot: &Snapshot, peer: &PeerInfo) -> Option<SocketAddr> {
    let endpoint = peer.endpoint.as_deref()?;
    if let Ok(sa) = endpoint.parse::<SocketAddr>() {
        return Some(sa);
    }
    let ip: IpAddr = endpoint.parse().ok()?;
    Some(SocketAddr::new(ip, snapshot.vxlan_port?))
}

enum Answer {
    /// No ICMP error within the wait (or a reply).
    Quiet,
    Refused,
    Unreachable(io::Error),
}

fn probe_once(target: SocketAddr) -> Answer {
    let bind = if target.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let socket = match UdpSocket::bind(bind).and_then(|s| s.connect(target).map(|()| s)) {
        Ok(s) => s,
        Err(e) => return Answer::Unreachable(e),
    };
    let _ = socket.set_read_timeout(Some(Duration::from_millis(1500)));
    if let Err(e) = socket.send(b"weft-doctor") {
        return Answer::Unreachable(e);
    }
    let mut buf = [0u8; 64];
    match socket.recv(&mut buf) {
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Answer::Refused,
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EHOSTUNREACH | libc::ENETUNREACH)
            ) =>
        {
            Answer::Unreachable(e)
        }
        _ => Answer::Quiet,
    }
}

pub async fn reachability(snapshot: &Snapshot) -> Check {
    const NAME: &str = "reachability";
    let targets: Vec<(String, SocketAddr)> = snapshot
        .peers
        .iter()
        .filter_map(|p| Some((p.node.clone(), target(snapshot, p)?)))
        .collect();
    if targets.is_empty() {
        return Check::pass(NAME, "no UDP tunnel endpoints to probe");
    }
    let probes: Vec<_> = targets
        .iter()
        .map(|(node, t)| {
            let (node, t) = (node.clone(), *t);
            tokio::task::spawn_blocking(move || (node, t, probe_once(t)))
        })
        .collect();
    let mut problems = Vec::new();
    for p in probes {
        let Ok((node, t, answer)) = p.await else {
            continue;
        };
        match answer {
            Answer::Quiet => {}
            Answer::Refused => problems.push(format!("{node}: {t} refused (ICMP port unreachable: nothing listens, or a firewall rejects UDP {})", t.port())),
            Answer::Unreachable(e) => problems.push(format!("{node}: {t} unreachable ({e})")),
        }
    }
    if problems.is_empty() {
        Check::pass(
            NAME,
            format!(
                "no ICMP errors from the {} peers' UDP endpoints",
                targets.len()
            ),
        )
    } else {
        Check::fail(
            NAME,
            problems.join("; "),
            "open the tunnel's UDP port between the nodes (security groups, host firewalls), and check the peer's published address",
        )
    }
}
