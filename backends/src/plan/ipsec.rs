//! The ipsec backend's share of the plan: the XFRM interface `flannel-ipsec` carrying the
//! whole pod network (the covering route and the fail-closed blackhole, as WireGuard), one
//! route per peer subnet into it, and per peer what its two ESP SAs need: both public keys,
//! both epochs, both tunnel ends and the two SPIs. IPv4 only (the config refuses IPv6).
//!
//! SPIs are unique per receiving node without randomness: the SA a node receives on from
//! a peer has the SPI `1 << 31 | index << 8 | generation`, where `index` is the peer's
//! subnet's place in the Network (unique among the receiver's peers) and `generation` the
//! low byte of the sender's epoch number plus twice the receiver's plus four times the
//! post-quantum slot (`ipsec_pq`), so the SAs that stand beside it while either node (or
//! both) moves to its next epoch, or the pair to its next post-quantum PSK, have other
//! SPIs. A classical pair (slot 0) has the SPIs it always had.
//!
//! A rotation announces a node's next epoch with a moment (`NextEpoch`, `NextNonce`,
//! `SwitchAt`). Until the moment its peers and it receive on the states of both epochs
//! (staged ahead); from the moment on both send with the next one. The plan changes at the
//! moment, so it names it in `next_switch`.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::{Duration, SystemTime};

use ipnet::IpNet;
use weft_crypto::esp::Epoch;
use weft_crypto::PublicKey;

pub use super::ipsec_data::{backend_data, rotating_backend_data, IpsecData, NextEpoch};
use super::ipsec_pq::{self, Slots};
use super::peers::{Candidate, Screened};
use super::{subnet_env, LocalSubnets, PlanError, PlanInput};
use crate::model::net::to_u128;
use crate::model::{
    DesiredState, EspSa, Family, IpsecPeer, IpsecSpec, LeaveReason, LeftOut, RouteRole, RouteSpec,
};
use crate::netconf::IpsecConf;

/// The XFRM interface.
pub const DEVICE: &str = "flannel-ipsec";
/// Its interface id: every SA and policy weft installs carries it, which is how weft tells
/// its own from others'.
pub const IF_ID: u32 = 0x7765_6674;
/// Outer IPv4 header 20, ESP header 8, IV 8, ICV 16, trailer 2 and up to 3 of padding,
/// rounded up to a multiple of 4.
pub(super) const ESP_OVERHEAD: u32 = 60;
/// ESP in UDP adds the UDP header.
pub(super) const UDP_ENCAP_OVERHEAD: u32 = 8;

/// The low byte of the sender's epoch number plus twice the receiver's plus four times
/// the post-quantum `slot` (0 classical, 1 or 2): the same on both nodes for one
/// direction, and different for each of the (at most twelve) combinations of two
/// consecutive epochs on each side and two slots in a row that stand together.
pub fn generation(sender: &Epoch, receiver: &Epoch, slot: u8) -> u8 {
    (sender
        .number
        .wrapping_add(receiver.number.wrapping_mul(2))
        .wrapping_add(u64::from(slot) * 4)
        & 0xff) as u8
}

/// `subnet`'s place in `network` (unique among the subnets of one length), if it lies
/// inside and its index fits in 23 bits.
fn subnet_index(network: IpNet, subnet: IpNet) -> Option<u32> {
    if !network.contains(&subnet) {
        return None;
    }
    let shift = u32::from(subnet.max_prefix_len() - subnet.prefix_len());
    let offset = to_u128(subnet.network()).checked_sub(to_u128(network.network()))?;
    u32::try_from(offset >> shift).ok().filter(|i| *i < 1 << 23)
}

/// The SPI of the SA carrying what the holder of `sender` sends (see the module doc);
/// `None` when the subnet lies outside the network or its index does not fit in 23 bits.
pub fn spi(network: IpNet, sender: IpNet, generation: u8) -> Option<u32> {
    let index = subnet_index(network, sender)?;
    Some(1 << 31 | index << 8 | u32::from(generation))
}

/// The reqid every state and policy of this node's pair with the holder of `peer` carries:
/// the kernel matches a policy's template only with states of the same reqid, so one
/// pair's policy can never pick, or accept, another pair's state (even one between the
/// same two addresses). Local to this node; unique among its peers, never 0.
pub fn reqid(network: IpNet, peer: IpNet) -> Option<u32> {
    subnet_index(network, peer).map(|i| i + 1)
}

pub(crate) fn plan(
    input: &PlanInput<'_>,
    ours: &LocalSubnets,
    conf: &IpsecConf,
    screened: Screened<'_>,
) -> Result<DesiredState, PlanError> {
    let node = || input.local.node.clone();
    let local = input
        .local
        .public_ip
        .ok_or_else(|| PlanError::LocalNoPublicIp {
            node: node(),
            family: "IPv4",
            flag: "",
        })?;
    let own = IpsecData::decode(input.local.backend_data.as_ref()).map_err(|detail| {
        PlanError::LocalBackendData {
            node: node(),
            detail,
        }
    })?;
    let (Some(subnet), Some(network)) = (ours.v4, input.config.ipv4.map(|n| n.network)) else {
        return Err(PlanError::LocalNoSubnet {
            node: node(),
            family: Family::Ipv4,
        });
    };
    let overhead = ESP_OVERHEAD
        + if conf.udp_encap {
            UDP_ENCAP_OVERHEAD
        } else {
            0
        };
    let mtu = conf
        .mtu
        .unwrap_or(input.options.underlay_mtu)
        .saturating_sub(overhead);
    let Screened {
        candidates,
        mut left_out,
    } = screened;
    let mut state = DesiredState::default();
    let mut holders = Holders {
        keys: BTreeMap::new(),
        ips: BTreeMap::new(),
    };
    let mut peers = Vec::new();
    let now = input.now;
    let ends = Ends {
        subnet,
        network,
        local,
        now,
        heard: &input.observed.esp_heard,
        secrets: input.pair_psks,
        post_quantum: conf.post_quantum,
    };
    state.next_switch = own.upcoming(now);
    holders.keys = contested_keys(&candidates);
    for c in &candidates {
        match peer(c, &own, &ends, &holders) {
            Ok((p, upcoming)) => {
                holders.keys.insert(p.public_key, &c.lease.node);
                holders.ips.insert(p.remote, &c.lease.node);
                if let Some(t) = upcoming {
                    state.next_switch = Some(state.next_switch.map_or(t, |n| n.min(t)));
                }
                if p.outbound.local_epoch != own.effective(now) {
                    // Waiting for the peer's evidence: the agent reads the counters.
                    state.esp_watch = true;
                }
                peers.push(p);
            }
            Err(reason) => left_out.push(LeftOut {
                node: c.lease.node.clone(),
                reason,
            }),
        }
    }
    peers.sort_by(|a, b| a.node.cmp(&b.node));
    into_device(&mut state, &peers, network);
    state.ipsec = Some(IpsecSpec {
        device: DEVICE.into(),
        if_id: IF_ID,
        underlay_device: input.options.underlay_device.clone(),
        mtu,
        addresses: vec![IpNet::new(subnet.network(), 32).unwrap_or(subnet)],
        local,
        epoch: own.effective(now),
        algorithm: conf.algorithm,
        psk: conf.psk.clone(),
        udp_encap: conf.udp_encap,
        subnet,
        network,
        peers,
    });
    state.left_out = left_out;
    state.subnet_env = subnet_env(input.config, ours, mtu, input.options.ip_masq);
    Ok(state)
}

/// The owner of each key several candidates publish: the one that proves holding it, or
/// the oldest (`peers::contested_keys`). Any other claimant is left out.
fn contested_keys<'a>(candidates: &[Candidate<'a>]) -> BTreeMap<PublicKey, &'a str> {
    super::peers::contested_keys(candidates, |c| {
        IpsecData::decode(c.lease.backend_data.as_ref())
            .ok()
            .map(|d| d.public_key)
    })
}

/// This node's side of every pair.
struct Ends<'a> {
    subnet: IpNet,
    network: IpNet,
    local: Ipv4Addr,
    now: SystemTime,
    /// Inbound SPIs that have carried packets (`Observed::esp_heard`).
    heard: &'a std::collections::BTreeSet<u32>,
    /// Each pair's post-quantum PSK in force, used with `PostQuantum` only.
    secrets: &'a BTreeMap<PublicKey, crate::model::PairSecret>,
    post_quantum: bool,
}

/// The public keys and public IPs of the peers kept so far, and their nodes.
struct Holders<'a> {
    keys: BTreeMap<PublicKey, &'a str>,
    ips: BTreeMap<Ipv4Addr, &'a str>,
}

/// One peer (with its announced moment, if ahead), or why it is left out. Candidates come
/// oldest first, so a key or public IP already in `holders` belongs to an older entry,
/// which keeps it: the tunnel ends of a pair are its public IPs, so a second node at one
/// would have its SAs chosen for the first one's pods.
fn peer(
    c: &Candidate<'_>,
    own: &IpsecData,
    ends: &Ends<'_>,
    holders: &Holders<'_>,
) -> Result<(IpsecPeer, Option<SystemTime>), LeaveReason> {
    let lease = c.lease;
    let data = IpsecData::decode(lease.backend_data.as_ref()).map_err(|detail| {
        LeaveReason::BadBackendData {
            field: "backend-data",
            detail,
        }
    })?;
    if data.public_key == own.public_key {
        return Err(LeaveReason::KeyIsOurs {
            key: data.public_key,
        });
    }
    if let Some(other) = holders
        .keys
        .get(&data.public_key)
        .filter(|owner| **owner != lease.node)
    {
        return Err(LeaveReason::DuplicateKey {
            key: data.public_key,
            other: other.to_string(),
        });
    }
    let remote = lease.public_ip.ok_or(LeaveReason::NoPublicIp {
        family: Family::Ipv4,
    })?;
    if remote == ends.local {
        return Err(LeaveReason::PublicIpIsOurs { ip: remote.into() });
    }
    if let Some(other) = holders.ips.get(&remote) {
        return Err(LeaveReason::DuplicatePublicIp {
            ip: remote.into(),
            other: other.to_string(),
        });
    }
    let peer_subnet = c.v4.ok_or(LeaveReason::NoSubnet)?;
    let outside = || LeaveReason::SubnetOutsideNetwork {
        subnet: peer_subnet,
        network: ends.network,
    };
    let secret = ends
        .secrets
        .get(&data.public_key)
        .filter(|_| ends.post_quantum);
    let slots = Slots::new(secret, ends.now);
    let mut inbound = Vec::new();
    for pq in slots.receiving() {
        for p in data.epochs(ends.now) {
            for m in own.epochs(ends.now) {
                let g = generation(&p, &m, ipsec_pq::slot(pq));
                inbound.push(EspSa {
                    spi: spi(ends.network, peer_subnet, g).ok_or_else(outside)?,
                    local_epoch: m,
                    peer_epoch: p,
                    pq: pq.clone(),
                });
            }
        }
    }
    let (mine, waiting) = sending_epoch(own, &inbound, ends);
    let (pq, pq_waiting) = slots.sending(ends.now);
    let theirs = data.effective(ends.now);
    let g = generation(&mine, &theirs, ipsec_pq::slot(&pq));
    let outbound = EspSa {
        spi: spi(ends.network, ends.subnet, g).ok_or_else(outside)?,
        local_epoch: mine,
        peer_epoch: theirs,
        pq,
    };
    let mut spis: Vec<u32> = inbound.iter().map(|sa| sa.spi).collect();
    spis.sort_unstable();
    if let Some(w) = spis.windows(2).find(|w| w[0] == w[1]) {
        return Err(LeaveReason::SpiCollision { spi: w[0] });
    }
    let p = IpsecPeer {
        node: lease.node.clone(),
        public_key: data.public_key,
        remote,
        subnet: peer_subnet,
        outbound,
        inbound,
    };
    let upcoming = [data.upcoming(ends.now), waiting, pq_waiting]
        .into_iter()
        .flatten()
        .min();
    Ok((p, upcoming))
}

/// How long after this node's announced moment it waits at most for a peer's evidence
/// (`sending_epoch`) before sending to it with the next epoch anyway (a peer that sends
/// nothing gives none). Well inside `SETTLE`, while the peer still receives on the epoch
/// left.
pub const CONFIRM_GRACE: Duration = Duration::from_secs(2);

/// The epoch this node sends to a peer with: from its announced moment on, the next one —
/// once the peer has shown it holds the next epoch's states, by sending on one of them
/// (a packet counted on an inbound state of the next epoch: the peer installs its inbound
/// states for an epoch in the pass that starts its sending with it, or earlier). Until
/// then, and at most `CONFIRM_GRACE`, the epoch being left, which the peer still receives
/// on while the announcement stands; the grace's end is returned (the plan changes then).
/// So a peer that learned of the rotation late, or whose agent is slow, loses nothing.
fn sending_epoch(own: &IpsecData, inbound: &[EspSa], ends: &Ends) -> (Epoch, Option<SystemTime>) {
    let effective = own.effective(ends.now);
    let Some(next) = own.next.filter(|n| n.epoch == effective) else {
        return (effective, None);
    };
    let until = next.switch_at + CONFIRM_GRACE;
    let heard = inbound
        .iter()
        .any(|sa| sa.local_epoch == next.epoch && ends.heard.contains(&sa.spi));
    if heard || ends.now >= until {
        (next.epoch, None)
    } else {
        (own.epoch, Some(until))
    }
}

/// A route per peer subnet into `flannel-ipsec`, the covering route for the pod network,
/// and its fail-closed blackhole.
fn into_device(state: &mut DesiredState, peers: &[IpsecPeer], network: IpNet) {
    for p in peers {
        state.routes.push(RouteSpec {
            dst: p.subnet,
            device: DEVICE.into(),
            via: Default::default(),
            onlink: false,
            role: RouteRole::Peer(p.node.clone()),
            mtu: None,
        });
    }
    state.routes.push(RouteSpec {
        dst: network,
        device: DEVICE.into(),
        via: Default::default(),
        onlink: false,
        role: RouteRole::Covering,
        mtu: None,
    });
    state.fail_closed.push(network);
}
