//! A peer's announced key rotation in the wireguard plan: the next key staged beside the
//! current one (no AllowedIPs) until its first handshake on this device or its moment plus
//! `SWITCH_GRACE`, then switched; what the agent must watch for meanwhile (`KeyWatch`).

use weft_crypto::PublicKey;

use super::PlanInput;
use crate::model::{DesiredState, KeyMove, KeyWatch, Lease, PeerSpec, SEEN_LEAD, SWITCH_GRACE};
use crate::netconf::WireguardConf;

/// What `state` notes of peer `p`'s rotation on `device`; the staged entry to add, if any.
pub(super) fn follow_switch(
    state: &mut DesiredState,
    device: &str,
    p: &PeerSpec,
    switch: Switch,
    now: std::time::SystemTime,
) -> Option<PeerSpec> {
    match switch {
        Switch::None | Switch::Now { on_clock: false } => None,
        Switch::Now { on_clock: true } => {
            state.switched_on_clock.push(p.public_key);
            None
        }
        Switch::Staged(staged) => {
            let Staged {
                entry,
                at,
                announced,
            } = *staged;
            // The clock switches it at `at` at the latest; its first handshake switches
            // it earlier, so the agent watches for that.
            state.next_switch = Some(state.next_switch.map_or(at, |n| n.min(at)));
            let moved = KeyMove {
                device: device.to_string(),
                next: PeerSpec {
                    public_key: entry.public_key,
                    psk: entry.psk.clone(),
                    ..p.clone()
                },
                current: p.public_key,
                announced,
            };
            KeyWatch::merge(&mut state.key_watch, moved, announced, at, now);
            Some(entry)
        }
    }
}

/// What a peer's announced rotation makes of its entry.
pub(super) enum Switch {
    /// Nothing announced (or nothing usable): the entry as it is.
    None,
    /// The next key took over: by the clock, or on its handshake.
    Now { on_clock: bool },
    /// The next key staged beside the current one.
    Staged(Box<Staged>),
}

/// A peer's next key, staged beside its current one.
pub(super) struct Staged {
    /// The entry: the next key, no AllowedIPs.
    entry: PeerSpec,
    /// When this node's clock switches to it at the latest.
    at: std::time::SystemTime,
    /// The moment the rotating node announced.
    announced: std::time::SystemTime,
}

/// `p` as the peer's announced rotation makes it now: switched to the next key once that
/// key is in use (it has handshaken on our device) or `SWITCH_GRACE` after its announced
/// moment (by this node's clock, and not before `SEEN_LEAD` after it first saw the
/// announcement), whichever comes first; before that, with the next key staged beside it
/// (returned second). Switching on the handshake rather than on the clock means no packet
/// goes to a key not yet in use. A switch by the clock is noted in
/// `DesiredState::switched_on_clock`.
///
/// The next key's entry has the PSK of the pair with that key: a post-quantum PSK is one
/// pair's, made with the peer's key of its round, so the new key starts classical (the
/// cluster's PSK, if any) until a round with it completes, on both sides alike.
pub(super) fn rotated(
    mut p: PeerSpec,
    lease: &Lease,
    own_key: PublicKey,
    input: &PlanInput<'_>,
    wg: &WireguardConf,
) -> (PeerSpec, Switch) {
    let Some(next) = &lease.next_key else {
        return (p, Switch::None);
    };
    let Ok(key) = next.public_key.parse::<PublicKey>() else {
        return (p, Switch::None);
    };
    if key == p.public_key || key == own_key {
        return (p, Switch::None);
    }
    // The moment, but never before `SEEN_LEAD` after this node saw the announcement: a
    // clock running ahead must not switch before the rotating node does.
    let seen = input.observed.next_keys_seen.get(&key).copied();
    let moment = match seen {
        Some(seen) => next.switch_at().max(seen + SEEN_LEAD),
        None => next.switch_at(),
    };
    let at = moment + SWITCH_GRACE;
    let psk = super::post_quantum::peer_psk(input, wg, &key);
    let in_use = input.observed.next_keys_in_use.contains(&key);
    if input.now >= at || in_use {
        p.public_key = key;
        p.psk = psk;
        return (p, Switch::Now { on_clock: !in_use });
    }
    let entry = PeerSpec {
        node: format!("{}{STAGED}", p.node),
        public_key: key,
        allowed_ips: Vec::new(),
        psk,
        ..p.clone()
    };
    let announced = next.switch_at();
    (
        p,
        Switch::Staged(Box::new(Staged {
            entry,
            at,
            announced,
        })),
    )
}

/// The name a staged next key's entry carries: `<node> (next key)`.
pub(super) const STAGED: &str = " (next key)";
