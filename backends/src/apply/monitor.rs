//! Wakes the control loop when the kernel reports that a link, an address, a route or a
//! permanent neighbour/FDB entry went away (and, for ipsec, an XFRM state or policy): a
//! deleted device is back within one reconcile, not one resync period. `nftables_changes`
//! does the same for nftables (any change to any table): the agent lists its tables when
//! one arrives instead of running `nft` every 2 s. They only signal; the reconcile re-reads
//! everything (level-triggered).

use futures::StreamExt;
use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::RouteNetlinkMessage;
use rtnetlink::constants::{
    RTMGRP_IPV4_IFADDR, RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_IFADDR, RTMGRP_IPV6_ROUTE, RTMGRP_LINK,
    RTMGRP_NEIGH,
};
use rtnetlink::sys::{AsyncSocket, SocketAddr};
use tokio::sync::mpsc;

use super::ApplyError;

/// Starts listening; each deletion the kernel reports sends one `()` (coalesced: a full
/// channel means a wake-up is already pending), but for the deletions of weft's routes
/// that the data plane announced in `own` (its own work). With `xfrm`, XFRM state and
/// policy deletions and flushes count too. Must run inside a tokio runtime.
pub fn deletions(xfrm: bool, own: super::OwnDeletions) -> Result<mpsc::Receiver<()>, ApplyError> {
    let fail = |source| ApplyError::Netlink {
        op: "subscribing to link, address, route and neighbour events".into(),
        source,
    };
    let (mut conn, _handle, mut messages) = rtnetlink::new_connection().map_err(fail)?;
    let groups = RTMGRP_LINK
        | RTMGRP_IPV4_IFADDR
        | RTMGRP_IPV4_ROUTE
        | RTMGRP_IPV6_IFADDR
        | RTMGRP_IPV6_ROUTE
        | RTMGRP_NEIGH;
    conn.socket_mut()
        .socket_mut()
        .bind(&SocketAddr::new(0, groups))
        .map_err(fail)?;
    tokio::spawn(conn);
    let (tx, rx) = mpsc::channel(1);
    if xfrm {
        xfrm_deletions(tx.clone())?;
    }
    tokio::spawn(async move {
        while let Some((msg, _)) = messages.next().await {
            let deleted = match &msg.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelRoute(route)) => {
                    !super::rtnl::route_of(route)
                        .is_some_and(|r| r.protocol == super::RTPROT_WEFT && own.reported(r.dst))
                }
                NetlinkPayload::InnerMessage(
                    RouteNetlinkMessage::DelLink(_) | RouteNetlinkMessage::DelAddress(_),
                ) => true,
                // Only on weft's vxlan devices: the ARP cache elsewhere comes and goes all
                // the time.
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelNeighbour(n)) => {
                    interface_name(n.header.ifindex)
                        .is_some_and(|d| d.starts_with("flannel.") || d.starts_with("flannel-v6."))
                }
                _ => false,
            };
            if deleted && tx.try_send(()).is_err() && tx.is_closed() {
                return;
            }
        }
    });
    Ok(rx)
}

/// The name of interface `index` in this network namespace.
fn interface_name(index: u32) -> Option<String> {
    let mut buf = [0u8; libc::IF_NAMESIZE];
    // SAFETY: `buf` has the IF_NAMESIZE bytes if_indextoname(3) may write.
    let p = unsafe { libc::if_indextoname(index, buf.as_mut_ptr().cast()) };
    if p.is_null() {
        return None;
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// XFRM's multicast groups for states and policies (`XFRMNLGRP_SA`, `XFRMNLGRP_POLICY`).
const XFRM_GROUPS: u32 = 1 << (3 - 1) | 1 << (4 - 1);
/// `XFRM_MSG_DELSA`, `XFRM_MSG_DELPOLICY`, `XFRM_MSG_FLUSHSA`, `XFRM_MSG_FLUSHPOLICY`.
const XFRM_REMOVALS: [u16; 4] = [0x11, 0x14, 0x1c, 0x1d];

/// A thread reading XFRM events: a removal sends one `()`.
fn xfrm_deletions(tx: mpsc::Sender<()>) -> Result<(), ApplyError> {
    events_thread(
        "xfrm-events",
        "subscribing to XFRM state and policy events",
        netlink_sys::protocols::NETLINK_XFRM,
        XFRM_GROUPS,
        removal,
        tx,
    )
}

/// nf_tables' multicast group (`NFNLGRP_NFTABLES`).
const NFTABLES_GROUP: u32 = 1 << (7 - 1);

/// Starts listening to nf_tables' events: each datagram (a change to any table, chain,
/// rule or set, a flush, a deletion) sends one `()`, coalesced as `deletions` does.
pub fn nftables_changes() -> Result<mpsc::Receiver<()>, ApplyError> {
    let (tx, rx) = mpsc::channel(1);
    events_thread(
        "nft-events",
        "subscribing to nftables events",
        netlink_sys::protocols::NETLINK_NETFILTER,
        NFTABLES_GROUP,
        |_| true,
        tx,
    )?;
    Ok(rx)
}

/// A thread reading the multicast `groups` of netlink `protocol`: a datagram for which
/// `wanted` holds sends one `()`, as does a lost event (ENOBUFS: a wake-up re-reads
/// everything anyway). The thread ends when the receiver is dropped.
fn events_thread(
    name: &str,
    op: &str,
    protocol: isize,
    groups: u32,
    wanted: fn(&[u8]) -> bool,
    tx: mpsc::Sender<()>,
) -> Result<(), ApplyError> {
    let fail = |source| ApplyError::Netlink {
        op: op.into(),
        source,
    };
    let mut socket = netlink_sys::Socket::new(protocol).map_err(fail)?;
    socket.bind(&SocketAddr::new(0, groups)).map_err(fail)?;
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
            loop {
                buf.clear();
                let signal = match socket.recv(&mut buf, 0) {
                    Ok(n) => wanted(&buf[..n]),
                    Err(_) => true,
                };
                if signal && tx.try_send(()).is_err() && tx.is_closed() {
                    return;
                }
            }
        })
        .map_err(fail)?;
    Ok(())
}

/// Whether a datagram of netlink messages holds an XFRM removal.
fn removal(mut data: &[u8]) -> bool {
    while data.len() >= 16 {
        let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
        let kind = u16::from_ne_bytes([data[4], data[5]]);
        if XFRM_REMOVALS.contains(&kind) {
            return true;
        }
        let step = (len + 3) & !3;
        if step < 16 || step > data.len() {
            return false;
        }
        data = &data[step..];
    }
    false
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use weft_lab::netns::{in_new_netns, sh};

    use super::nftables_changes;

    #[test]
    fn a_table_added_flushed_and_deleted_is_reported_each_time() {
        in_new_netns(|| async {
            let mut changes = nftables_changes().unwrap();
            for cmd in [
                "nft add table ip weft_probe",
                "nft add chain ip weft_probe c",
                "nft add rule ip weft_probe c counter",
                "nft flush table ip weft_probe",
                "nft delete table ip weft_probe",
            ] {
                sh(cmd);
                let got = tokio::time::timeout(Duration::from_secs(1), changes.recv()).await;
                assert_eq!(got, Ok(Some(())), "no event after `{cmd}`");
                // What the command sent in more than one datagram is taken here.
                while changes.try_recv().is_ok() {}
            }
        });
    }
}
