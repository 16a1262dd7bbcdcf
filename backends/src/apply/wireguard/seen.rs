//! Each WireGuard device as last read, with this agent's changes since, and the plan it
//! was last brought in line with: an incremental pass diffs against it instead of dumping
//! thousands of peers again, and a pass whose plan was patched from that one compares
//! only the peers of the nodes the planner re-planned (`diff::diff_device_peers`).

use std::collections::{BTreeSet, HashMap};

use weft_crypto::PublicKey;

use super::{WgDevice, WgPeer};
use crate::plan::PlanStamp;

#[derive(Default)]
pub(crate) struct Seen {
    devices: HashMap<String, Held>,
}

struct Held {
    device: WgDevice,
    /// The generation of the plan whose every peer the device holds as planned (`None`:
    /// not known, as after a read of the device).
    plan: Option<u64>,
}

impl Seen {
    /// `device` as just read from `name`: which plan it holds is not known.
    pub(crate) fn read(&mut self, name: &str, device: WgDevice) {
        self.put(name, device, None);
    }

    /// `device` as `name` holds it, with `plan` the generation of the plan it holds.
    pub(crate) fn put(&mut self, name: &str, device: WgDevice, plan: Option<u64>) {
        self.devices.insert(name.to_string(), Held { device, plan });
    }

    /// Takes `name` out (it is put back once the pass knows what the device holds), with
    /// the generation of the plan it holds.
    pub(crate) fn take(&mut self, name: &str) -> Option<(WgDevice, Option<u64>)> {
        self.devices.remove(name).map(|h| (h.device, h.plan))
    }

    /// Forgets `name`: the next pass reads it.
    pub(crate) fn forget(&mut self, name: &str) {
        self.devices.remove(name);
    }

    pub(crate) fn get(&self, name: &str) -> Option<&WgDevice> {
        self.devices.get(name).map(|h| &h.device)
    }

    /// Every peer of every device held.
    pub(crate) fn peers(&self) -> impl Iterator<Item = (&PublicKey, &WgPeer)> {
        self.devices.values().flat_map(|h| h.device.peers.iter())
    }
}

/// The peers of tunnel `tunnel` (its index in the plan) that a pass of `stamp`'s plan must
/// compare on a device holding plan `holds`: `None` for all of them, unless the plan was
/// patched from `holds`, when only the re-planned nodes' peers before and after can differ.
pub(crate) fn changed_peers(
    stamp: &PlanStamp<'_>,
    holds: Option<u64>,
    tunnel: usize,
) -> Option<BTreeSet<PublicKey>> {
    let (from, nodes) = stamp.patched?;
    if holds != Some(from) {
        return None;
    }
    let keys = nodes
        .iter()
        .flat_map(|n| n.before.iter().chain(&n.after))
        .filter(|(index, _)| *index == tunnel)
        .map(|(_, key)| *key)
        .collect();
    Some(keys)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::key;
    use crate::plan::PatchedNode;

    #[test]
    fn only_a_plan_patched_from_the_one_held_narrows_the_diff() {
        let nodes = [PatchedNode {
            node: "node-b".into(),
            before: vec![(0, key(2)), (1, key(3))],
            after: vec![(0, key(4))],
        }];
        let patched = PlanStamp {
            generation: Some(8),
            patched: Some((7, &nodes)),
        };
        assert_eq!(
            changed_peers(&patched, Some(7), 0),
            Some(BTreeSet::from([key(2), key(4)]))
        );
        assert_eq!(
            changed_peers(&patched, Some(7), 1),
            Some(BTreeSet::from([key(3)]))
        );
        assert_eq!(changed_peers(&patched, Some(6), 0), None, "an older plan");
        assert_eq!(changed_peers(&patched, None, 0), None, "a fresh read");
        let full = PlanStamp {
            generation: Some(8),
            patched: None,
        };
        assert_eq!(changed_peers(&full, Some(7), 0), None);
    }
}
