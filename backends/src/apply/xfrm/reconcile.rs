//! The ipsec reconciler: the XFRM interface `flannel-ipsec`, then per peer two ESP states
//! (keys derived here, never in the plan) and three policies, diffed against what the
//! kernel holds under weft's interface id. Level-triggered; zero writes when nothing
//! differs.
//!
//! No (key, SPI) pair is installed twice: every install is first recorded (`EspBook`,
//! persisted and synced); a state the plan wants whose fingerprint is already recorded was
//! installed before and is gone (deleted, flushed, a reboot), and installing it again
//! would reuse the key from sequence number 1. It is not installed: the outcome reports it
//! lost, the agent bumps its epoch and publishes it, and the plan after that wants new keys.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use ipnet::{IpNet, Ipv4Net};
use weft_crypto::esp::{install_fingerprint, Epoch};
use weft_crypto::PrivateKey;

use super::book::{EspBook, KeyCache};
use super::missing::{missing, Missing, Placement};
use super::{PolicyDir, PolicySpec, SaSpec, Xfrm};
use crate::apply::dataplane_ipsec::IpsecPlane;
use crate::apply::netlink::VxlanNetlink;
use crate::apply::ApplyError;
use crate::model::{EspSa, IpsecPeer, IpsecSpec};

/// What one ipsec pass found beyond its changes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct IpsecOutcome {
    /// The interface was created (its routes need another routing pass).
    pub created: bool,
    /// States installed once under this epoch and gone since, one line each: the epoch
    /// must be bumped before anything is installed again.
    pub lost: Vec<String>,
}

/// A planned state with the fingerprint recorded before it is installed, and the epoch
/// of this node its key belongs to (only the book's epoch is installed).
struct Wanted {
    sa: SaSpec,
    fingerprint: String,
    local_epoch: Epoch,
    /// The peer the state is for.
    node: String,
}

fn any() -> Ipv4Net {
    Ipv4Net::default()
}

fn v4(net: IpNet) -> Option<Ipv4Net> {
    match net {
        IpNet::V4(n) => Some(n),
        IpNet::V6(_) => None,
    }
}

/// A peer's states (outbound, then inbound), keys derived from this node's private key.
fn peer_states(
    spec: &IpsecSpec,
    p: &IpsecPeer,
    key: &PrivateKey,
    cache: &mut KeyCache,
) -> Result<Vec<Wanted>, String> {
    let alg = spec.algorithm;
    let reqid = pair_reqid(spec, p)?;
    let mut keys = |sa: &EspSa| {
        cache
            .pair(key, spec, &p.public_key, sa)
            .map_err(|e| format!("node {}: no ESP keys: {e}", p.node))
    };
    let wanted = |sa: &EspSa, src, dst, key: &weft_crypto::esp::SaKey| Wanted {
        fingerprint: install_fingerprint(key),
        local_epoch: sa.local_epoch,
        node: p.node.clone(),
        sa: SaSpec {
            src,
            dst,
            spi: sa.spi,
            algorithm: alg.kernel_name().to_string(),
            key: super::EspKey::new(key.as_bytes()),
            icv_bits: alg.icv_bits(),
            udp_encap: spec.udp_encap,
            if_id: spec.if_id,
            reqid,
        },
    };
    let out = &p.outbound;
    let mut states = vec![wanted(out, spec.local, p.remote, &keys(out)?.outbound)];
    for sa in &p.inbound {
        states.push(wanted(sa, p.remote, spec.local, &keys(sa)?.inbound));
    }
    Ok(states)
}

/// The reqid of this node's pair with `p` (its states and policies all carry it).
fn pair_reqid(spec: &IpsecSpec, p: &IpsecPeer) -> Result<u32, String> {
    crate::plan::ipsec::reqid(spec.network, p.subnet).ok_or_else(|| {
        format!(
            "node {}: its subnet {} has no place in the network {}",
            p.node, p.subnet, spec.network
        )
    })
}

fn peer_policies(spec: &IpsecSpec, p: &IpsecPeer) -> Option<[PolicySpec; 3]> {
    let subnet = v4(p.subnet)?;
    let reqid = pair_reqid(spec, p).ok()?;
    let inbound = |dir| PolicySpec {
        dir,
        src: subnet,
        dst: any(),
        tmpl_src: p.remote,
        tmpl_dst: spec.local,
        if_id: spec.if_id,
        reqid,
    };
    Some([
        PolicySpec {
            dir: PolicyDir::Out,
            src: any(),
            dst: subnet,
            tmpl_src: spec.local,
            tmpl_dst: p.remote,
            if_id: spec.if_id,
            reqid,
        },
        inbound(PolicyDir::In),
        inbound(PolicyDir::Fwd),
    ])
}

/// Brings the XFRM interface, states and policies in line with `spec`; without a spec
/// and with `sweep` (full passes), removes what weft made for ipsec.
pub async fn reconcile_ipsec<N: VxlanNetlink, X: Xfrm>(
    nl: &mut N,
    plane: &mut IpsecPlane<X>,
    spec: Option<&IpsecSpec>,
    key: &PrivateKey,
    sweep: bool,
    changes: &mut Vec<String>,
    errors: &mut Vec<String>,
) -> Result<IpsecOutcome, ApplyError> {
    let if_id = crate::plan::ipsec::IF_ID;
    let IpsecPlane {
        xfrm, book, memory, ..
    } = plane;
    let Some(spec) = spec else {
        if sweep {
            super::super::ipsec_link::remove(nl, changes).await?;
            remove_all(xfrm, if_id, changes)?;
        }
        return Ok(IpsecOutcome::default());
    };
    let created = super::super::ipsec_link::ensure(nl, spec, changes).await?;
    let mut wanted = Vec::new();
    let mut policies = BTreeMap::new();
    memory
        .keys
        .salted_with(spec.psk.as_ref().map(|k| k.0.as_slice()));
    for p in &spec.peers {
        match peer_states(spec, p, key, &mut memory.keys) {
            Ok(states) => wanted.extend(states),
            Err(e) => {
                errors.push(e);
                continue;
            }
        }
        for policy in peer_policies(spec, p).into_iter().flatten() {
            policies.insert((policy.dir, policy.src, policy.dst), policy);
        }
    }
    memory.keys.sweep();
    let mut log = Log { changes, errors };
    let lost = states(xfrm, book, memory, (if_id, spec.local), wanted, &mut log)?;
    self::policies(xfrm, if_id, &policies, &mut log)?;
    Ok(IpsecOutcome { created, lost })
}

/// What the reconciler keeps of the kernel's states between passes.
#[derive(Debug)]
pub struct StateMemory {
    /// Each pair's keys.
    keys: KeyCache,
    /// weft's states as the last pass read them (for `/metrics`).
    pub seen: Vec<super::ObservedSa>,
    /// Inbound states no longer planned, and since when: kept for `grace`, as a peer may
    /// still send with them for a moment after a switch.
    retiring: HashMap<(Ipv4Addr, u32), Instant>,
    pub grace: Duration,
    /// The planned states that stood after the last pass, by fingerprint (`None` before
    /// the first pass): what `missing` judges a recorded key by.
    standing: Option<HashMap<String, Placement>>,
}

impl Default for StateMemory {
    fn default() -> Self {
        StateMemory {
            keys: KeyCache::default(),
            seen: Vec::new(),
            retiring: HashMap::new(),
            grace: RETIRE_GRACE,
            standing: None,
        }
    }
}

/// How long a state outlives the plan that dropped it.
pub const RETIRE_GRACE: Duration = Duration::from_secs(2);

/// Where a pass writes what it changed and what it could not: one object's failure is
/// an error line, and the pass goes on with the others.
struct Log<'a> {
    changes: &'a mut Vec<String>,
    errors: &'a mut Vec<String>,
}

impl Log<'_> {
    /// Records `done` as a change if `result` is Ok, else the error; whether it was Ok.
    fn write(&mut self, result: Result<(), ApplyError>, done: impl FnOnce() -> String) -> bool {
        match result {
            Ok(()) => {
                self.changes.push(done());
                true
            }
            Err(e) => {
                self.errors.push(e.to_string());
                false
            }
        }
    }
}

/// The states: missing ones installed (recorded first) unless installed before, stale ones
/// retired (`retire`). Returns the lost ones. A state the kernel
/// refuses is an error of its own: the others are installed and removed all the same,
/// and its key, never installed, is not counted as installed.
fn states<X: Xfrm>(
    xfrm: &mut X,
    book: &mut EspBook,
    memory: &mut StateMemory,
    (if_id, local): (u32, Ipv4Addr),
    wanted: Vec<Wanted>,
    log: &mut Log<'_>,
) -> Result<Vec<String>, ApplyError> {
    let observed = xfrm.states(if_id)?;
    memory.seen.clone_from(&observed);
    let mut have: BTreeMap<(Ipv4Addr, u32), &SaSpec> = observed
        .iter()
        .map(|o| ((o.spec.dst, o.spec.spi), &o.spec))
        .collect();
    let mut install = Vec::new();
    let mut lost = Vec::new();
    let mut standing = HashMap::new();
    let mut outbound = Outbound::default();
    for w in wanted {
        if w.sa.src == local {
            outbound.planned.insert(w.sa.reqid);
        }
        match have.remove(&(w.sa.dst, w.sa.spi)) {
            Some(present) if *present == w.sa => {
                outbound.stands(&w.sa, local);
                standing.insert(w.fingerprint, Placement::of(&w.sa));
                continue;
            }
            Some(present) => {
                let removed = xfrm.delete_state(present);
                if !log.write(removed, || {
                    format!("removed {present:?}: it differs from the plan")
                }) {
                    continue;
                }
            }
            None => {}
        }
        if !book.installs(&w.local_epoch) {
            // A key of an epoch before a bump (or of one a restart left): never installed
            // again; its successor's states stand beside it.
            continue;
        }
        if !book.installed.contains(&w.fingerprint) {
            install.push(w);
            continue;
        }
        let standing = memory.standing.as_ref();
        match missing(standing, &w.fingerprint, &w.sa, &w.node, local) {
            Missing::Lost(why) => lost.push(why),
            Missing::Refused(why) => log.errors.push(why),
        }
    }
    if memory.standing.is_none() && observed.is_empty() && !book.installed.is_empty() {
        // A reboot, or a state directory restored from a backup: the record may lack
        // keys installed since it was written, so its epoch is not used further.
        lost.push(format!(
            "the kernel holds none of this node's ESP states while its record names {}: a reboot or a restored state directory",
            book.installed.len()
        ));
    }
    if lost.is_empty() {
        let fingerprints: Vec<String> = install.iter().map(|w| w.fingerprint.clone()).collect();
        book.record(&fingerprints).map_err(|e| ApplyError::Io {
            op: "recording the ESP states about to be installed".into(),
            source: std::io::Error::other(e.to_string()),
        })?;
        for w in install {
            if log.write(xfrm.add_state(&w.sa), || format!("added {:?}", w.sa)) {
                outbound.stands(&w.sa, local);
                standing.insert(w.fingerprint, Placement::of(&w.sa));
            } else {
                book.installed.remove(&w.fingerprint);
            }
        }
        // While a loss stands the agent starts a new epoch: until then it is reported again.
        memory.standing = Some(standing);
    }
    retire(xfrm, memory, have, &outbound, local, log);
    Ok(lost)
}

/// The states the plan left (`stale`): an outbound one as soon as its successor stands
/// (`Outbound`), the others once they have been left for the grace.
fn retire<X: Xfrm>(
    xfrm: &mut X,
    memory: &mut StateMemory,
    stale: BTreeMap<(Ipv4Addr, u32), &SaSpec>,
    outbound: &Outbound,
    local: Ipv4Addr,
    log: &mut Log<'_>,
) {
    let now = Instant::now();
    memory.retiring.retain(|k, _| stale.contains_key(k));
    for (k, stale) in stale {
        if stale.src == local {
            match outbound.after(stale.reqid) {
                Superseded::Now => {
                    memory.retiring.remove(&k);
                    log.write(xfrm.delete_state(stale), || {
                        format!("removed {stale:?}: the pair's planned outbound state stands")
                    });
                    continue;
                }
                Superseded::NotYet => continue,
                Superseded::PairGone => {}
            }
        }
        // Inbound: a peer may still send on it for a moment after a switch.
        let since = *memory.retiring.entry(k).or_insert(now);
        if now.duration_since(since) < memory.grace {
            continue;
        }
        memory.retiring.remove(&k);
        log.write(xfrm.delete_state(stale), || {
            format!("removed {stale:?}: not in the plan")
        });
    }
}

/// The outbound states of a pass: the pairs that plan one, and those whose planned one
/// stands in the kernel after it.
///
/// The kernel sends a pair's traffic with the newest valid state of its reqid, by
/// `add_time`, which it keeps in whole seconds: of two added within one second it takes
/// the first in its hash chain, and a resize of the table reverses the chains. So an
/// outbound state the plan has left does not stay beside its successor: if it did, the
/// kernel could go back to it, and its SPI may by then carry another key at the peer (a
/// post-quantum slot taken again). It goes in the pass its successor stands. Until that
/// one stands (refused, or not installed while a loss stands) it is the pair's only way
/// out and stays; a pair no longer planned retires it like an inbound state.
#[derive(Default)]
struct Outbound {
    planned: HashSet<u32>,
    standing: HashSet<u32>,
}

/// What becomes of an outbound state the plan left.
enum Superseded {
    /// Its successor stands: removed in this pass.
    Now,
    /// Its successor does not stand yet: kept.
    NotYet,
    /// Its pair is not planned: retired after the grace.
    PairGone,
}

impl Outbound {
    fn stands(&mut self, sa: &SaSpec, local: Ipv4Addr) {
        if sa.src == local {
            self.standing.insert(sa.reqid);
        }
    }

    fn after(&self, reqid: u32) -> Superseded {
        if self.standing.contains(&reqid) {
            Superseded::Now
        } else if self.planned.contains(&reqid) {
            Superseded::NotYet
        } else {
            Superseded::PairGone
        }
    }
}

fn policies<X: Xfrm>(
    xfrm: &mut X,
    if_id: u32,
    wanted: &BTreeMap<(PolicyDir, Ipv4Net, Ipv4Net), PolicySpec>,
    log: &mut Log<'_>,
) -> Result<(), ApplyError> {
    let observed = xfrm.policies(if_id)?;
    let mut have: BTreeMap<_, PolicySpec> = observed
        .into_iter()
        .map(|p| ((p.dir, p.src, p.dst), p))
        .collect();
    for (k, want) in wanted {
        if have.remove(k).as_ref() == Some(want) {
            continue;
        }
        log.write(xfrm.put_policy(want), || format!("put {want}"));
    }
    for stale in have.values() {
        log.write(xfrm.delete_policy(stale), || {
            format!("removed {stale}: not in the plan")
        });
    }
    Ok(())
}

/// Every state and policy with weft's interface id.
pub(crate) fn remove_all<X: Xfrm>(
    xfrm: &mut X,
    if_id: u32,
    changes: &mut Vec<String>,
) -> Result<(), ApplyError> {
    for sa in xfrm.states(if_id)? {
        xfrm.delete_state(&sa.spec)?;
        changes.push(format!("removed {:?}: not in the plan", sa.spec));
    }
    for p in xfrm.policies(if_id)? {
        xfrm.delete_policy(&p)?;
        changes.push(format!("removed {p}: not in the plan"));
    }
    Ok(())
}
