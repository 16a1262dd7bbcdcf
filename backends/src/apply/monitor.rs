//! Wakes the control loop when the kernel reports that a link, an address or a route went
//! away: a deleted device is back within one reconcile, not one resync period. It only
//! signals; the reconcile re-reads everything (level-triggered).

use futures::StreamExt;
use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::RouteNetlinkMessage;
use rtnetlink::constants::{
    RTMGRP_IPV4_IFADDR, RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_IFADDR, RTMGRP_IPV6_ROUTE, RTMGRP_LINK,
};
use rtnetlink::sys::{AsyncSocket, SocketAddr};
use tokio::sync::mpsc;

use super::ApplyError;

/// Starts listening; each deletion the kernel reports sends one `()` (coalesced: a full
/// channel means a wake-up is already pending). Must run inside a tokio runtime.
pub fn deletions() -> Result<mpsc::Receiver<()>, ApplyError> {
    let fail = |source| ApplyError::Netlink {
        op: "subscribing to link, address and route events".into(),
        source,
    };
    let (mut conn, _handle, mut messages) = rtnetlink::new_connection().map_err(fail)?;
    let groups = RTMGRP_LINK
        | RTMGRP_IPV4_IFADDR
        | RTMGRP_IPV4_ROUTE
        | RTMGRP_IPV6_IFADDR
        | RTMGRP_IPV6_ROUTE;
    conn.socket_mut()
        .socket_mut()
        .bind(&SocketAddr::new(0, groups))
        .map_err(fail)?;
    tokio::spawn(conn);
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        while let Some((msg, _)) = messages.next().await {
            let deleted = matches!(
                msg.payload,
                NetlinkPayload::InnerMessage(
                    RouteNetlinkMessage::DelLink(_)
                        | RouteNetlinkMessage::DelAddress(_)
                        | RouteNetlinkMessage::DelRoute(_)
                )
            );
            if deleted && tx.try_send(()).is_err() && tx.is_closed() {
                return;
            }
        }
    });
    Ok(rx)
}
