//! What the loop remembers of its WireGuard peers between passes, for the plan's
//! `Observed`: the endpoint each peer was planned with, and when this agent last set it.
//! Joined with what the device holds now, it is all the planner needs to decide whether a
//! peer keeps an endpoint learned by roaming (`weft_backends::plan::roaming`).

use std::collections::BTreeMap;
use std::iter::Peekable;
use std::sync::Arc;
use std::time::SystemTime;

use weft_backends::model::sorted::{walk, Side};
use weft_backends::model::{DesiredState, DevicePeer, PeerObserved};

/// Keyed by device and peer: with `Mode: separate` a node is a peer of both devices. Each
/// pass joins these with every peer the device holds, so they are kept sorted by that key
/// and joined in one walk (at 10,000 peers, three hashed lookups per peer per pass were a
/// tenth of the agent's time under churn).
#[derive(Default)]
pub(super) struct Roaming {
    /// The plan last passed: its endpoints are the ones each peer was planned with.
    last: Option<Arc<DesiredState>>,
    set_at: BTreeMap<DevicePeer, SystemTime>,
}

/// The value of `key` in the sorted entries `rest`, which are advanced past it: called
/// with ascending keys, a walk of the whole map.
fn next_at<'a, V: Copy + 'a>(
    rest: &mut Peekable<impl Iterator<Item = (&'a DevicePeer, &'a V)>>,
    key: &DevicePeer,
) -> Option<V> {
    while rest.next_if(|(k, _)| *k < key).is_some() {}
    rest.next_if(|(k, _)| *k == key).map(|(_, v)| *v)
}

impl Roaming {
    /// The device's peers with this memory, as the plan takes them.
    pub(super) fn observed(
        &self,
        mut device: BTreeMap<DevicePeer, PeerObserved>,
    ) -> BTreeMap<DevicePeer, PeerObserved> {
        let planned = self.last.as_deref().map(|s| &s.planned_endpoints);
        let mut planned = planned.into_iter().flatten().peekable();
        let mut set_at = self.set_at.iter().peekable();
        for (key, peer) in device.iter_mut() {
            peer.planned_before = next_at(&mut planned, key);
            peer.endpoint_set = next_at(&mut set_at, key);
        }
        device
    }

    /// Remembers a pass: the endpoints `state` planned, the peers whose endpoint the data
    /// plane set (`set`), and the peers seen for the first time.
    /// Peers no longer planned are forgotten: under churn every departed or re-keyed peer
    /// left its entries here for good (the 30-minute soak measured the agent growing by
    /// 684 KiB a minute).
    pub(super) fn passed(
        &mut self,
        state: &Arc<DesiredState>,
        set: &[DevicePeer],
        now: SystemTime,
    ) {
        let planned = &state.planned_endpoints;
        match self.last.as_ref() {
            // The same plan as the last pass: the same peers.
            Some(last) if Arc::ptr_eq(last, state) => {}
            Some(last) => {
                let set_at = &mut self.set_at;
                walk(&last.planned_endpoints, planned, |side| match side {
                    Side::Gone(key, _) => {
                        set_at.remove(key);
                    }
                    Side::New(key, _) => {
                        set_at.entry(*key).or_insert(now);
                    }
                    Side::Both(..) => {}
                });
            }
            None => {
                self.set_at.retain(|key, _| planned.contains_key(key));
                for key in planned.keys() {
                    self.set_at.entry(*key).or_insert(now);
                }
            }
        }
        for key in set.iter().filter(|key| planned.contains_key(*key)) {
            self.set_at.insert(*key, now);
        }
        self.last = Some(state.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    #[test]
    fn peers_no_longer_planned_are_forgotten() {
        let key = |n: u8| {
            let k = weft_crypto::PrivateKey::from_bytes([n; 32]).public_key();
            ("flannel-wg".into(), k)
        };
        let addr: SocketAddr = "198.51.100.1:51820".parse().unwrap();
        let mut roaming = Roaming::default();
        for n in 1..=100 {
            let state = Arc::new(DesiredState {
                planned_endpoints: [(key(n), addr)].into(),
                ..Default::default()
            });
            roaming.passed(&state, &[key(n)], SystemTime::now());
        }
        assert_eq!(roaming.set_at.len(), 1);
        assert!(roaming.set_at.contains_key(&key(100)));
    }

    #[test]
    fn each_device_peer_gets_its_own_memory() {
        let key = |n: u8| {
            let k = weft_crypto::PrivateKey::from_bytes([n; 32]).public_key();
            ("flannel-wg".into(), k)
        };
        let addr = |n: u8| SocketAddr::from(([198, 51, 100, n], 51820));
        let (t0, t1) = (SystemTime::UNIX_EPOCH, SystemTime::now());
        let mut roaming = Roaming::default();
        let plan = |ns: &[u8]| {
            Arc::new(DesiredState {
                planned_endpoints: ns.iter().map(|&n| (key(n), addr(n))).collect(),
                ..Default::default()
            })
        };
        roaming.passed(&plan(&[2, 4, 6]), &[], t0);
        // Peer 4 left, 5 joined and its endpoint was set, 6's endpoint was set again.
        roaming.passed(&plan(&[2, 5, 6]), &[key(5), key(6), key(9)], t1);
        let device: BTreeMap<_, _> = [1, 2, 4, 5, 6, 7]
            .map(|n| (key(n), PeerObserved::default()))
            .into();
        let seen: Vec<_> = roaming
            .observed(device)
            .values()
            .map(|p| (p.planned_before, p.endpoint_set))
            .collect();
        // Peer keys sort by their bytes, not by n: compare per key.
        let expect = |n: u8| match n {
            2 => (Some(addr(2)), Some(t0)),
            5 => (Some(addr(5)), Some(t1)),
            6 => (Some(addr(6)), Some(t1)),
            _ => (None, None),
        };
        let mut keys: Vec<u8> = vec![1, 2, 4, 5, 6, 7];
        keys.sort_by_key(|&n| key(n));
        assert_eq!(seen, keys.iter().map(|&n| expect(n)).collect::<Vec<_>>());
        assert!(!roaming.set_at.contains_key(&key(9)), "9 is not planned");
    }
}
