//! This node's relay while its lease makes it a gateway (`--gateway`, or the Node's
//! `weft.dev/gateway: "true"`): started on its relay port, told every node of the cluster
//! it may carry datagrams to (`weft_backends::plan::relay::relay_members`), stopped when
//! the node is no longer a gateway. Its routes are kept in `/run/weft/relay.state`
//! (tmpfs), so an agent that restarts carries its pairs on at once. What it carries goes
//! to `weft status` and `/metrics` through the snapshot.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};
use weft_backends::model::{ClusterView, Lease};
use weft_backends::plan::relay::relay_members;
use weft_backends::userspace::relay::{Member, Relay};

use crate::observe::snapshot;

/// Where the relay keeps its routes across restarts.
pub const STATE_FILE: &str = "/run/weft/relay.state";

/// A running relay and the view its members were last taken from.
pub struct Gateway {
    relay: Arc<Relay>,
    port: u16,
    view: Option<Arc<ClusterView>>,
}

/// Starts, stops or updates `gateway` for this node (`me`) and the cluster (`view`).
pub fn follow(
    gateway: &mut Option<Gateway>,
    me: &Lease,
    view: &Arc<ClusterView>,
    listen_port: u16,
    snapshot: &snapshot::Shared,
) {
    let wanted = me.reach.gateway;
    if gateway.as_ref().map(|g| g.port) != wanted {
        if gateway.take().is_some() {
            info!("relay stopped: this node is no longer a gateway");
            snapshot.relay(None);
        }
        let Some(port) = wanted else { return };
        let state = std::env::var_os("WEFT_RELAY_STATE")
            .map_or_else(|| PathBuf::from(STATE_FILE), PathBuf::from);
        match Relay::start(port, Some(state)) {
            Ok(relay) => {
                let relay = Arc::new(relay);
                info!(port, zone = ?me.reach.zone, "this node is a gateway: relaying for pairs that cannot reach each other");
                snapshot.relay(Some(relay.clone()));
                *gateway = Some(Gateway {
                    relay,
                    port,
                    view: None,
                });
            }
            Err(e) => {
                warn!(port, error = %e, "cannot start this gateway's relay (is the port taken?); pairs through it move to another gateway");
                return;
            }
        }
    }
    let Some(g) = gateway.as_mut() else { return };
    if g.view.as_ref().is_some_and(|v| Arc::ptr_eq(v, view)) {
        return;
    }
    let members: Vec<Member> = relay_members(me, view, listen_port)
        .into_iter()
        .map(|m| Member {
            node: Arc::from(m.node.as_str()),
            key: *m.key.as_bytes(),
            home: m.home,
        })
        .collect();
    g.relay.set_members(&members);
    g.view = Some(view.clone());
}

/// A gateway's relay as it stands (`crate::relay`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RelayInfo {
    pub port: u16,
    /// Nodes it may carry datagrams to, and pair routes it holds now.
    pub members: usize,
    pub routes: usize,
    pub datagrams: u64,
    pub bytes: u64,
    /// Routes taken back from its state file at start.
    pub restored: usize,
    /// Datagrams dropped, by reason.
    pub dropped: Vec<(String, u64)>,
    /// Bytes carried from one node to another.
    pub pairs: Vec<RelayedPair>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RelayedPair {
    pub from: String,
    pub to: String,
    pub bytes: u64,
}

/// What `relay` holds and has carried, for the snapshot.
pub fn info(relay: &weft_backends::userspace::relay::Relay) -> RelayInfo {
    let s = relay.stats();
    RelayInfo {
        port: relay.port(),
        members: s.members,
        routes: s.routes,
        datagrams: s.datagrams,
        bytes: s.bytes,
        restored: s.restored,
        dropped: s
            .dropped
            .into_iter()
            .map(|(r, n)| (r.to_string(), n))
            .collect(),
        pairs: s
            .pairs
            .into_iter()
            .map(|p| RelayedPair {
                from: p.from.to_string(),
                to: p.to.to_string(),
                bytes: p.bytes,
            })
            .collect(),
    }
}
