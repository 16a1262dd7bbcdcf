//! The backends this node keeps speaking besides its config's while the cluster changes
//! backend (`weft_backends::plan::mixed`): the one it ran before its config changed, kept
//! while some peer still runs it, published beside the config's (etcd: `WeftAlso`,
//! Kubernetes: `weft.dev/also-backends`), and dropped once no peer has run it for
//! `GRACE`, with its device and routes.
//!
//! What the node ran is recorded in the state directory (`backend.last`: the backend it
//! publishes, its data and the others it still speaks) at every start and every change,
//! so a node restarted with a new config knows its old backend and the data its peers
//! hold for it (the VTEP MAC, the WireGuard port). A node that flannel ran before (its
//! vxlan device is there, no record) keeps flannel's vxlan the same way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{info, warn};
use weft_backends::model::{ClusterView, Lease};
use weft_backends::netconf::{BackendKind, NetConf};
use weft_backends::plan::mixed::KEPT_DURING_A_CHANGE;
use weft_crypto::PublicKey;

/// How long an old backend is kept once no peer runs it: time for every peer to have
/// read this node's last change and moved its pair, and for packets on their way.
pub const GRACE: Duration = Duration::from_secs(10);

/// How long the guard still takes a pair's pods in clear from the old backend's device
/// after the pair moved to an encrypting one (and after the agent starts): time for the
/// peer to read the move, so its packets on the way are not dropped
/// (`Observed::accept_clear_until`).
pub const CLEAR_DRAIN: Duration = Duration::from_secs(5);

/// Whether a pair in clear in `last` is encrypted in `state`.
pub fn left_clear(
    last: Option<&weft_backends::model::DesiredState>,
    state: &weft_backends::model::DesiredState,
) -> bool {
    let Some(last) = last else { return false };
    last.pair_backends
        .iter()
        .filter(|p| p.why_clear.is_some())
        .any(|p| {
            state
                .pair_backends
                .iter()
                .any(|n| n.node == p.node && n.why_clear.is_none())
        })
}

const RECORD: &str = "backend.last";

/// What a node published, as recorded in its state directory.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Record {
    #[serde(rename = "Type")]
    kind: String,
    #[serde(rename = "Data", default)]
    data: Option<Value>,
    #[serde(rename = "Also", default)]
    also: BTreeMap<String, Value>,
}

fn record_path(state_dir: &Path) -> PathBuf {
    state_dir.join(RECORD)
}

/// The backend this node published when it last recorded one (`backend.last`).
pub fn last_backend(state_dir: &Path) -> Option<String> {
    let bytes = std::fs::read(record_path(state_dir)).ok()?;
    serde_json::from_slice::<Record>(&bytes)
        .ok()
        .map(|r| r.kind)
}

/// The backends this node speaks besides `net`'s at start (with their data), from what it
/// recorded last, or flannel's vxlan device (`flannel_vxlan`: its data, if the device is
/// there); records the new state.
pub fn at_start(
    net: &NetConf,
    data: Option<&Value>,
    public_key: &PublicKey,
    state_dir: &Path,
    flannel_vxlan: Option<Value>,
) -> BTreeMap<String, Value> {
    let kind = net.backend.kind();
    let path = record_path(state_dir);
    let last: Option<Record> = match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|e| warn!(path = %path.display(), error = %e, "not a backend record; taken as none"))
            .ok(),
        Err(_) => None,
    };
    let mut also = BTreeMap::new();
    let kept = |name: &str| {
        name.parse::<BackendKind>()
            .is_ok_and(|k| k != kind && KEPT_DURING_A_CHANGE.contains(&k))
    };
    match &last {
        Some(last) => {
            if kept(&last.kind) {
                also.insert(last.kind.clone(), last.data.clone().unwrap_or(Value::Null));
            } else if last.kind != kind.as_str() {
                warn!(was = %last.kind, now = kind.as_str(), "this node's old backend is not kept during the change (only wireguard, vxlan and host-gw are): its pairs with nodes still on it are down until they move");
            }
            for (name, value) in &last.also {
                if kept(name) {
                    also.entry(name.clone()).or_insert_with(|| value.clone());
                }
            }
        }
        None => {
            if let Some(vxlan) = flannel_vxlan.filter(|_| kind != BackendKind::Vxlan) {
                info!("flannel's vxlan device is here: vxlan is kept beside the config's backend while peers run it");
                also.insert(BackendKind::Vxlan.as_str().into(), vxlan);
            }
        }
    }
    // A key this node publishes for WireGuard is its key today, whatever it was.
    if let Some(wg) = also.get_mut(BackendKind::Wireguard.as_str()) {
        let port = wg
            .get("ListenPort")
            .and_then(Value::as_u64)
            .and_then(|p| u16::try_from(p).ok())
            .unwrap_or(51820);
        *wg = weft_backends::plan::wireguard_backend_data(public_key, port);
    }
    if !also.is_empty() {
        let names: Vec<&str> = also.keys().map(String::as_str).collect();
        info!(also = ?names, backend = kind.as_str(), "the cluster may be changing backend: this node speaks its old backend too while peers run it");
    }
    record(state_dir, kind, data, &also);
    also
}

/// Records what this node publishes now.
pub fn record(
    state_dir: &Path,
    kind: BackendKind,
    data: Option<&Value>,
    also: &BTreeMap<String, Value>,
) {
    let record = Record {
        kind: kind.as_str().into(),
        data: data.cloned(),
        also: also.clone(),
    };
    let path = record_path(state_dir);
    let written = serde_json::to_vec(&record)
        .map_err(anyhow::Error::from)
        .and_then(|bytes| {
            std::fs::create_dir_all(state_dir)?;
            weft_crypto::atomic_file::write_atomic(&path, &bytes, 0o644)?;
            Ok(())
        });
    if let Err(e) = written {
        warn!(path = %path.display(), error = %e, "recording this node's backend");
    }
}

/// Since when each backend this node still speaks has had no peer running it, and the
/// backends retired a moment ago whose devices still take what peers send before they
/// read the retirement (`CLEAR_DRAIN`).
#[derive(Debug, Default)]
pub struct Retiring {
    unneeded_since: BTreeMap<String, Instant>,
    draining: BTreeMap<String, (Value, Instant)>,
}

impl Retiring {
    /// The backends of `also` no live peer of `view` (but `me`) has run for `GRACE`.
    pub fn due(
        &mut self,
        also: &BTreeMap<String, Value>,
        view: &ClusterView,
        me: &str,
        now: Instant,
    ) -> Vec<String> {
        let wall = SystemTime::now();
        let runs = |kind: &str| {
            view.leases.values().any(|l| {
                l.node != me && l.backend_type == kind && l.expires.is_none_or(|t| t > wall)
            })
        };
        self.unneeded_since.retain(|k, _| also.contains_key(k));
        let mut due = Vec::new();
        for kind in also.keys() {
            if runs(kind) {
                self.unneeded_since.remove(kind);
                continue;
            }
            let since = *self.unneeded_since.entry(kind.clone()).or_insert(now);
            if now.duration_since(since) >= GRACE {
                due.push(kind.clone());
            }
        }
        due
    }

    /// How long until the next backend's grace or drain ends, if one is running.
    pub fn wait(&self, now: Instant) -> Option<Duration> {
        self.unneeded_since
            .values()
            .map(|since| *since + GRACE)
            .chain(self.draining.values().map(|(_, until)| *until))
            .map(|at| at.saturating_duration_since(now))
            .min()
    }

    /// Keeps `kind`'s device (with its `data`) for `CLEAR_DRAIN` after it is retired.
    pub fn drain(&mut self, kind: String, data: Value, now: Instant) {
        self.unneeded_since.remove(&kind);
        self.draining.insert(kind, (data, now + CLEAR_DRAIN));
    }

    /// `kind` is spoken again (taken up while its device drained): no longer draining.
    pub fn undrain(&mut self, kind: &str) {
        self.draining.remove(kind);
    }

    /// Drops the drains that have ended; whether one did.
    pub fn drained(&mut self, now: Instant) -> bool {
        let before = self.draining.len();
        self.draining.retain(|_, (_, until)| *until > now);
        self.draining.len() != before
    }

    /// The backends retired a moment ago whose devices are kept (`drain`).
    pub fn draining(&self) -> std::collections::BTreeSet<String> {
        self.draining.keys().cloned().collect()
    }

    /// `me` as the plan takes it: with the backends still draining.
    pub fn planned_lease<'a>(&self, me: &'a Lease) -> std::borrow::Cow<'a, Lease> {
        if self.draining.is_empty() {
            return std::borrow::Cow::Borrowed(me);
        }
        let mut lease = me.clone();
        for (kind, (data, _)) in &self.draining {
            if kind != &lease.backend_type {
                lease
                    .also
                    .entry(kind.clone())
                    .or_insert_with(|| data.clone());
            }
        }
        std::borrow::Cow::Owned(lease)
    }
}

/// Whether `state` drops a vxlan device `last` had (a retired backend's: only a full pass
/// removes one; ipip is never kept, and WireGuard devices go in any pass).
pub fn devices_dropped(
    last: Option<&weft_backends::model::DesiredState>,
    state: &weft_backends::model::DesiredState,
) -> bool {
    let Some(last) = last else { return false };
    last.vxlan
        .iter()
        .any(|v| !state.vxlan.iter().any(|n| n.device == v.device))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(node: &str, backend: &str) -> Lease {
        weft_backends::model::LeaseAttrs {
            backend_type: backend.into(),
            ..Default::default()
        }
        .into_lease(node.into(), None, None)
    }

    #[test]
    fn an_old_backend_is_kept_while_a_peer_runs_it_and_retired_after_the_grace() {
        let mut view = ClusterView::default();
        view.insert(lease("me", "wireguard"));
        view.insert(lease("b", "vxlan"));
        let also: BTreeMap<String, Value> = [("vxlan".to_string(), Value::Null)].into();
        let mut retiring = Retiring::default();
        let t0 = Instant::now();
        assert!(retiring.due(&also, &view, "me", t0).is_empty());
        assert!(retiring.due(&also, &view, "me", t0 + GRACE * 2).is_empty());
        // b moves: the grace starts then, not before.
        view.insert(lease("b", "wireguard"));
        let t1 = t0 + GRACE * 3;
        assert!(retiring.due(&also, &view, "me", t1).is_empty());
        assert!(retiring.due(&also, &view, "me", t1 + GRACE / 2).is_empty());
        assert_eq!(retiring.due(&also, &view, "me", t1 + GRACE), ["vxlan"]);
        // Only this node running it does not keep it.
        view.insert(lease("me", "vxlan"));
        assert_eq!(retiring.due(&also, &view, "me", t1 + GRACE * 2), ["vxlan"]);
    }

    #[test]
    fn a_restart_onto_a_new_backend_keeps_the_old_one_and_its_data() {
        let dir = std::env::temp_dir().join(format!("weft-also-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let key = weft_crypto::PrivateKey::from_bytes([7; 32]).public_key();
        let vxlan = weft_backends::netconf::parse(
            r#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#,
        )
        .unwrap();
        let wg = weft_backends::netconf::parse(r#"{"Network":"10.244.0.0/16"}"#).unwrap();
        let mac = serde_json::json!({"VNI": 1, "VtepMAC": "0a:00:00:00:00:01"});
        // First start on vxlan: nothing else spoken.
        assert!(at_start(&vxlan, Some(&mac), &key, &dir, None).is_empty());
        // Restarted on wireguard: vxlan kept, with the MAC peers hold.
        let also = at_start(&wg, None, &key, &dir, None);
        assert_eq!(also.get("vxlan"), Some(&mac));
        // Restarted again (a crash in the middle of the change): still kept.
        assert_eq!(at_start(&wg, None, &key, &dir, None), also);
        // Once retired and recorded, not brought back.
        record(&dir, BackendKind::Wireguard, None, &BTreeMap::new());
        assert!(at_start(&wg, None, &key, &dir, None).is_empty());
        // flannel's device and no record: flannel's vxlan kept.
        let _ = std::fs::remove_dir_all(&dir);
        let also = at_start(&wg, None, &key, &dir, Some(mac.clone()));
        assert_eq!(also.get("vxlan"), Some(&mac));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
