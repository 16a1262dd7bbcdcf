//! A tunnel's UDP port taken by someone else (another vxlan or WireGuard device, or a
//! process): the kernel says only `Address already in use` when the device comes up or
//! its port is set. This turns that into one error naming the port, who holds it (as far
//! as `/proc` of this network namespace tells) and the fix; the routes that then fail
//! because the device is down are not reported one by one.

use std::io::ErrorKind;

use super::{ApplyError, RoutingChange};
use crate::model::DesiredState;

/// Whether `e` is the kernel's (or a userspace device's) "address already in use".
pub(crate) fn in_use(e: &ApplyError) -> bool {
    match e {
        ApplyError::Netlink { source, .. } | ApplyError::Io { source, .. } => {
            source.kind() == ErrorKind::AddrInUse
        }
        ApplyError::Nft { .. } => false,
    }
}

/// The UDP port `device` uses in `state`, and the config field that sets it.
pub(crate) fn port_of(state: &DesiredState, device: &str) -> Option<(u16, &'static str)> {
    if let Some(v) = state.vxlan.iter().find(|v| v.device == device) {
        // 0 is the kernel's default.
        let port = if v.port == 0 {
            super::vxlan::KERNEL_DEFAULT_PORT
        } else {
            v.port
        };
        return Some((port, "Port"));
    }
    state
        .tunnels
        .iter()
        .find(|t| t.device == device)
        .map(|t| (t.listen_port, "ListenPort"))
}

/// The one error for `device`, whose UDP `port` (set by `Backend.<field>`) is taken.
pub(crate) fn message(device: &str, port: u16, field: &str) -> String {
    format!(
        "{device} cannot use UDP port {port}: it is taken by {}. Free the port, or give the \
         network another one (Backend.{field} in net-conf.json)",
        holder(port)
    )
}

/// The routing pass's failures as errors to report: a device that could not come up
/// because its port is taken is one error, and the routes that failed because it is down
/// are left out (they follow it).
pub(crate) fn routing_errors(
    state: &DesiredState,
    failed: &[(RoutingChange, ApplyError)],
) -> Vec<String> {
    let mut down: Vec<&str> = Vec::new();
    let mut errors = Vec::new();
    for (change, e) in failed {
        if let RoutingChange::Link { device, .. } = change {
            if let Some((port, field)) = port_of(state, device).filter(|_| in_use(e)) {
                down.push(device);
                errors.push(message(device, port, field));
                continue;
            }
        }
        errors.push(format!("{change}: {e}"));
    }
    errors.retain(|text| !down.iter().any(|d| follows(text, d)));
    errors
}

/// A route on `device` that failed because the device is down.
fn follows(text: &str, device: &str) -> bool {
    text.contains(&format!(" dev {device}:")) && text.contains("Network is down")
}

/// Who holds UDP `port` in this network namespace: a process (pid and name), or a kernel
/// socket (a vxlan or WireGuard device).
pub fn holder(port: u16) -> String {
    let inodes = socket_inodes(port);
    if inodes.is_empty() {
        return "nothing this agent can see now (it may have been freed since)".into();
    }
    if inodes.iter().all(|i| *i == 0) {
        return "a kernel socket: another vxlan or WireGuard device (see `ip -d link show \
                type vxlan` and `wg show all listen-port`)"
            .into();
    }
    let owners: Vec<String> = inodes
        .iter()
        .filter(|i| **i != 0)
        .filter_map(|i| process_of(*i))
        .collect();
    if owners.is_empty() {
        "a process this agent cannot see".into()
    } else {
        owners.join(", ")
    }
}

/// The inodes of the UDP sockets bound to `port` (IPv4 and IPv6); 0 for a kernel socket.
fn socket_inodes(port: u16) -> Vec<u64> {
    let mut out = Vec::new();
    for file in ["/proc/net/udp", "/proc/net/udp6"] {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) {
                if let Some(inode) = fields.get(9).and_then(|i| i.parse().ok()) {
                    out.push(inode);
                }
            }
        }
    }
    out
}

/// "pid N (name)" of the process holding socket `inode`.
fn process_of(inode: u64) -> Option<String> {
    let wanted = format!("socket:[{inode}]");
    for proc_entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = proc_entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(proc_entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|target| target.as_os_str() == wanted.as_str())
        });
        if holds {
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            return Some(format!("pid {pid} ({})", name.trim()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_holding_the_port_is_named() {
        // A port below the ephemeral range: once it is freed, no other test's socket bound
        // to port 0 can take it before the second look (one did, in a full run).
        let (socket, port) = (20000..20100)
            .find_map(|p| Some((std::net::UdpSocket::bind(("127.0.0.1", p)).ok()?, p)))
            .unwrap();
        // Another socket on the port at another address (a lab's, a parallel test's) may
        // be named beside it (failed once in a full run): this process must be among the
        // holders, and gone from them once it lets go.
        let me = format!("pid {} (", std::process::id());
        let who = holder(port);
        assert!(who.contains(&me), "{who}");
        drop(socket);
        let after = holder(port);
        assert!(!after.contains(&me), "{after}");
    }

    #[test]
    fn routes_that_fail_because_the_device_is_down_follow_its_error() {
        let mut state = DesiredState::default();
        state.tunnels.push(crate::model::TunnelSpec {
            device: "flannel-wg".into(),
            listen_port: 51820,
            mtu: 1420,
            addresses: vec![],
            peers: vec![],
        });
        let in_use = || ApplyError::Netlink {
            op: "setting link flannel-wg mtu 1420 up".into(),
            source: std::io::Error::from_raw_os_error(libc::EADDRINUSE),
        };
        let down = || ApplyError::Netlink {
            op: "adding route 10.244.2.0/24 dev flannel-wg".into(),
            source: std::io::Error::from_raw_os_error(libc::ENETDOWN),
        };
        let route = RoutingChange::AddRoute(crate::apply::RouteWrite {
            dst: "10.244.2.0/24".parse().unwrap(),
            oif: 7,
            device: "flannel-wg".into(),
            gateway: None,
            onlink: false,
            mtu: None,
        });
        let link = RoutingChange::Link {
            device: "flannel-wg".into(),
            mtu: Some((1500, 1420)),
            up: true,
        };
        let errors = routing_errors(&state, &[(link, in_use()), (route, down())]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with("flannel-wg cannot use UDP port 51820: it is taken by ")
                && errors[0].ends_with("(Backend.ListenPort in net-conf.json)"),
            "{errors:?}"
        );
    }
}
