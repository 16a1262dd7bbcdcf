//! Where each datagram a gateway receives goes: pure, no I/O, the time passed in.
//!
//! The relay holds no key. It tells WireGuard's messages apart by their type and size and
//! follows each pair by the session indices their handshakes carry:
//! - an initiation goes to the member its mac1 is made for (mac1 is keyed by the
//!   responder's public key, which the registry publishes), at the member's address on
//!   this gateway's segment (`Member::home`) or the address it was last heard from;
//! - a response goes back to where the initiation it answers came from (its receiver index
//!   is the initiator's sender index); its mac1, keyed by the initiator's public key, says
//!   who the initiator is, so the relay learns that member's address;
//! - cookie replies and data follow the receiver index they carry.
//!
//! A route is keyed by the receiver index and the address the datagram comes from, so two
//! nodes that drew the same 32-bit index do not take each other's datagrams. A route made
//! by an initiation lives `PENDING_LIFE` until a response confirms it, then `ROUTE_LIFE`
//! past its last datagram. Handshake messages, which cost the relay BLAKE2s work, are
//! limited (`limit`); data costs one table lookup.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::limit::Limits;
use crate::wg::cookie::mac1_key;

pub type Key = [u8; 32];
/// Routes as saved: where, the route, and how long it has left.
pub(crate) type SavedRoutes = Vec<((u32, SocketAddr), Route, Duration)>;
/// Learned member addresses as saved: whose, where, and how long it has left.
pub(crate) type SavedLearned = Vec<(Key, SocketAddr, Duration)>;

const INITIATION: (u8, usize) = (1, 148);
const RESPONSE: (u8, usize) = (2, 92);
const COOKIE: (u8, usize) = (3, 64);
const DATA: u8 = 4;
/// A data message's header and tag: the smallest data message (a keepalive).
const DATA_MIN: usize = 32;

/// How long a route lives past its last datagram: WireGuard's REJECT_AFTER_TIME (180 s)
/// with room, so a session the pair still holds keeps its route.
pub const ROUTE_LIFE: Duration = Duration::from_secs(200);
/// How long a route made by an initiation waits for its response.
pub const PENDING_LIFE: Duration = Duration::from_secs(10);
/// How long an address a member was heard from stays usable for initiations to it.
pub const LEARNED_LIFE: Duration = Duration::from_secs(600);
/// Routes held at most (about 100 bytes each).
pub const MAX_ROUTES: usize = 1 << 20;

/// A node the relay may carry datagrams to: its name and key, and its address on this
/// gateway's own segment (same zone: its internal address and WireGuard port), if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub node: Arc<str>,
    pub key: Key,
    pub home: Option<SocketAddr>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drop {
    /// Not a WireGuard message (type or size).
    NotWireguard,
    /// A handshake message over its source's limit.
    Limited,
    /// An initiation whose mac1 is for no member this relay can reach.
    UnknownResponder,
    /// A response, cookie reply or data message whose receiver index names no route from
    /// this source.
    NoRoute,
    /// The destination is where it came from.
    Loop,
    /// The table is full.
    Full,
    /// An initiation whose index a live route of another node holds.
    Taken,
}

impl Drop {
    pub fn label(self) -> &'static str {
        match self {
            Drop::NotWireguard => "not wireguard",
            Drop::Limited => "limited",
            Drop::UnknownResponder => "unknown responder",
            Drop::NoRoute => "no route",
            Drop::Loop => "loop",
            Drop::Full => "table full",
            Drop::Taken => "index taken",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Route {
    pub(crate) to: SocketAddr,
    pub(crate) until: Instant,
    pub(crate) confirmed: bool,
    /// The members at each end, where known: the datagrams' sender and receiver.
    pub(crate) from_key: Option<Key>,
    pub(crate) to_key: Option<Key>,
    pub(crate) bytes: u64,
}

struct MemberState {
    node: Arc<str>,
    mac1: Key,
    home: Option<SocketAddr>,
    learned: Option<(SocketAddr, Instant)>,
}

impl MemberState {
    fn address(&self, now: Instant) -> Option<SocketAddr> {
        self.home.or(self
            .learned
            .filter(|(_, at)| now.saturating_duration_since(*at) < LEARNED_LIFE)
            .map(|(a, _)| a))
    }
}

/// Bytes carried between two members (by key), for `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairBytes {
    pub from: Arc<str>,
    pub to: Arc<str>,
    pub bytes: u64,
}

pub struct Table {
    members: HashMap<Key, MemberState>,
    pub(crate) routes: HashMap<(u32, SocketAddr), Route>,
    limits: Limits,
    /// Bytes of routes that expired, by (sender, receiver) key.
    carried: HashMap<(Key, Key), u64>,
    swept: Option<Instant>,
    /// Changed since the last `take_dirty`: worth saving.
    dirty: bool,
}

fn u32_at(msg: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(msg.get(at..at + 4)?.try_into().ok()?))
}

impl Table {
    pub fn new(now: Instant) -> Table {
        Table {
            members: HashMap::new(),
            routes: HashMap::new(),
            limits: Limits::new(now),
            carried: HashMap::new(),
            swept: None,
            dirty: false,
        }
    }

    /// The members now: those gone are forgotten, the others keep what was learned.
    pub fn set_members(&mut self, members: &[Member]) {
        let mut next = HashMap::with_capacity(members.len());
        // A member whose key changed (a rotation) keeps where it was heard from.
        let by_node: HashMap<&str, Option<(SocketAddr, Instant)>> = self
            .members
            .values()
            .map(|s| (&*s.node, s.learned))
            .collect();
        for m in members {
            let learned = match self.members.get(&m.key) {
                Some(s) => s.learned,
                None => by_node.get(&*m.node).copied().flatten(),
            };
            next.insert(
                m.key,
                MemberState {
                    node: m.node.clone(),
                    mac1: mac1_key(&m.key),
                    home: m.home,
                    learned,
                },
            );
        }
        self.members = next;
    }

    pub fn routes(&self) -> usize {
        self.routes.len()
    }

    pub fn members(&self) -> usize {
        self.members.len()
    }

    /// The table's memory, estimated from its maps' capacities (entry and control byte).
    pub fn estimated_bytes(&self) -> usize {
        fn map<K, V>(m: &HashMap<K, V>) -> usize {
            m.capacity() * (std::mem::size_of::<(K, V)>() + 1)
        }
        map(&self.routes) + map(&self.members) + self.limits.estimated_bytes() + map(&self.carried)
    }

    /// Where the datagram `msg` from `from` goes at `now`.
    pub fn route(
        &mut self,
        from: SocketAddr,
        msg: &[u8],
        now: Instant,
    ) -> Result<SocketAddr, Drop> {
        let kind = (msg.first().copied(), msg.len());
        let to = match kind {
            (Some(DATA), n) if n >= DATA_MIN && msg[1..4] == [0, 0, 0] => {
                self.follow(from, msg, 4, now)?
            }
            (Some(t), n) if (t, n) == COOKIE => self.follow(from, msg, 4, now)?,
            (Some(t), n) if (t, n) == RESPONSE => {
                self.limit(from, now)?;
                self.response(from, msg, now)?
            }
            (Some(t), n) if (t, n) == INITIATION => {
                self.limit(from, now)?;
                self.initiation(from, msg, now)?
            }
            _ => return Err(Drop::NotWireguard),
        };
        if to == from {
            return Err(Drop::Loop);
        }
        Ok(to)
    }

    fn limit(&mut self, from: SocketAddr, now: Instant) -> Result<(), Drop> {
        match self.limits.allow(from, now) {
            true => Ok(()),
            false => Err(Drop::Limited),
        }
    }

    /// A cookie reply or data message: its route, by the receiver index at `at`.
    fn follow(
        &mut self,
        from: SocketAddr,
        msg: &[u8],
        at: usize,
        now: Instant,
    ) -> Result<SocketAddr, Drop> {
        let index = u32_at(msg, at).ok_or(Drop::NotWireguard)?;
        let route = self.routes.get_mut(&(index, from)).ok_or(Drop::NoRoute)?;
        if route.until <= now {
            return Err(Drop::NoRoute);
        }
        if route.confirmed {
            route.until = now + ROUTE_LIFE;
        }
        route.bytes += msg.len() as u64;
        let (to, sender) = (route.to, route.from_key);
        // The sender is still where it was learned: its address stays usable for
        // initiations to it (a member that never initiates is otherwise forgotten).
        if let Some(m) = sender.and_then(|k| self.members.get_mut(&k)) {
            if let Some((at, when)) = m.learned.as_mut() {
                if *at == from && now.saturating_duration_since(*when) > Duration::from_secs(1) {
                    *when = now;
                }
            }
        }
        Ok(to)
    }

    fn initiation(
        &mut self,
        from: SocketAddr,
        msg: &[u8],
        now: Instant,
    ) -> Result<SocketAddr, Drop> {
        let sender = u32_at(msg, 4).ok_or(Drop::NotWireguard)?;
        // Members of this gateway's zone first: an initiation from outside, the common
        // case, is for one of them.
        let (home, away): (Vec<_>, Vec<_>) = self
            .members
            .iter()
            .filter_map(|(key, m)| Some((key, m.address(now)?, &m.mac1, m.home.is_some())))
            .partition(|(.., home)| *home);
        let work = &mut self.limits;
        let (key, to) = home
            .into_iter()
            .chain(away)
            .find(|(_, to, mac1, _)| *to != from && work.mac1(mac1, msg))
            .map(|(key, to, ..)| (*key, to))
            .ok_or(Drop::UnknownResponder)?;
        // A live route under this index from the responder that goes elsewhere is not
        // taken over (a forged initiation would redirect a session's data; a real
        // collision is retried by WireGuard with another index).
        if self
            .routes
            .get(&(sender, to))
            .is_some_and(|r| r.until > now && r.to != from)
        {
            return Err(Drop::Taken);
        }
        // The responder answers to this sender index, from `to`.
        self.insert(
            (sender, to),
            Route {
                to: from,
                until: now + PENDING_LIFE,
                confirmed: false,
                from_key: Some(key),
                to_key: None,
                bytes: 0,
            },
            now,
        )?;
        Ok(to)
    }

    fn response(&mut self, from: SocketAddr, msg: &[u8], now: Instant) -> Result<SocketAddr, Drop> {
        let sender = u32_at(msg, 4).ok_or(Drop::NotWireguard)?;
        let receiver = u32_at(msg, 8).ok_or(Drop::NotWireguard)?;
        let back = *self.routes.get(&(receiver, from)).ok_or(Drop::NoRoute)?;
        // Only an initiation still waiting is answered: a confirmed route is not made
        // again by a response (anyone can compute a response's mac1).
        if back.until <= now || back.confirmed {
            return Err(Drop::NoRoute);
        }
        // Who initiated: the member whose key the response's mac1 is made with, tried
        // first at the address the initiation came from.
        let work = &mut self.limits;
        let initiator = self
            .members
            .iter()
            .filter(|(_, m)| m.address(now) == Some(back.to))
            .chain(self.members.iter())
            .find(|(_, m)| work.mac1(&m.mac1, msg))
            .map(|(k, _)| *k)
            .ok_or(Drop::UnknownResponder)?;
        let initiator = Some(initiator);
        let responder = back.from_key;
        if let Some(m) = initiator.and_then(|k| self.members.get_mut(&k)) {
            if m.home.is_none() {
                m.learned = Some((back.to, now));
            }
        }
        self.insert(
            (receiver, from),
            Route {
                confirmed: true,
                until: now + ROUTE_LIFE,
                to_key: initiator,
                ..back
            },
            now,
        )?;
        self.insert(
            (sender, back.to),
            Route {
                to: from,
                until: now + ROUTE_LIFE,
                confirmed: true,
                from_key: initiator,
                to_key: responder,
                bytes: 0,
            },
            now,
        )?;
        Ok(back.to)
    }

    fn insert(&mut self, at: (u32, SocketAddr), route: Route, now: Instant) -> Result<(), Drop> {
        if self.routes.len() >= MAX_ROUTES && !self.routes.contains_key(&at) {
            self.expire(now);
            if self.routes.len() >= MAX_ROUTES {
                return Err(Drop::Full);
            }
        }
        if let Some(old) = self.routes.insert(at, route) {
            self.fold(&old);
        }
        self.dirty = true;
        Ok(())
    }

    fn fold(&mut self, route: &Route) {
        if let (Some(a), Some(b), n @ 1..) = (route.from_key, route.to_key, route.bytes) {
            *self.carried.entry((a, b)).or_default() += n;
        }
    }

    /// Forgets expired routes and idle sources; at most once a second.
    pub fn expire(&mut self, now: Instant) {
        if self
            .swept
            .is_some_and(|at| now.saturating_duration_since(at) < Duration::from_secs(1))
        {
            return;
        }
        self.swept = Some(now);
        let mut gone = Vec::new();
        self.routes.retain(|_, r| {
            let keep = r.until > now;
            if !keep {
                gone.push(*r);
            }
            keep
        });
        self.dirty |= !gone.is_empty();
        for r in &gone {
            self.fold(r);
        }
        self.limits.expire(now);
    }

    /// Bytes carried per pair of members (by name), expired routes included.
    pub fn pair_bytes(&self) -> Vec<PairBytes> {
        let mut by: HashMap<(Key, Key), u64> = self.carried.clone();
        for r in self.routes.values() {
            if let (Some(a), Some(b), n @ 1..) = (r.from_key, r.to_key, r.bytes) {
                *by.entry((a, b)).or_default() += n;
            }
        }
        let name = |k: &Key| self.members.get(k).map(|m| m.node.clone());
        let mut out: Vec<PairBytes> = by
            .into_iter()
            .filter_map(|((a, b), bytes)| {
                Some(PairBytes {
                    from: name(&a)?,
                    to: name(&b)?,
                    bytes,
                })
            })
            .collect();
        out.sort_by(|x, y| (&x.from, &x.to).cmp(&(&y.from, &y.to)));
        out
    }

    /// Whether anything worth saving changed since the last call.
    pub fn take_dirty(&mut self) -> bool {
        std::mem::take(&mut self.dirty)
    }

    /// Routes and learned addresses as they stand, with how long each has left: what a
    /// restarted relay loads (`persist`).
    pub(crate) fn snapshot(&self, now: Instant) -> (SavedRoutes, SavedLearned) {
        let routes = self
            .routes
            .iter()
            .filter(|(_, r)| r.until > now && r.confirmed)
            .map(|(k, r)| (*k, *r, r.until - now))
            .collect();
        let learned = self
            .members
            .iter()
            .filter_map(|(k, m)| {
                let (a, at) = m.learned?;
                let left = LEARNED_LIFE.checked_sub(now.saturating_duration_since(at))?;
                Some((*k, a, left))
            })
            .collect();
        (routes, learned)
    }

    /// Takes back what `snapshot` saved (before the members are known: a learned address
    /// waits for its member).
    pub(crate) fn restore(&mut self, routes: SavedRoutes, learned: SavedLearned, now: Instant) {
        for (at, mut r, left) in routes.into_iter().take(MAX_ROUTES) {
            r.until = now + left.min(ROUTE_LIFE);
            self.routes.insert(at, r);
        }
        for (key, addr, left) in learned {
            let at = now
                .checked_sub(LEARNED_LIFE.saturating_sub(left))
                .unwrap_or(now);
            let m = self.members.entry(key).or_insert_with(|| MemberState {
                node: Arc::from(""),
                mac1: mac1_key(&key),
                home: None,
                learned: None,
            });
            m.learned = Some((addr, at));
        }
    }
}
