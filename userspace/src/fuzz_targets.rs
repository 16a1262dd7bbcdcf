//! The userspace device's parsers of outside data, each as a function of raw bytes, for
//! the coverage-guided fuzzer (`fuzz/`, `scripts/fuzz`) and for the replay of its corpus
//! on every test run (`replay`, weft-crypto's, from `tests/fuzz_corpus.rs`). Each must
//! return for any input without panicking; what they return does not matter, but
//! `wg_session` panics where an invariant of the device's does not hold.
//!
//! - `userspace_datagrams`: what reaches the userspace device's UDP port (a GRO batch of
//!   handshake, cookie and data messages) against a device with a key and one peer;
//! - `tso_split`: what the TUN device hands over (a vnet header and a super-packet),
//!   split into segments and those coalesced again;
//! - `uapi_set`: a `set=1` request on the device's UAPI socket;
//! - `wg_session`: the device with a live session to its peer, fed the peer's messages
//!   unchanged, altered and replayed, and reconfigured between them (`session`).

use std::net::SocketAddr;
use std::sync::RwLock;

use x25519_dalek::{PublicKey, StaticSecret};

use crate::coalesce::Coalescer;
use crate::peers::{PeerConfig, State};
use crate::rx::{Outputs, Receiver};
use crate::uapi::{self, Sockets};
use crate::{segment, vnet};

pub use weft_crypto::fuzz_targets::{replay, seeds, Seeds, Target};

/// Every target, by name (the names of `fuzz/fuzz_targets/*.rs` and of the corpus folders).
pub const TARGETS: &[(&str, Target)] = &[
    ("userspace_datagrams", userspace_datagrams),
    ("tso_split", tso_split),
    ("uapi_set", uapi_set),
    ("wg_session", session::wg_session),
];

/// Targets whose seeds are made by code (they hold keys or sessions): by name, the seeds.
pub const SEEDS: &[(&str, Seeds)] = &[("wg_session", session::seeds)];

/// Outputs that go nowhere (their lengths are looked at, as a write would).
struct Sink(usize);

impl Outputs for Sink {
    fn send(&mut self, _to: crate::udp::Endpoint, datagram: &[u8]) {
        self.0 += datagram.len();
    }

    fn deliver(&mut self, packet: &[u8]) {
        self.0 += packet.len();
    }
}

mod session;

pub use session::wg_session;

const DEVICE_KEY: [u8; 32] = [7; 32];
const PEER_KEY: [u8; 32] = [9; 32];

/// A device state with its key and one peer (10.77.1.0/24, at 127.0.0.1:51000).
fn device_state() -> State {
    let mut state = State::default();
    state.set_private_key(Some(StaticSecret::from(DEVICE_KEY)));
    let peer = *PublicKey::from(&StaticSecret::from(PEER_KEY)).as_bytes();
    let config = PeerConfig {
        psk: None,
        keepalive: 0,
        allowed_ips: vec!["10.77.1.0/24".parse().unwrap_or_default()],
    };
    state.upsert(
        peer,
        config,
        Some(SocketAddr::from(([127, 0, 0, 1], 51000))),
    );
    state.commit();
    state
}

/// The first two bytes: the GRO segment size (0: one datagram); the rest: the batch,
/// received from the peer's endpoint.
pub fn userspace_datagrams(data: &[u8]) {
    let Some((size, batch)) = data.split_first_chunk::<2>() else {
        return;
    };
    let mut batch = batch.to_vec();
    let state = device_state();
    let mut rx = Receiver::new(Sink(0), true);
    let from = SocketAddr::from(([127, 0, 0, 1], 51000));
    rx.batch(
        &state,
        &mut batch,
        usize::from(u16::from_le_bytes(*size)),
        (from, None),
    );
    rx.flush();
}

/// A vnet header, then the packet; its segments go through a coalescer.
pub fn tso_split(data: &[u8]) {
    let Some(header) = vnet::Header::decode(data) else {
        return;
    };
    let mut pkt = data[vnet::LEN..].to_vec();
    let mut coalescer = Coalescer::new(true);
    let mut written = 0usize;
    let mut write = |p: &[u8]| written += p.len();
    let mut scratch = Vec::new();
    let _ = segment::split(&header, &mut pkt, &mut scratch, |seg| {
        coalescer.push(seg, &mut write);
    });
    coalescer.flush(&mut write);
}

struct NoSockets;

impl Sockets for NoSockets {
    fn rebind(&self, port: u16, _fwmark: u32) -> std::io::Result<u16> {
        Ok(port)
    }
}

/// The request's lines (after `set=1`), applied to a device with a key and one peer.
pub fn uapi_set(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    let state = RwLock::new(device_state());
    let _ = uapi::set(&state, &NoSockets, &lines);
    let _ = uapi::get(&crate::peers::read(&state));
}
