//! The ipsec backend's guard: nftables table `ip weft-ipsec`, one prerouting rule that drops
//! a packet from another node's pod subnet unless it came out of `flannel-ipsec` (so it was
//! decrypted and checked against an inbound policy). Without it, a forged clear packet from
//! a "pod" of another node would be routed like a real one: XFRM's inbound policies are
//! bound to the interface and say nothing about packets arriving elsewhere.

use serde_json::{json, Value};

use super::nft::{addr_match, observed, replace_table, Nft};
use super::ApplyError;
use crate::model::{Family, IpsecSpec, Match};

pub const TABLE: &str = "weft-ipsec";
const CHAIN: &str = "guard";

fn chains(spec: &IpsecSpec) -> Vec<(Value, Vec<Vec<Value>>)> {
    let fam = Family::Ipv4;
    let chain = json!({"family": fam.nft(), "table": TABLE, "name": CHAIN, "type": "filter",
                       "hook": "prerouting", "prio": -160, "policy": "accept"});
    let rule = vec![
        json!({"match": {"op": "!=", "left": {"meta": {"key": "iifname"}}, "right": spec.device}}),
        addr_match(fam, "saddr", &Match::In(spec.network)),
        addr_match(fam, "saddr", &Match::NotIn(spec.subnet)),
        json!({"drop": null}),
    ];
    vec![(chain, vec![rule])]
}

/// Makes the guard match `spec` (none: the table removed). Returns the change made.
pub(super) async fn reconcile_guard<N: Nft>(
    nft: &mut N,
    spec: Option<&IpsecSpec>,
) -> Result<Option<String>, ApplyError> {
    let have = nft.list(Family::Ipv4, TABLE).await?;
    let (what, batch) = match (spec, have) {
        (Some(s), Some(listing)) if observed(&listing) == chains(s) => return Ok(None),
        (Some(s), _) => (
            format!("replace nftables table ip {TABLE}"),
            replace_table(Family::Ipv4, TABLE, chains(s)),
        ),
        (None, Some(_)) => (
            format!("delete nftables table ip {TABLE}"),
            json!({"nftables": [{"delete": {"table": {"family": "ip", "name": TABLE}}}]}),
        ),
        (None, None) => return Ok(None),
    };
    nft.apply(&what, batch).await.map(|()| Some(what))
}
