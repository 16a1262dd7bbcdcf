//! Wakes the control loop when the kernel reports that a link, an address, a route or a
//! permanent neighbour/FDB entry went away: a deleted device is back within one reconcile, not one resync period. It only
//! signals; the reconcile re-reads everything (level-triggered).

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
/// channel means a wake-up is already pending). Must run inside a tokio runtime.
pub fn deletions() -> Result<mpsc::Receiver<()>, ApplyError> {
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
