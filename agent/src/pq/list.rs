//! The plan's post-quantum peers as the loop hands them to the task. At 10,000 peers a
//! copy of the list per plan, and a comparison of it with the last one on both sides, were
//! a tenth of a patched pass; the list is the plan's own (shared), and a plan patched from
//! the one before names the nodes it re-planned, so each side looks at theirs alone.

use std::sync::Arc;

use weft_backends::model::{DesiredState, PqPeer};
use weft_backends::plan::PlanStamp;

/// What the task is handed: a plan's `post_quantum`, and what changed in it.
#[derive(Debug, Clone, Default)]
pub struct PqList {
    plan: Arc<DesiredState>,
    /// The planner's generation of `plan` (`PlanStamp::generation`): the loop's own
    /// account of which plan the list is of.
    generation: Option<u64>,
    /// Counts the lists that differ from the one before (each wakes the task).
    pub(super) seq: u64,
    /// For a list patched from list `seq - 1`: that one's `seq` and the nodes whose
    /// entries may differ from it. `None`: compare every entry.
    pub(super) changed: Option<(u64, Vec<String>)>,
}

impl PqList {
    /// A list of `peers` alone (a plan of none else), to be compared in full.
    pub fn of(peers: Vec<PqPeer>) -> PqList {
        PqList {
            plan: Arc::new(DesiredState {
                post_quantum: peers,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    pub fn peers(&self) -> &[PqPeer] {
        &self.plan.post_quantum
    }

    /// Takes the pairs of `state`, stamped `stamp` by its planner; whether they differ
    /// from the list held (the task is woken only then). A plan patched from the one
    /// held is compared on its re-planned nodes alone.
    pub fn follow(&mut self, state: &Arc<DesiredState>, stamp: &PlanStamp<'_>) -> bool {
        let nodes = stamp
            .patched
            .filter(|(from, _)| self.generation == Some(*from))
            .map(|(_, nodes)| nodes);
        let differs = match nodes {
            _ if Arc::ptr_eq(&self.plan, state) => false,
            Some(nodes) => nodes
                .iter()
                .any(|n| run(self.peers(), &n.node) != run(&state.post_quantum, &n.node)),
            None => self.peers() != state.post_quantum.as_slice(),
        };
        if differs {
            self.changed = nodes.map(|n| (self.seq, n.iter().map(|n| n.node.clone()).collect()));
            self.seq += 1;
        }
        // Held even when equal: the next plan is patched from this one.
        self.plan = state.clone();
        self.generation = stamp.generation;
        differs
    }
}

/// The entries of `node` among `peers`, which are sorted by node (as a plan's are).
pub(super) fn run<'a>(peers: &'a [PqPeer], node: &str) -> &'a [PqPeer] {
    let at = peers.partition_point(|p| p.node.as_str() < node);
    let end = at + peers[at..].iter().take_while(|p| p.node == node).count();
    &peers[at..end]
}

#[cfg(test)]
mod tests {
    use weft_backends::model::PqKey;
    use weft_backends::plan::PatchedNode;
    use weft_crypto::PrivateKey;

    use super::*;

    fn peer(n: u8) -> PqPeer {
        PqPeer {
            node: format!("node-{n}"),
            public_key: PrivateKey::from_bytes([n; 32]).public_key(),
            address: [10, 244, n, 0].into(),
            underlay: [198, 51, 100, n].into(),
            ek: PqKey::None,
        }
    }

    fn plan(peers: Vec<PqPeer>) -> Arc<DesiredState> {
        Arc::new(DesiredState {
            post_quantum: peers,
            ..Default::default()
        })
    }

    fn stamp(generation: u64, nodes: &[PatchedNode]) -> PlanStamp<'_> {
        PlanStamp {
            generation: Some(generation),
            patched: (!nodes.is_empty()).then_some((generation - 1, nodes)),
        }
    }

    fn node(n: u8) -> PatchedNode {
        PatchedNode {
            node: format!("node-{n}"),
            ..Default::default()
        }
    }

    #[test]
    fn a_patched_plan_names_its_changed_nodes_and_an_equal_one_wakes_nothing() {
        let mut list = PqList::default();
        assert!(list.follow(&plan(vec![peer(1), peer(3)]), &stamp(1, &[])));
        assert_eq!((list.seq, list.changed.clone()), (1, None));
        // Node 2 joins.
        let joined = [node(2)];
        assert!(list.follow(&plan(vec![peer(1), peer(2), peer(3)]), &stamp(2, &joined)));
        assert_eq!(
            (list.seq, list.changed.clone()),
            (2, Some((1, vec!["node-2".into()])))
        );
        assert_eq!(list.peers().len(), 3);
        // Node 3's lease changes, not its pair: nothing to tell, but the plan is held,
        // so the next patch is compared on its nodes too.
        assert!(!list.follow(
            &plan(vec![peer(1), peer(2), peer(3)]),
            &stamp(3, &[node(3)])
        ));
        assert_eq!(list.seq, 2);
        let mut moved = peer(3);
        moved.underlay = [198, 51, 100, 99].into();
        let left = plan(vec![peer(2), moved]);
        assert!(list.follow(&left, &stamp(4, &[node(1), node(3)])));
        assert_eq!(
            list.changed,
            Some((2, vec!["node-1".into(), "node-3".into()]))
        );
        // Patched from a plan the list does not hold: compared in full.
        assert!(list.follow(&plan(vec![peer(2)]), &stamp(9, &[node(3)])));
        assert_eq!((list.seq, list.changed.clone()), (4, None));
        assert!(!list.follow(&plan(vec![peer(2)]), &stamp(11, &[node(2)])));
    }

    #[test]
    fn a_nodes_run_is_found_in_a_list_sorted_by_node() {
        let peers = [peer(1), peer(2), peer(2), peer(4)];
        assert_eq!(run(&peers, "node-2").len(), 2);
        assert_eq!(run(&peers, "node-3"), []);
        assert_eq!(run(&peers, "node-4"), [peer(4)]);
        assert_eq!(run(&[], "node-1"), []);
    }
}
