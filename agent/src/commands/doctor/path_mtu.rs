//! The path MTU check: what the agent measured to each peer (its padded probes, which need
//! no ICMP), and, as a cross-check, a DF-marked datagram as large as the tunnel's largest
//! packet sent to each peer's port (the kernel learns a narrower path from a router's
//! ICMP error, where one comes back). A narrow path is fine when the agent measured it and
//! its routes carry the MTU that fits; it fails when nothing accounts for it, or when a
//! peer answers no probe.

use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, SystemTime};

use super::probe::target;
use super::Check;
use crate::observe::snapshot::{PathInfo, Snapshot};

const NAME: &str = "path MTU";

/// Sends a DF datagram of `size` bytes (IP) to `target`; `Ok(None)` if it went, or the
/// path MTU the kernel knows if it is smaller.
fn df_probe(target: SocketAddr, size: usize) -> io::Result<Option<u32>> {
    let socket = UdpSocket::bind("0.0.0.0:0")?;
    socket.connect(target)?;
    let fd = socket.as_raw_fd();
    let on: libc::c_int = libc::IP_PMTUDISC_DO;
    // SAFETY: setsockopt on our socket with an int of the size given.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let payload = vec![0u8; size.saturating_sub(28)];
    let path_mtu = || -> io::Result<u32> {
        let mut mtu: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt into an int of the size given, on our connected socket.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::IPPROTO_IP,
                libc::IP_MTU,
                (&mut mtu as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(mtu as u32)
    };
    // The first send may draw an ICMP "fragmentation needed" from a router on the path;
    // the kernel then knows the path MTU and refuses the second with EMSGSIZE.
    for attempt in 0..2 {
        match socket.send(&payload) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => return path_mtu().map(Some),
            // The peer's kernel answered the first datagram (port unreachable): it arrived
            // whole, so the path carries it.
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return Ok(None),
            Err(e) => return Err(e),
        }
        if attempt == 0 {
            std::thread::sleep(Duration::from_millis(300));
        }
    }
    Ok(None)
}

/// How the agent's measurement of a peer's path reads in a verdict.
fn measured(p: &PathInfo, now: SystemTime) -> String {
    let ago = p
        .measured_ms
        .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
        .and_then(|at| now.duration_since(at).ok())
        .map_or_else(String::new, |d| format!(", measured {} s ago", d.as_secs()));
    match (p.path_mtu, p.route_mtu) {
        (Some(m), Some(r)) => format!(
            "{} ({}): path MTU {m}{ago}, narrower than the pod MTU: its routes carry MTU {r}",
            p.node, p.address
        ),
        (Some(m), None) => format!("{} ({}): path MTU {m}{ago}", p.node, p.address),
        (None, _) => format!("{} ({}): not measured yet", p.node, p.address),
    }
}

pub async fn mtu(snapshot: &Snapshot) -> Check {
    let size = snapshot.underlay_mtu as usize;
    let targets: Vec<(String, SocketAddr)> = snapshot
        .peers
        .iter()
        .filter_map(|p| {
            let t = target(snapshot, p).or_else(|| {
                let ip: IpAddr = p.endpoint.as_deref()?.parse().ok()?;
                Some(SocketAddr::new(ip, 9))
            })?;
            t.is_ipv4().then(|| (p.node.clone(), t))
        })
        .collect();
    let probes: Vec<_> = targets
        .iter()
        .map(|(node, t)| {
            let (node, t) = (node.clone(), *t);
            tokio::task::spawn_blocking(move || (node, t, df_probe(t, size)))
        })
        .collect();
    let mut problems = Vec::new();
    let mut smallest = u32::MAX;
    let path_of = |node: &str, ip: IpAddr| {
        snapshot
            .paths
            .iter()
            .find(|p| p.node == node && p.address == ip)
    };
    for p in probes {
        let Ok((node, t, result)) = p.await else {
            continue;
        };
        match result {
            Ok(None) => {}
            // The agent measured this narrower path (or a narrower one still) and sized
            // the peer's routes for it: nothing to fix.
            Ok(Some(mtu))
                if path_of(&node, t.ip())
                    .and_then(|p| p.path_mtu)
                    .is_some_and(|m| m <= mtu) => {}
            Ok(Some(mtu)) => {
                smallest = smallest.min(mtu);
                problems.push(format!(
                    "{node}: the path to {} carries at most {mtu}-byte packets",
                    t.ip()
                ));
            }
            Err(e) => problems.push(format!("{node}: probing {t}: {e}")),
        }
    }
    let unanswered: Vec<String> = snapshot
        .paths
        .iter()
        .filter(|p| p.unanswered)
        .map(|p| {
            format!(
                "{} ({}): answers no path MTU probe, so its routes keep the pod MTU",
                p.node, p.address
            )
        })
        .collect();
    let now = SystemTime::now();
    let narrow: Vec<String> = snapshot
        .paths
        .iter()
        .filter(|p| p.route_mtu.is_some())
        .map(|p| measured(p, now))
        .collect();
    if !problems.is_empty() {
        let fix = if smallest < u32::MAX {
            format!(
                "the tunnel sends {size}-byte packets and path MTU discovery has not sized \
                 this peer's routes: let the nodes reach each other on the agent's \
                 --path-mtu-port (UDP, 51822 by default), or set Backend.MTU to {smallest} \
                 in net-conf.json (or raise the MTU along the path)"
            )
        } else {
            "check the route to the peer".to_string()
        };
        return Check::fail(NAME, problems.join("; "), fix);
    }
    if !unanswered.is_empty() {
        return Check::warn(
            NAME,
            unanswered.join("; "),
            "let the nodes reach each other on the agent's --path-mtu-port (UDP, 51822 by \
             default); a peer running flanneld or an older weft never answers",
        );
    }
    let mut detail = format!(
        "{size}-byte packets with DF set pass to all {} peers, or the agent sized their routes",
        targets.len()
    );
    if !narrow.is_empty() {
        detail += &format!("; {}", narrow.join("; "));
    }
    Check::pass(NAME, detail)
}
