//! The device's own state: its key and port, and its peers, each with its Noise session
//! (`wg::Tunnel`), endpoint and AllowedIPs. The packet threads read it under
//! a read lock taken once per batch; the UAPI thread changes it in place.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use std::time::Instant;

use ipnet::IpNet;
use x25519_dalek::{PublicKey, StaticSecret};

use super::noise::Noise;
use super::udp::{Endpoint, Local};
use super::wg::cookie::Checker;
use super::wg::handshake::Latest;
use super::wg::index::Indices;
use super::wg::Tunnel;

/// Removed peers whose newest initiation timestamp the device remembers (about 60 bytes
/// each): past this many, the oldest removal is forgotten first.
const REMEMBERED: usize = 65_536;

pub type Key = [u8; 32];

pub struct Peer {
    pub key: Key,
    pub noise: Mutex<Noise>,
    /// Where the peer is reached, and from which local address (the one the peer last
    /// reached this device on).
    endpoint: Mutex<Option<Endpoint>>,
    pub config: Mutex<PeerConfig>,
}

#[derive(Clone, Default)]
pub struct PeerConfig {
    pub psk: Option<Key>,
    pub keepalive: u16,
    pub allowed_ips: Vec<IpNet>,
}

/// Locks `m`, carrying on past a panicked holder (the data is plain state, never left
/// half-written by the code that holds these locks).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads `l`, as `lock` does.
pub fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

/// Writes `l`, as `lock` does.
pub fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

impl Peer {
    /// The peer's address.
    pub fn endpoint(&self) -> Option<SocketAddr> {
        lock(&self.endpoint).map(|e| e.to)
    }

    /// Where datagrams for the peer go, and from which local address.
    pub fn route(&self) -> Option<Endpoint> {
        *lock(&self.endpoint)
    }

    /// A message the peer's keys verified came from `from` to this host's `local`
    /// address: the peer is reached there from now on, and answered from that address
    /// (the one it chose), as kernel WireGuard does.
    pub fn roam(&self, from: SocketAddr, local: Option<Local>) {
        let seen = Endpoint {
            to: from,
            from: local,
        };
        let mut endpoint = lock(&self.endpoint);
        if *endpoint != Some(seen) {
            tracing::debug!(to = %from, from = ?local.map(|l| l.ip), "a peer is reached at a new endpoint");
            *endpoint = Some(seen);
        }
    }

    /// After a send to `sent` (what `route` gave, as the send left it): a local address
    /// the kernel refused is forgotten, unless the peer has been seen on another since.
    pub fn sent(&self, before: Option<Local>, sent: &Endpoint) {
        let (Some(refused), None) = (before, sent.from) else {
            return;
        };
        let mut endpoint = lock(&self.endpoint);
        if let Some(e) = endpoint.as_mut().filter(|e| e.from == Some(refused)) {
            e.from = None;
        }
    }

    /// Sends one datagram to the peer (`Udp::send`, with `sent` after it).
    pub fn send(&self, udp: &super::udp::Udp, datagram: &[u8]) -> std::io::Result<()> {
        let Some(mut to) = self.route() else {
            return Ok(());
        };
        let before = to.from;
        let result = udp.send(&mut to, datagram);
        self.sent(before, &to);
        result
    }
}

pub struct Identity {
    pub secret: StaticSecret,
    pub public: PublicKey,
    /// Checks the MACs of the handshake messages sent to this key, and makes cookies.
    pub cookies: Checker,
}

/// AllowedIPs as a longest-prefix match: one hash map per prefix length in use, longest
/// first (a mesh uses a handful of lengths).
#[derive(Default)]
struct Routes {
    v4: Vec<(u8, HashMap<u32, Arc<Peer>>)>,
    v6: Vec<(u8, HashMap<u128, Arc<Peer>>)>,
}

fn mask4(a: u32, len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        a & (u32::MAX << (32 - u32::from(len)))
    }
}

fn mask6(a: u128, len: u8) -> u128 {
    if len == 0 {
        0
    } else {
        a & (u128::MAX << (128 - u32::from(len)))
    }
}

impl Routes {
    fn insert(&mut self, net: IpNet, peer: Arc<Peer>) {
        let len = net.prefix_len();
        match net {
            IpNet::V4(n) => {
                let addr = mask4(u32::from(n.network()), len);
                level(&mut self.v4, len).insert(addr, peer);
            }
            IpNet::V6(n) => {
                let addr = mask6(u128::from(n.network()), len);
                level(&mut self.v6, len).insert(addr, peer);
            }
        }
    }

    fn remove(&mut self, net: IpNet) {
        let len = net.prefix_len();
        match net {
            IpNet::V4(n) => {
                let addr = mask4(u32::from(n.network()), len);
                if let Some((_, m)) = self.v4.iter_mut().find(|(l, _)| *l == len) {
                    m.remove(&addr);
                }
            }
            IpNet::V6(n) => {
                let addr = mask6(u128::from(n.network()), len);
                if let Some((_, m)) = self.v6.iter_mut().find(|(l, _)| *l == len) {
                    m.remove(&addr);
                }
            }
        }
    }

    fn lookup(&self, ip: IpAddr) -> Option<&Arc<Peer>> {
        match ip {
            IpAddr::V4(a) => {
                let a = u32::from(a);
                self.v4.iter().find_map(|(len, m)| m.get(&mask4(a, *len)))
            }
            IpAddr::V6(a) => {
                let a = u128::from(a);
                self.v6.iter().find_map(|(len, m)| m.get(&mask6(a, *len)))
            }
        }
    }
}

fn level<K>(levels: &mut Vec<(u8, HashMap<K, Arc<Peer>>)>, len: u8) -> &mut HashMap<K, Arc<Peer>> {
    let at = match levels.iter().position(|(l, _)| *l <= len) {
        Some(i) if levels[i].0 == len => i,
        Some(i) => {
            levels.insert(i, (len, HashMap::new()));
            i
        }
        None => {
            levels.push((len, HashMap::new()));
            levels.len() - 1
        }
    };
    &mut levels[at].1
}

#[derive(Default)]
pub struct State {
    pub identity: Option<Identity>,
    pub listen_port: u16,
    pub fwmark: u32,
    pub peers: HashMap<Key, Arc<Peer>>,
    /// Which peer holds each session index.
    pub indices: Arc<Indices>,
    /// The newest initiation timestamp of each peer removed since the device started: a
    /// peer added again takes it back, so a recorded initiation cannot be replayed after
    /// a removal (the liveness watcher's re-handshake removes and adds).
    remembered: HashMap<Key, Latest>,
    /// An initiation was consumed since the timestamps were last saved
    /// (`replay_file`).
    pub handshaken: std::sync::atomic::AtomicBool,
    routes: Routes,
    /// Which peer holds each AllowedIP (truncated to its network, as the routes are).
    owners: HashMap<IpNet, Key>,
    /// AllowedIPs whose holder may have changed since the last `commit`: only their
    /// routes are looked at again, so a request that changes one peer of 10,000 costs
    /// what that peer has, not the whole table.
    touched: Vec<IpNet>,
}

impl State {
    /// The peer whose session index `receiver` (from a packet's header) belongs to.
    pub fn by_receiver(&self, receiver: u32) -> Option<&Arc<Peer>> {
        self.peers.get(&self.indices.owner(receiver)?)
    }

    /// The peer whose AllowedIPs hold `ip` (longest prefix).
    pub fn route(&self, ip: IpAddr) -> Option<&Arc<Peer>> {
        self.routes.lookup(ip)
    }

    /// A new private key: every peer's tunnel takes it in place and handshakes at once
    /// (the timer thread), while the session each had keeps carrying traffic in both
    /// directions until the new one is in use. During a key rotation the peers still
    /// route this node's subnet to the entry of its old key until they see the new key's
    /// handshake, so nothing is lost meanwhile.
    pub fn set_private_key(&mut self, secret: Option<StaticSecret>) {
        let Some(secret) = secret else {
            // No key, no sending: the sessions made under the old one seal nothing more.
            for peer in self.peers.values() {
                if let Some(tunn) = lock(&peer.noise).tunn.as_deref_mut() {
                    tunn.stop_sending();
                }
            }
            self.identity = None;
            return;
        };
        let public = PublicKey::from(&secret);
        if self.identity.as_ref().is_some_and(|i| i.public == public) {
            return;
        }
        for peer in self.peers.values() {
            let mut noise = lock(&peer.noise);
            if let Some(tunn) = noise.tunn.as_deref_mut() {
                tunn.set_secret(secret.clone());
                noise.initiate = true;
            }
        }
        self.identity = Some(Identity {
            cookies: Checker::new(&public),
            secret,
            public,
        });
    }

    /// `peer`'s tunnel in `noise` (its locked Noise state), made now if it has none yet.
    /// None while the device has no private key.
    pub fn session<'a>(&self, noise: &'a mut Noise, peer: &Peer) -> Option<&'a mut Tunnel> {
        if noise.tunn.is_none() {
            let id = self.identity.as_ref()?;
            let (psk, keepalive) = {
                let c = lock(&peer.config);
                (c.psk, c.keepalive)
            };
            let mut tunn = Tunnel::new(
                id.secret.clone(),
                PublicKey::from(peer.key),
                psk,
                (keepalive != 0).then_some(keepalive),
                self.indices.clone(),
                Instant::now(),
            );
            if let Some(latest) = self.remembered.get(&peer.key) {
                tunn.remember(*latest);
            }
            noise.tunn = Some(Box::new(tunn));
        }
        noise.tunn.as_deref_mut()
    }

    /// Adds a peer, or changes one in place. A new PSK goes into the peer's tunnel for
    /// the next handshake, which starts at once (the session in use carries traffic until
    /// the new one replaces it); a new keepalive applies at once. The endpoint and
    /// AllowedIPs change without touching the session.
    pub fn upsert(&mut self, key: Key, mut config: PeerConfig, endpoint: Option<SocketAddr>) {
        // Held as networks, as kernel WireGuard holds them (`uapi::set` truncates too).
        for net in &mut config.allowed_ips {
            *net = net.trunc();
        }
        let mut seen = std::collections::HashSet::new();
        config.allowed_ips.retain(|n| seen.insert(*n));
        if let Some(peer) = self.peers.get(&key).cloned() {
            let old = lock(&peer.config).clone();
            let mut noise = lock(&peer.noise);
            if let Some(tunn) = noise.tunn.as_deref_mut() {
                tunn.set_keepalive(config.keepalive);
                if old.psk != config.psk {
                    tunn.set_psk(config.psk);
                    noise.initiate = true;
                }
            }
            drop(noise);
            // A configured endpoint is sent to from the route's choice until the peer
            // answers (kernel WireGuard forgets the source address it had, too).
            if let Some(to) = endpoint {
                *lock(&peer.endpoint) = Some(Endpoint::to(to));
            }
            let routes_changed = old.allowed_ips != config.allowed_ips;
            *lock(&peer.config) = config;
            if routes_changed {
                self.claim(&key, &old.allowed_ips);
            }
            return;
        }
        let peer = Arc::new(Peer {
            key,
            noise: Mutex::new(Noise::new()),
            endpoint: Mutex::new(endpoint.map(Endpoint::to)),
            config: Mutex::new(config),
        });
        self.peers.insert(key, peer);
        self.claim(&key, &[]);
    }

    /// An AllowedIP belongs to one peer: giving it to `key` takes it from any other.
    /// `before` is what `key` held until now.
    fn claim(&mut self, key: &Key, before: &[IpNet]) {
        let Some(peer) = self.peers.get(key) else {
            return;
        };
        let mine = lock(&peer.config).allowed_ips.clone();
        for net in before.iter().filter(|n| !mine.contains(n)) {
            if self.owners.get(net) == Some(key) {
                self.owners.remove(net);
            }
            self.touched.push(*net);
        }
        self.touched.extend(&mine);
        for net in mine {
            if let Some(other) = self.owners.insert(net, *key).filter(|o| o != key) {
                if let Some(other) = self.peers.get(&other) {
                    lock(&other.config).allowed_ips.retain(|n| *n != net);
                }
            }
        }
    }

    /// Takes the timestamps a device before this one saved (`replay_file::load`), for
    /// the peers it has or gets.
    pub fn remember_saved(&mut self, saved: HashMap<Key, [u8; 12]>, now: Instant) {
        // Taken as consumed a while ago: only the timestamp order counts for them, not
        // the 20 ms between two initiations (a peer's first one may come at once).
        let at = now
            .checked_sub(std::time::Duration::from_secs(1))
            .unwrap_or(now);
        for (key, stamp) in saved {
            let latest = Latest { stamp, at };
            if let Some(peer) = self.peers.get(&key) {
                if let Some(tunn) = lock(&peer.noise).tunn.as_deref_mut() {
                    tunn.remember(latest);
                }
            }
            self.remembered.insert(key, latest);
        }
    }

    /// Every peer's newest initiation timestamp the device knows, removed peers' too.
    pub fn timestamps(&self) -> Vec<(Key, [u8; 12])> {
        let mut all: HashMap<Key, [u8; 12]> =
            self.remembered.iter().map(|(k, l)| (*k, l.stamp)).collect();
        for (key, peer) in &self.peers {
            let latest = lock(&peer.noise).tunn.as_deref().and_then(Tunnel::latest);
            if let Some(l) = latest {
                let e = all.entry(*key).or_insert(l.stamp);
                if *e < l.stamp {
                    *e = l.stamp;
                }
            }
        }
        all.into_iter().collect()
    }

    /// Keeps a removed peer's newest initiation timestamp past its removal.
    /// Its tunnel goes now (its indices with it), whoever still holds the peer.
    fn remember(&mut self, peer: &Peer) {
        let tunn = lock(&peer.noise).tunn.take();
        let latest = tunn.as_deref().and_then(Tunnel::latest);
        let Some(latest) = latest else { return };
        if self.remembered.len() >= REMEMBERED && !self.remembered.contains_key(&peer.key) {
            let oldest = self
                .remembered
                .iter()
                .min_by_key(|(_, l)| l.at)
                .map(|(k, _)| *k);
            if let Some(oldest) = oldest {
                self.remembered.remove(&oldest);
            }
        }
        let kept = self.remembered.entry(peer.key).or_insert(latest);
        if kept.stamp < latest.stamp {
            *kept = latest;
        }
    }

    pub fn remove(&mut self, key: &Key) {
        if let Some(peer) = self.peers.remove(key) {
            self.remember(&peer);
            for net in &lock(&peer.config).allowed_ips {
                self.owners.remove(net);
                self.touched.push(*net);
            }
        }
    }

    pub fn remove_all(&mut self) {
        for (_, peer) in std::mem::take(&mut self.peers) {
            self.remember(&peer);
        }
        self.owners.clear();
        self.touched.clear();
        self.routes = Routes::default();
    }

    /// Puts the routes in line with the AllowedIPs: once per UAPI request, for the
    /// AllowedIPs it touched.
    pub fn commit(&mut self) {
        for net in std::mem::take(&mut self.touched) {
            match self.owners.get(&net).and_then(|key| self.peers.get(key)) {
                Some(peer) => self.routes.insert(net, peer.clone()),
                None => self.routes.remove(net),
            }
        }
    }
}

#[cfg(test)]
#[path = "peers_tests.rs"]
mod tests;
