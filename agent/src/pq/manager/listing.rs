//! The plan's list of post-quantum peers, taken by the task: pairs made, re-keyed and
//! dropped as the list changes.

use std::collections::{HashMap, HashSet};

use tracing::{debug, warn};
use weft_backends::model::{PqKey, PqPeer};
use weft_crypto::pq::Exchange;
use weft_crypto::PublicKey;

use super::{now_ms, Manager, Pair};
use crate::pq::list::{run, PqList};

impl Manager {
    /// The plan's new list: where it names the nodes changed since the list held, their
    /// entries alone are looked at; otherwise every entry.
    pub(super) fn take_list(&mut self, list: PqList) {
        let was = std::mem::take(&mut self.listed);
        match list.changed.as_ref().filter(|(from, _)| *from == was.seq) {
            Some((_, nodes)) => {
                let runs = |l: &PqList| -> Vec<PqPeer> {
                    (nodes.iter())
                        .flat_map(|n| run(l.peers(), n))
                        .cloned()
                        .collect()
                };
                self.set_peers(&runs(&was), &runs(&list), false);
            }
            None => self.set_peers(was.peers(), list.peers(), true),
        }
        self.listed = list;
    }

    /// The plan's peers, `listed` replacing `was` (every peer of the lists, `every`, or
    /// the changed nodes' alone): a pair for each new one, a new key for one that
    /// published another, none for one gone or that publishes no key any more. A peer
    /// listed as it was is left as it is: the list changes with every node that joins or
    /// leaves, and at 10,000 peers redoing every one was a tenth of the agent's time.
    pub(super) fn set_peers(&mut self, was: &[PqPeer], listed: &[PqPeer], every: bool) {
        let now = now_ms();
        let before: HashMap<PublicKey, &PqPeer> = was.iter().map(|p| (p.public_key, p)).collect();
        let unchanged = |peer: &PqPeer| before.get(&peer.public_key).is_some_and(|b| *b == peer);
        let mut keep = HashSet::new();
        let mut changed = Vec::new();
        for peer in listed {
            if unchanged(peer) {
                if peer.ek != PqKey::None {
                    keep.insert(peer.public_key);
                }
                continue;
            }
            changed.push(peer);
            let ek = match &peer.ek {
                PqKey::Published(ek) => ek,
                PqKey::None => continue,
                PqKey::Bad(why) => {
                    // The pair stays as it was: its PSK in force, rounds to the last key of
                    // the peer's that decoded (none if none ever did).
                    keep.insert(peer.public_key);
                    self.note(&peer.public_key, &peer.node, |s| {
                        s.classical_because = Some(why.clone())
                    });
                    continue;
                }
            };
            keep.insert(peer.public_key);
            if let Some(pair) = self.pairs.get_mut(&peer.public_key) {
                pair.address = peer.address;
                pair.underlay = peer.underlay;
                pair.ex.peer_ek_changed(ek.clone(), now);
                self.wake(peer.public_key, now);
                continue;
            }
            match Exchange::new(&self.own, peer.public_key, ek.clone(), self.timing, now) {
                Ok(mut ex) => {
                    self.left.remove(&peer.public_key);
                    if let Some(saved) = self.restored.remove(&peer.public_key) {
                        ex.restore(saved.current, saved.next);
                    }
                    debug!(peer = %peer.node, leads = ex.leads(), "post-quantum pair");
                    self.pairs.insert(
                        peer.public_key,
                        Pair {
                            node: peer.node.clone(),
                            address: peer.address,
                            underlay: peer.underlay,
                            ex,
                            wake_at: now,
                            switch_at: None,
                            rounds: 0,
                            in_force: None,
                        },
                    );
                    self.timers.insert((now, peer.public_key));
                    self.dirty.insert(peer.public_key);
                }
                Err(e) => {
                    warn!(peer = %peer.node, error = %e, "no post-quantum pair: it stays classical")
                }
            }
        }
        // Of the changed nodes' alone, only the pairs of their entries before can go.
        let gone: Vec<PublicKey> = match every {
            true => (self.pairs.keys())
                .filter(|key| !keep.contains(key))
                .copied()
                .collect(),
            false => (before.keys())
                .filter(|key| !keep.contains(key) && self.pairs.contains_key(key))
                .copied()
                .collect(),
        };
        for key in gone {
            self.keep_for_return(key, now);
            self.forget(key);
        }
        self.prune_left(now);
        if let Ok(mut status) = self.status.lock() {
            let listed_keys: HashSet<PublicKey> = listed.iter().map(|p| p.public_key).collect();
            for key in before.keys().filter(|key| !listed_keys.contains(*key)) {
                status.remove(key);
            }
            for peer in changed.into_iter().filter(|p| p.ek == PqKey::None) {
                let s = status.entry(peer.public_key).or_default();
                s.node = peer.node.clone();
                s.round_ms = None;
                s.classical_because = Some(
                    "it publishes no ML-KEM key (an older weft, flanneld, or PostQuantum off there)"
                        .into(),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::sync::Arc;

    use tokio::sync::watch;
    use weft_backends::model::DesiredState;
    use weft_backends::plan::{PatchedNode, PlanStamp};
    use weft_crypto::pq::{KemKeyPair, Own};
    use weft_crypto::PrivateKey;

    use super::*;
    use crate::pq::{Config, Published};

    fn peer(n: u8) -> PqPeer {
        let seed = [n; 64];
        PqPeer {
            node: format!("node-{n}"),
            public_key: PrivateKey::from_bytes([n; 32]).public_key(),
            address: IpAddr::from([10, 244, n, 0]),
            underlay: IpAddr::from([198, 51, 100, n]),
            ek: PqKey::Published(KemKeyPair::from_seed(seed).encaps_key()),
        }
    }

    fn manager(dir: &std::path::Path) -> Manager {
        let config = Config {
            own: Own {
                key: PrivateKey::from_bytes([99; 32]),
                kem: KemKeyPair::from_seed([99; 64]),
                previous_kem: None,
            },
            listen: crate::pq::Listen {
                rounds: vec![IpAddr::from([127, 0, 0, 1])],
                notices: Vec::new(),
            },
            port: 0,
            state_dir: dir.to_path_buf(),
            timing: crate::pq::tests::timing(),
        };
        let published = watch::channel(Published::default()).0;
        let sockets = super::super::Sockets {
            v4: None,
            v6: None,
            notice4: None,
            notice6: None,
        };
        Manager::new(config, sockets, published, Default::default())
    }

    /// Random lists, each handed over patched from the one before on its changed nodes or
    /// in full: the pairs are the ones a full hand-over of each list makes.
    #[test]
    fn pairs_follow_patched_lists_as_they_follow_whole_ones() {
        let dir = tempfile::tempdir().unwrap();
        let (mut patched, mut whole) = (manager(dir.path()), manager(dir.path()));
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut below = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let mut list = PqList::default();
        let mut present = [false; 12];
        for generation in 1..=200u64 {
            let mut changed = Vec::new();
            for _ in 0..=below(3) {
                let n = below(12) as usize;
                present[n] = !present[n];
                let node = format!("node-{n}");
                if changed.iter().all(|c: &PatchedNode| c.node != node) {
                    changed.push(PatchedNode {
                        node,
                        ..Default::default()
                    });
                }
            }
            let mut peers: Vec<PqPeer> = (0..12u8)
                .filter(|n| present[*n as usize])
                .map(peer)
                .collect();
            peers.sort_by(|a, b| a.node.cmp(&b.node));
            let full = generation == 1 || below(10) == 0;
            let stamp = PlanStamp {
                generation: Some(generation),
                patched: (!full).then_some((generation - 1, changed.as_slice())),
            };
            let plan = Arc::new(DesiredState {
                post_quantum: peers.clone(),
                ..Default::default()
            });
            list.follow(&plan, &stamp);
            patched.take_list(list.clone());
            whole.take_list(PqList::of(peers.clone()));
            let keys = |m: &Manager| {
                let mut k: Vec<PublicKey> = m.pairs.keys().copied().collect();
                k.sort();
                k
            };
            let mut want: Vec<PublicKey> = peers.iter().map(|p| p.public_key).collect();
            want.sort();
            assert_eq!(keys(&patched), want, "step {generation}");
            assert_eq!(keys(&whole), want, "step {generation}");
        }
    }
}
