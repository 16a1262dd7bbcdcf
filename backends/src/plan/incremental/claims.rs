//! What the nodes of a plan claim that another node could contend for: pod subnets and
//! WireGuard keys. A full plan notes every claim (before duplicates are left out, since a
//! claim that lost still takes part); the incremental planner keeps them indexed, so it
//! can tell in a few lookups whether a changed node contends with anyone.

use std::collections::{BTreeMap, HashMap};

use ipnet::IpNet;
use weft_crypto::PublicKey;

use crate::model::net::to_u128;

/// Claims noted by a full plan (`plan::plan_noting`).
#[derive(Debug, Default)]
pub(crate) struct Claims {
    /// Every candidate's usable subnets (IPv4, IPv6), before duplicate subnets were left
    /// out.
    pub subnets: Vec<(String, Option<IpNet>, Option<IpNet>)>,
    /// Per tunnel device, in the plan's order: each entry's key and node (a staged next
    /// key under its node's name), before duplicate keys were left out.
    pub keys: Vec<Vec<(PublicKey, String)>>,
}

/// One family's claimed subnets as address intervals, to find overlaps.
#[derive(Debug, Default, Clone)]
pub(super) struct SubnetIndex {
    /// By (first address, node): the last address.
    spans: BTreeMap<(u128, String), u128>,
    /// The widest span ever held (never shrinks: a search looks back this far).
    widest: u128,
}

impl SubnetIndex {
    pub(super) fn insert(&mut self, node: &str, net: IpNet) {
        let (start, end) = span(net);
        self.widest = self.widest.max(end - start);
        self.spans.insert((start, node.to_string()), end);
    }

    pub(super) fn remove(&mut self, node: &str, net: IpNet) {
        self.spans.remove(&(span(net).0, node.to_string()));
    }

    /// Whether a node other than `node` claims a subnet overlapping `net`.
    pub(super) fn contended(&self, node: &str, net: IpNet) -> bool {
        let (start, end) = span(net);
        let from = (start.saturating_sub(self.widest), String::new());
        self.spans
            .range(from..)
            .take_while(|((s, _), _)| *s <= end)
            .any(|((_, other), e)| *e >= start && other != node)
    }
}

fn span(net: IpNet) -> (u128, u128) {
    (to_u128(net.network()), to_u128(net.broadcast()))
}

/// One tunnel device's claimed keys: who claims each.
#[derive(Debug, Default, Clone)]
pub(super) struct KeyIndex {
    claims: HashMap<PublicKey, Vec<String>>,
}

impl KeyIndex {
    pub(super) fn insert(&mut self, key: PublicKey, node: &str) {
        self.claims.entry(key).or_default().push(node.to_string());
    }

    pub(super) fn remove(&mut self, key: &PublicKey, node: &str) {
        if let Some(nodes) = self.claims.get_mut(key) {
            if let Some(i) = nodes.iter().position(|n| n == node) {
                nodes.swap_remove(i);
            }
            if nodes.is_empty() {
                self.claims.remove(key);
            }
        }
    }

    /// Whether a node other than `node` claims `key`.
    pub(super) fn contended(&self, key: &PublicKey, node: &str) -> bool {
        self.claims
            .get(key)
            .is_some_and(|nodes| nodes.iter().any(|n| n != node))
    }

    /// The nodes claiming `key`.
    pub(super) fn claimants(&self, key: &PublicKey) -> &[String] {
        self.claims.get(key).map_or(&[], Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn a_subnet_is_contended_by_another_node_overlapping_it_not_by_its_own_claim() {
        let mut index = SubnetIndex::default();
        index.insert("a", net("10.244.1.0/24"));
        index.insert("b", net("10.244.3.0/24"));
        assert!(!index.contended("a", net("10.244.1.0/24")));
        assert!(index.contended("c", net("10.244.1.0/24")));
        assert!(!index.contended("c", net("10.244.2.0/24")));
        // A wide claim covers narrower ones further on, and is found from them.
        index.insert("wide", net("10.240.0.0/12"));
        assert!(index.contended("c", net("10.250.0.0/24")));
        index.remove("wide", net("10.240.0.0/12"));
        assert!(!index.contended("c", net("10.250.0.0/24")));
        assert!(index.contended("c", net("10.244.0.0/16")), "covers a and b");
    }

    #[test]
    fn a_key_is_contended_while_another_node_claims_it() {
        let mut index = KeyIndex::default();
        let key = crate::model::fixtures::key(7);
        index.insert(key, "a");
        assert!(!index.contended(&key, "a"));
        assert!(index.contended(&key, "b"));
        index.insert(key, "b");
        index.remove(&key, "a");
        assert_eq!(index.claimants(&key), ["b".to_string()]);
        index.remove(&key, "b");
        assert!(!index.contended(&key, "c"));
    }
}
