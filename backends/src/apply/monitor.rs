//! Wakes the control loop when the kernel reports that a link, an address, a route or a
//! permanent neighbour/FDB entry went away (and, for ipsec, an XFRM state or policy): a
//! deleted device is back within one reconcile, not one resync period. It only signals;
//! the reconcile re-reads everything (level-triggered).

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
/// channel means a wake-up is already pending). With `xfrm`, XFRM state and policy
/// deletions and flushes count too. Must run inside a tokio runtime.
pub fn deletions(xfrm: bool) -> Result<mpsc::Receiver<()>, ApplyError> {
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
                NetlinkPayload::InnerMessage(
                    RouteNetlinkMessage::DelLink(_)
                    | RouteNetlinkMessage::DelAddress(_)
                    | RouteNetlinkMessage::DelRoute(_),
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
    let fail = |source| ApplyError::Netlink {
        op: "subscribing to XFRM state and policy events".into(),
        source,
    };
    let mut socket =
        netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_XFRM).map_err(fail)?;
    socket
        .bind(&SocketAddr::new(0, XFRM_GROUPS))
        .map_err(fail)?;
    std::thread::Builder::new()
        .name("xfrm-events".into())
        .spawn(move || {
            let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
            loop {
                buf.clear();
                let Ok(n) = socket.recv(&mut buf, 0) else {
                    // ENOBUFS (events dropped): a wake-up re-reads everything anyway.
                    if tx.try_send(()).is_err() && tx.is_closed() {
                        return;
                    }
                    continue;
                };
                if removal(&buf[..n]) && tx.try_send(()).is_err() && tx.is_closed() {
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
