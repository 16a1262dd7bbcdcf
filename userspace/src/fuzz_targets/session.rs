//! `wg_session`: the userspace device with a live session, driven by the fuzzer's input.
//!
//! Each input starts from the same setup: a device (`DEVICE_KEY`) with one peer, and that
//! peer as a second device state (`PEER_KEY`), whose handshake with the device completes
//! through the device's own receiving side (`Receiver::batch`, handshakes handled inline).
//! The input is then a sequence of operations: the peer seals packets on the live session
//! or makes handshake messages and cookie replies; these are delivered to the device
//! unchanged, mutated (handshake MACs recomputed, so a mutation gets past mac1) or
//! replayed, from the peer's address, another port of it, or a stranger's; the device is
//! reconfigured between messages (PSK, keepalive, the peer removed and added again).
//! What the device sends goes back to the peer, so renewed handshakes complete.
//!
//! Invariants checked after every operation (a violation panics, which the fuzzer keeps):
//! - every packet the device delivers is one the peer sealed, delivered no more often
//!   than the peer sealed it (no replay), from one of the peer's AllowedIPs;
//! - the endpoint moves, a packet is delivered or anything is sent only for a message of
//!   the peer's making: never for the fuzzer's own bytes, a cookie reply, a data message
//!   altered in any byte, or a message the device already accepted once.
//!
//! The core draws ephemeral keys and session indices from the system; every choice of
//! this target comes from the input.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Instant;

use blake2::digest::{consts::U16, KeyInit, Mac};
use blake2::{Blake2s256, Blake2sMac, Digest};
use x25519_dalek::{PublicKey, StaticSecret};

use crate::peers::{lock, Key, PeerConfig, State};
use crate::rx::{Outputs, Receiver};
use crate::udp::Endpoint;
use crate::vnet;
use crate::wg::tunnel::inner;
use crate::wg::{TunnResult, Tunnel};

use super::{DEVICE_KEY, PEER_KEY};

/// Where the peer is configured and first seen, another port of the same host (a
/// legitimate roam), and a stranger.
const SOURCES: [([u8; 4], u16); 3] = [
    ([127, 0, 0, 1], 51000),
    ([127, 0, 0, 1], 51001),
    ([203, 0, 113, 66], 666),
];
/// The peer's AllowedIPs at the device.
const PEER_NETS: [&str; 2] = ["10.77.1.0/24", "fd77:1::/64"];
/// The device's AllowedIPs at the peer.
const DEVICE_NETS: [&str; 1] = ["10.77.0.0/24"];
/// Operations per input, and the peer's messages kept for delivery.
const MAX_OPS: usize = 64;
const POOL: usize = 32;

fn source(i: u8) -> SocketAddr {
    let (ip, port) = SOURCES[usize::from(i) % SOURCES.len()];
    SocketAddr::from((ip, port))
}

/// What the device's receiving side did: datagrams sent, packets delivered.
#[derive(Default)]
struct Log {
    sent: Vec<(SocketAddr, Vec<u8>)>,
    delivered: Vec<Vec<u8>>,
}

struct Recorder(Rc<RefCell<Log>>);

impl Outputs for Recorder {
    fn send(&mut self, to: Endpoint, datagram: &[u8]) {
        self.0.borrow_mut().sent.push((to.to, datagram.to_vec()));
    }

    fn deliver(&mut self, packet: &[u8]) {
        // Without offloads the coalescer's vnet header is not the TUN device's.
        let packet = packet.get(vnet::LEN..).unwrap_or_default();
        self.0.borrow_mut().delivered.push(packet.to_vec());
    }
}

/// The fuzzer's input, read a field at a time; past its end every field reads as zero.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    fn bytes(&mut self, n: usize) -> &[u8] {
        let (taken, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        taken
    }
}

fn public(secret: [u8; 32]) -> Key {
    *PublicKey::from(&StaticSecret::from(secret)).as_bytes()
}

fn nets(list: &[&str]) -> Vec<ipnet::IpNet> {
    list.iter().filter_map(|n| n.parse().ok()).collect()
}

/// A node with key `secret` and one peer of key `peer`.
fn node(secret: [u8; 32], peer: Key, allowed: &[&str], endpoint: Option<SocketAddr>) -> State {
    let mut state = State::default();
    state.set_private_key(Some(StaticSecret::from(secret)));
    let config = PeerConfig {
        allowed_ips: nets(allowed),
        ..PeerConfig::default()
    };
    state.upsert(peer, config, endpoint);
    state.commit();
    state
}

/// Runs `f` on the tunnel of `state`'s peer `key` (made now if it has none).
fn with_tunnel<T>(state: &State, key: &Key, f: impl FnOnce(&mut Tunnel) -> T) -> Option<T> {
    let peer = state.peers.get(key)?.clone();
    let mut noise = lock(&peer.noise);
    state.session(&mut noise, &peer).map(f)
}

/// A datagram out of a tunnel's answer, if it made one.
fn datagram(r: TunnResult<'_>) -> Option<Vec<u8>> {
    match r {
        TunnResult::WriteToNetwork(d) => Some(d.to_vec()),
        _ => None,
    }
}

/// Recomputes a handshake message's mac1 for `to`, as its sender would have.
fn fix_mac1(msg: &mut [u8], to: &Key) {
    let n = msg.len();
    if n < 36 {
        return;
    }
    let key: [u8; 32] = Blake2s256::new()
        .chain_update(b"mac1----")
        .chain_update(to)
        .finalize()
        .into();
    let Ok(mut mac) = <Blake2sMac<U16> as KeyInit>::new_from_slice(&key) else {
        return;
    };
    Mac::update(&mut mac, &msg[..n - 32]);
    msg[n - 32..n - 16].copy_from_slice(&mac.finalize().into_bytes());
}

/// Where a delivered datagram came from, for the invariants.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// Made by the peer, unchanged.
    Peer,
    /// Made by the peer, then altered.
    Altered,
    /// The fuzzer's own bytes.
    Fuzzer,
}

struct Session {
    device: State,
    peer: State,
    device_key: Key,
    peer_key: Key,
    rx: Receiver<Recorder>,
    log: Rc<RefCell<Log>>,
    /// The peer's messages for the device, newest last.
    pool: Vec<Vec<u8>>,
    /// Packets the peer sealed (as the device would deliver them), and how often.
    sealed: HashMap<Vec<u8>, usize>,
    delivered: HashMap<Vec<u8>, usize>,
    /// Datagrams the device is known to have accepted once (it moved the endpoint to
    /// their source, answered, or delivered what they held).
    accepted: HashSet<Vec<u8>>,
    /// The PSK both sides hold.
    psk: Option<Key>,
    /// How much of the log has been looked at.
    sent_seen: usize,
    delivered_seen: usize,
}

impl Session {
    /// The device and its peer, their handshake done through the device's receiving side.
    fn new() -> Session {
        let (device_key, peer_key) = (public(DEVICE_KEY), public(PEER_KEY));
        let device = node(DEVICE_KEY, peer_key, &PEER_NETS, Some(source(0)));
        let peer = node(PEER_KEY, device_key, &DEVICE_NETS, None);
        let log = Rc::new(RefCell::new(Log::default()));
        let mut s = Session {
            device,
            peer,
            device_key,
            peer_key,
            rx: Receiver::with_helpers(Recorder(log.clone()), false, 0),
            log,
            pool: Vec::new(),
            sealed: HashMap::new(),
            delivered: HashMap::new(),
            accepted: HashSet::new(),
            psk: None,
            sent_seen: 0,
            delivered_seen: 0,
        };
        // The device initiates: the peer's responder remembers the initiation, the
        // device's does not, so the peer's first initiation of the run is taken (a second
        // within 20 ms is refused as a burst, as kernel WireGuard refuses it).
        s.device_initiates(0);
        s.forward();
        let Some(response) = s.pool.pop() else {
            panic!("the peer did not answer the device's initiation")
        };
        s.deliver(&[response], 0, source(0));
        s.forward();
        let live = with_tunnel(&s.device, &peer_key, |t| t.established());
        assert_eq!(
            live,
            Some(true),
            "the device has no session after a complete handshake"
        );
        s.sent_seen = s.log.borrow().sent.len();
        s
    }

    fn keep(&mut self, d: Vec<u8>) {
        if self.pool.len() >= POOL {
            self.pool.remove(0);
        }
        self.pool.push(d);
    }

    /// Hands `datagrams` to the device's receiving side as one receive from `from`.
    fn deliver(&mut self, datagrams: &[Vec<u8>], segment: usize, from: SocketAddr) {
        let mut batch = datagrams.concat();
        self.rx
            .batch(&self.device, &mut batch, segment, (from, None));
        self.rx.flush();
    }

    /// What the device sent since the last look goes to the peer; what the peer answers
    /// is kept for delivery.
    fn forward(&mut self) {
        let sent: Vec<Vec<u8>> = self.log.borrow().sent[self.sent_seen..]
            .iter()
            .map(|(_, d)| d.clone())
            .collect();
        self.sent_seen += sent.len();
        let mut buf = vec![0u8; 65_600];
        for d in sent {
            let answer = with_tunnel(&self.peer, &self.device_key, |t| {
                let mut out = Vec::new();
                if let Some(a) = datagram(t.decapsulate(&d, Instant::now(), &mut buf)) {
                    out.push(a);
                }
                while let Some(q) = datagram(t.decapsulate(&[], Instant::now(), &mut buf)) {
                    out.push(q);
                }
                out
            });
            for a in answer.into_iter().flatten() {
                self.keep(a);
            }
        }
    }

    /// The peer seals `plain` (or, with no session, queues it and makes an initiation).
    fn seal(&mut self, plain: &[u8]) {
        let mut buf = vec![0u8; plain.len() + 64];
        let made = with_tunnel(&self.peer, &self.device_key, |t| {
            datagram(t.encapsulate(plain, Instant::now(), &mut buf))
        });
        // Sealed now, or queued (with or without an initiation going out) and sealed once
        // a handshake completes.
        if let Some((len, _)) = inner(plain) {
            *self.sealed.entry(plain[..len].to_vec()).or_default() += 1;
        }
        if let Some(Some(d)) = made {
            self.keep(d);
        }
    }

    /// Delivers one datagram and checks what the device did with it.
    fn deliver_checked(&mut self, d: Vec<u8>, origin: Origin, from: SocketAddr) {
        let peer = self.device.peers.get(&self.peer_key).cloned();
        let before = peer.as_ref().and_then(|p| p.endpoint());
        let (sent_before, delivered_before) = {
            let log = self.log.borrow();
            (log.sent.len(), log.delivered.len())
        };
        self.deliver(std::slice::from_ref(&d), 0, from);
        let after = peer.as_ref().and_then(|p| p.endpoint());
        let (sent, delivered) = {
            let log = self.log.borrow();
            (
                log.sent.len() - sent_before,
                log.delivered.len() - delivered_before,
            )
        };
        let moved = after != before;
        let acted = moved || sent > 0 || delivered > 0;
        let kind = d.first().copied().unwrap_or(0);
        let what = match origin {
            Origin::Fuzzer => Some("the fuzzer's own datagram"),
            Origin::Altered if kind == 4 => Some("a data message altered after sealing"),
            _ if kind == 3 => Some("a cookie reply"),
            _ if self.accepted.contains(&d) => Some("a replay of a datagram already accepted"),
            _ => None,
        };
        if let Some(what) = what {
            assert!(
                !acted,
                "{what} (type {kind}, {} bytes, from {from}) was acted on: endpoint {before:?} -> {after:?}, {sent} sent, {delivered} delivered",
                d.len()
            );
        }
        if moved {
            assert_eq!(
                after,
                Some(from),
                "the endpoint moved, but not to the sender"
            );
        }
        if acted {
            self.accepted.insert(d);
        }
    }

    /// Every packet delivered since the last look was sealed by the peer, no more often
    /// than it was sealed, from one of its AllowedIPs.
    fn check_delivered(&mut self) {
        let log = self.log.borrow();
        let allowed = nets(&PEER_NETS);
        for pkt in &log.delivered[self.delivered_seen..] {
            let sealed = self.sealed.get(pkt).copied().unwrap_or(0);
            let n = self.delivered.entry(pkt.clone()).or_default();
            *n += 1;
            assert!(
                *n <= sealed,
                "a packet of {} bytes was delivered {n} times, sealed by the peer {sealed} times",
                pkt.len()
            );
            let src = inner(pkt).map(|(_, src)| src);
            assert!(
                src.is_some_and(|s| allowed.iter().any(|n| n.contains(&s))),
                "a packet from {src:?}, outside the peer's AllowedIPs, was delivered"
            );
        }
        self.delivered_seen = log.delivered.len();
    }

    /// One operation, read from `input`.
    fn step(&mut self, input: &mut Input<'_>) {
        match input.byte() % 9 {
            0 => {
                let plain = packet(input);
                self.seal(&plain);
            }
            1 | 2 => {
                let (i, from) = (input.byte(), source(input.byte()));
                let Some(d) = self.pick(i) else { return };
                self.deliver_checked(d, Origin::Peer, from);
            }
            3 => {
                let (i, from) = (input.byte(), source(input.byte()));
                let Some(mut d) = self.pick(i) else { return };
                let (at, xor, fix) = (usize::from(input.u16()), input.byte(), input.byte());
                if d.is_empty() || xor == 0 {
                    return;
                }
                let at = at % d.len();
                d[at] ^= xor;
                if fix & 1 == 1 && matches!(d[0], 1 | 2) {
                    fix_mac1(&mut d, &self.device_key);
                }
                self.deliver_checked(d, Origin::Altered, from);
            }
            4 => {
                let (kind, len, fix) = (input.byte() % 5, input.byte(), input.byte());
                let from = source(input.byte());
                let mut d = input.bytes(usize::from(len)).to_vec();
                let want = [0, 148, 92, 64, 0][usize::from(kind)];
                if want > 0 {
                    d.resize(want, 0);
                }
                if kind > 0 {
                    if let Some(head) = d.get_mut(..4) {
                        head.copy_from_slice(&[kind, 0, 0, 0]);
                    }
                }
                if fix & 1 == 1 {
                    fix_mac1(&mut d, &self.device_key);
                }
                self.deliver_checked(d, Origin::Fuzzer, from);
            }
            5 => {
                let mut buf = vec![0u8; 256];
                let init = with_tunnel(&self.peer, &self.device_key, |t| {
                    datagram(t.format_handshake_initiation(Instant::now(), &mut buf, true))
                });
                if let Some(Some(init)) = init {
                    self.keep(init);
                }
            }
            6 => self.device_initiates(input.byte()),
            7 => {
                let count = 1 + usize::from(input.byte() % 8);
                let from = source(input.byte());
                let batch: Vec<Vec<u8>> = (0..count)
                    .filter_map(|_| {
                        let i = input.byte();
                        self.pick(i)
                    })
                    .collect();
                let segment = batch.first().map_or(0, Vec::len);
                self.deliver(&batch, segment, from);
            }
            _ => self.configure(input),
        }
        self.forward();
        self.check_delivered();
    }

    /// The peer's message `i` (counted from the newest).
    fn pick(&self, i: u8) -> Option<Vec<u8>> {
        let n = self.pool.len();
        (n > 0).then(|| self.pool[n - 1 - usize::from(i) % n].clone())
    }

    /// The device starts a handshake, which reaches the peer; with `cookie` odd, the peer
    /// answers it with a cookie reply as well (as a peer under load would). The peer
    /// answers as a new peer state (same key and PSK) that takes over: the old one would
    /// refuse a second initiation within 20 ms of the first.
    fn device_initiates(&mut self, cookie: u8) {
        let mut buf = vec![0u8; 256];
        self.peer = node(PEER_KEY, self.device_key, &DEVICE_NETS, None);
        if self.psk.is_some() {
            let config = PeerConfig {
                psk: self.psk,
                allowed_ips: nets(&DEVICE_NETS),
                ..PeerConfig::default()
            };
            self.peer.upsert(self.device_key, config, None);
        }
        let init = with_tunnel(&self.device, &self.peer_key, |t| {
            datagram(t.format_handshake_initiation(Instant::now(), &mut buf, true))
        });
        let Some(Some(init)) = init else { return };
        if cookie & 1 == 1 {
            let reply = self.peer.identity.as_ref().and_then(|id| {
                id.cookies.reply(
                    &init,
                    SocketAddr::from(([127, 0, 0, 2], 51820)),
                    Instant::now(),
                )
            });
            if let Some(reply) = reply {
                self.keep(reply.to_vec());
            }
        }
        self.log.borrow_mut().sent.push((source(0), init));
    }

    /// A change of the device's configuration (and the peer's, for a PSK: both sides
    /// hold the same one).
    fn configure(&mut self, input: &mut Input<'_>) {
        let what = input.byte() % 3;
        let device_peer = self.device.peers.get(&self.peer_key).cloned();
        let mut config = device_peer.map_or_else(
            || PeerConfig {
                allowed_ips: nets(&PEER_NETS),
                ..PeerConfig::default()
            },
            |p| lock(&p.config).clone(),
        );
        match what {
            0 => {
                let b = input.byte();
                let psk = (b != 0).then_some([b; 32]);
                config.psk = psk;
                self.psk = psk;
                self.device.upsert(self.peer_key, config, None);
                let peer_peer = self.peer.peers.get(&self.device_key).cloned();
                if let Some(p) = peer_peer {
                    let mut c = lock(&p.config).clone();
                    c.psk = psk;
                    self.peer.upsert(self.device_key, c, None);
                }
            }
            1 => {
                config.keepalive = input.u16();
                self.device.upsert(self.peer_key, config, None);
            }
            _ => {
                self.device.remove(&self.peer_key);
                self.device.commit();
                self.device.upsert(self.peer_key, config, Some(source(0)));
            }
        }
        self.device.commit();
    }
}

/// A packet for the peer to seal, from the input: an IPv4 or IPv6 packet from inside its
/// AllowedIPs or outside them (its length field as given, or as it should be), or bytes
/// that are no IP packet at all.
fn packet(input: &mut Input<'_>) -> Vec<u8> {
    let (shape, len, length_field) = (input.byte(), input.byte(), input.u16());
    let payload = input.bytes(usize::from(len)).to_vec();
    let honest = shape & 4 == 0;
    match shape % 4 {
        0 | 1 => {
            let src = if shape % 4 == 0 {
                [10, 77, 1, 9]
            } else {
                [10, 9, 9, 9]
            };
            let total = 20 + payload.len();
            let mut p = vec![0x45, 0, 0, 0, 0, 0, 0, 0, 64, 17, 0, 0];
            let field = if honest { total as u16 } else { length_field };
            p[2..4].copy_from_slice(&field.to_be_bytes());
            p.extend_from_slice(&src);
            p.extend_from_slice(&[10, 77, 0, 1]);
            p.extend_from_slice(&payload);
            p
        }
        2 => {
            let mut p = vec![0x60, 0, 0, 0];
            let field = if honest {
                payload.len() as u16
            } else {
                length_field
            };
            p.extend_from_slice(&field.to_be_bytes());
            p.extend_from_slice(&[17, 64]);
            let mut src = [0u8; 16];
            src[..4].copy_from_slice(&[0xfd, 0x77, 0, 1]);
            src[15] = 9;
            p.extend_from_slice(&src);
            let mut dst = [0u8; 16];
            dst[..4].copy_from_slice(&[0xfd, 0x77, 0, 0]);
            dst[15] = 1;
            p.extend_from_slice(&dst);
            p.extend_from_slice(&payload);
            p
        }
        _ => payload,
    }
}

/// See the module's doc.
pub fn wg_session(data: &[u8]) {
    run(data);
}

fn run(data: &[u8]) -> Session {
    let mut session = Session::new();
    let mut input = Input(data);
    for _ in 0..MAX_OPS {
        if input.0.is_empty() {
            break;
        }
        session.step(&mut input);
    }
    session
}

/// Inputs that reach each operation: a few packets sealed and delivered, a replay from
/// a stranger, a renewed handshake each way, a cookie reply, a batch, and each change of
/// configuration between messages.
pub fn seeds() -> Vec<Vec<u8>> {
    let seal = |shape: u8, len: u8| {
        let mut op = vec![0, shape, len, 0, 0];
        op.extend(std::iter::repeat_n(0xab, usize::from(len)));
        op
    };
    let deliver = |i: u8, from: u8| vec![1, i, from];
    let mut seeds = vec![
        // Packets sealed and delivered, then the first again from a stranger.
        [
            seal(0, 40),
            deliver(0, 0),
            seal(2, 30),
            deliver(0, 1),
            deliver(1, 2),
        ]
        .concat(),
        // A packet from outside the AllowedIPs, one lying about its length, one not IP.
        [
            seal(1, 20),
            deliver(0, 0),
            seal(4, 20),
            deliver(0, 0),
            seal(3, 16),
            deliver(0, 0),
        ]
        .concat(),
        // The peer rehandshakes; its initiation delivered twice, then data on the new session.
        [
            vec![5],
            deliver(0, 0),
            deliver(1, 2),
            seal(0, 8),
            deliver(0, 0),
        ]
        .concat(),
        // The device rehandshakes, with a cookie reply from the peer; the response and the
        // cookie delivered.
        [vec![6, 1], deliver(0, 0), deliver(1, 0), deliver(0, 2)].concat(),
        // Altered messages: a data message, an initiation with mac1 recomputed.
        [
            seal(0, 40),
            vec![3, 0, 0, 20, 0, 1, 0],
            vec![5],
            vec![3, 0, 2, 4, 0, 0xff, 1],
        ]
        .concat(),
        // The fuzzer's own initiation, response and data message.
        [
            vec![4, 1, 0, 1, 2],
            vec![4, 2, 0, 1, 2],
            vec![4, 4, 40, 0, 0],
            vec![0xee; 40],
        ]
        .concat(),
        // A GRO batch of three sealed packets.
        [
            seal(0, 100),
            seal(0, 100),
            seal(0, 100),
            vec![7, 2, 0, 2, 1, 0],
        ]
        .concat(),
    ];
    // A PSK, a keepalive, the peer removed and added, each followed by traffic.
    for config in [vec![8, 0, 7], vec![8, 1, 25, 0], vec![8, 2]] {
        seeds.push(
            [
                config,
                vec![5],
                deliver(0, 0),
                seal(0, 20),
                deliver(0, 1),
                deliver(2, 2),
            ]
            .concat(),
        );
    }
    seeds
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a seed made the device do: packets delivered, datagrams sent, datagrams
    /// accepted, and where the peer's endpoint ended.
    fn outcome(seed: &[u8]) -> (usize, usize, usize, Option<SocketAddr>) {
        let s = run(seed);
        let log = s.log.borrow();
        let endpoint = s.device.peers.get(&s.peer_key).and_then(|p| p.endpoint());
        (
            log.delivered.len(),
            log.sent.len(),
            s.accepted.len(),
            endpoint,
        )
    }

    #[test]
    fn the_seeds_reach_the_data_path_the_handshakes_and_the_configuration() {
        let seeds = seeds();
        // The setup sent two datagrams: the device's initiation, its confirming keepalive.
        // Two packets delivered (IPv4, IPv6), the endpoint moved to the second port, the
        // stranger's replay refused.
        assert_eq!(outcome(&seeds[0]), (2, 2, 2, Some(source(1))));
        // Outside the AllowedIPs, lying about its length, not IP: none delivered.
        assert_eq!(outcome(&seeds[1]).0, 0);
        // The peer's new initiation answered once (its replay from a stranger is not),
        // and a packet delivered.
        let (delivered, sent, _, endpoint) = outcome(&seeds[2]);
        assert_eq!((delivered, sent, endpoint), (1, 3, Some(source(0))));
        // The device's second handshake: its initiation and keepalive; the cookie reply
        // and the response replayed from a stranger change nothing.
        assert_eq!(outcome(&seeds[3]), (0, 4, 1, Some(source(0))));
        // A fresh initiation with another sender index (mac1 recomputed) is the peer's
        // own: taken from wherever it comes, as kernel WireGuard takes it.
        assert_eq!(outcome(&seeds[4]).3, Some(source(2)));
        // A GRO batch of three.
        assert_eq!(outcome(&seeds[6]).0, 3);
        // After each change of configuration, the handshake and the traffic go on.
        for seed in &seeds[7..] {
            let (delivered, _, _, endpoint) = outcome(seed);
            assert_eq!((delivered, endpoint), (1, Some(source(1))));
        }
    }
}
