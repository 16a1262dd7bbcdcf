//! The guard of an encrypting backend (`plan::guard`): nftables tables `ip weft-guard`
//! and `ip6 weft-guard`, one prerouting chain each, ahead of routing:
//! - a packet out of a tunnel device is accepted here (it was decrypted and checked
//!   against its peer's AllowedIPs or inbound policy);
//! - one from this node's own pod subnet arriving on the underlay is dropped (it would be
//!   encrypted and delivered as if this node's pod had sent it);
//! - while the cluster changes backend, one from a pair in clear's pod subnet arriving on
//!   that pair's device (vxlan's, or the underlay for host-gw) is accepted;
//! - any other from the pod network but this node's subnet is dropped (a forged "pod" of
//!   another node, routed to a local pod).
//!
//! It goes in before any route of a pass, and a pass whose guard cannot be put in
//! installs no route (fail closed). The table `ip weft-ipsec` of earlier versions, the
//! ipsec backend's own guard, is removed.

use serde_json::{json, Value};

use super::nft::{addr_match, observed, replace_table, Nft};
use super::ApplyError;
use crate::model::{Family, GuardSpec, Match};

pub const TABLE: &str = "weft-guard";
/// The ipsec backend's guard table before the guard covered every encrypting backend.
pub const LEGACY_TABLE: &str = "weft-ipsec";
const CHAIN: &str = "guard";

fn iifname(op: &str, name: &str) -> Value {
    json!({"match": {"op": op, "left": {"meta": {"key": "iifname"}}, "right": name}})
}

/// The table's chain and rules for `spec`, in the form `nft -j list` prints them.
fn chains(spec: &GuardSpec) -> Vec<(Value, Vec<Vec<Value>>)> {
    let fam = spec.family;
    let chain = json!({"family": fam.nft(), "table": TABLE, "name": CHAIN, "type": "filter",
                       "hook": "prerouting", "prio": -160, "policy": "accept"});
    let mut rules: Vec<Vec<Value>> = spec
        .tunnels
        .iter()
        .map(|t| vec![iifname("==", t), json!({"accept": null})])
        .collect();
    if let (Some(own), Some(underlay)) = (spec.own, &spec.underlay) {
        rules.push(vec![
            iifname("==", underlay),
            addr_match(fam, "saddr", &Match::In(own)),
            json!({"drop": null}),
        ]);
    }
    // A pair in clear during a backend change: its pods from its own device alone.
    for (device, subnet) in &spec.clear {
        rules.push(vec![
            iifname("==", device),
            addr_match(fam, "saddr", &Match::In(*subnet)),
            json!({"accept": null}),
        ]);
    }
    let mut others = vec![addr_match(fam, "saddr", &Match::In(spec.network))];
    if let Some(own) = spec.own {
        others.push(addr_match(fam, "saddr", &Match::NotIn(own)));
    }
    others.push(json!({"drop": null}));
    rules.push(others);
    vec![(chain, rules)]
}

/// Makes the guard tables match `guard` (a family without a spec: its table removed), and
/// on `full` passes removes the legacy ipsec table. Returns the changes made.
pub(super) async fn reconcile_guard<N: Nft>(
    nft: &mut N,
    guard: &[GuardSpec],
    full: bool,
) -> Result<Vec<String>, ApplyError> {
    let mut changes = Vec::new();
    for family in [Family::Ipv4, Family::Ipv6] {
        let Some((what, batch)) = family_change(nft, guard, family).await? else {
            continue;
        };
        nft.apply(&what, batch).await?;
        changes.push(what);
    }
    if full && nft.list(Family::Ipv4, LEGACY_TABLE).await?.is_some() {
        let what = format!("delete nftables table ip {LEGACY_TABLE}");
        nft.apply(&what, delete(Family::Ipv4, LEGACY_TABLE)).await?;
        changes.push(what);
    }
    Ok(changes)
}

/// Whether the guard tables hold what `guard` plans, and no legacy table is left; reads
/// only (see `nft::tables_as_planned`).
pub(super) async fn as_planned<N: Nft>(
    nft: &mut N,
    guard: &[GuardSpec],
) -> Result<bool, ApplyError> {
    for family in [Family::Ipv4, Family::Ipv6] {
        if family_change(nft, guard, family).await?.is_some() {
            return Ok(false);
        }
    }
    Ok(nft.list(Family::Ipv4, LEGACY_TABLE).await?.is_none())
}

/// What `family`'s guard table needs to match `guard` (its description and batch), or
/// `None` if it does already.
async fn family_change<N: Nft>(
    nft: &mut N,
    guard: &[GuardSpec],
    family: Family,
) -> Result<Option<(String, Value)>, ApplyError> {
    let spec = guard.iter().find(|g| g.family == family);
    let have = nft.list(family, TABLE).await?;
    Ok(match (spec, have) {
        (Some(s), Some(listing)) if observed(&listing) == chains(s) => None,
        (Some(s), _) => Some((
            format!("replace nftables table {} {TABLE}", family.nft()),
            replace_table(family, TABLE, chains(s)),
        )),
        (None, Some(_)) => Some((
            format!("delete nftables table {} {TABLE}", family.nft()),
            delete(family, TABLE),
        )),
        (None, None) => None,
    })
}

fn delete(family: Family, table: &str) -> Value {
    json!({"nftables": [{"delete": {"table": {"family": family.nft(), "name": table}}}]})
}
