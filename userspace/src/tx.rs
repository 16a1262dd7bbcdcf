//! The sending side: read a packet (or a TSO super-packet) from the TUN device, find its
//! peer by destination, split it into segments, encrypt each straight into one UDP GSO
//! buffer, and send that buffer with one call. The peer's session is taken under its
//! lock once per read and used without it; segments are laid out in place and the whole
//! batch is sealed just before it goes (`Batch`).

use std::io::Read;
use std::sync::Arc;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::pool::Pool;
use super::wg::session::{Session, HEADER, OVERHEAD, REJECT_AFTER_MESSAGES, TAG};
use super::wg::{self, TunnResult, Tunnel as Tunn};

use super::device::Device;
use super::peers::lock;
use super::segment;
use super::udp::{Endpoint, Udp, MAX_GSO_BYTES, MAX_SEGMENTS};
use super::vnet::{self, Header};

/// A handshake initiation, the largest message `encapsulate` may write instead.
const HANDSHAKE_INIT: usize = 148;

/// The length a packet of `len` bytes is padded to before it is encrypted: the next
/// multiple of 16, but never past the interface's MTU (`mtu`, 0 while unknown), as the
/// WireGuard paper and kernel WireGuard pad. The receiver trims a packet to its IP length.
pub fn padded_len(len: usize, mtu: usize) -> usize {
    len.next_multiple_of(16).min(len.max(mtu))
}

/// Datagrams to one endpoint, back to back, all `stride` bytes but the last: each packet
/// is laid out where its data message goes (header room, padded packet, tag room), and the
/// whole batch is sealed just before it is sent, its datagrams split between this thread
/// and the crypto pool's helpers.
struct Batch {
    /// Allocated (and zeroed) once: only its first `len` bytes are the batch.
    buf: Vec<u8>,
    len: usize,
    /// A packet padded with zeros to `padded_len`, when it must be (the handshake path).
    padded: Vec<u8>,
    stride: usize,
    count: usize,
    /// A shorter datagram came last: nothing more may join.
    closed: bool,
    /// The session the batch's datagrams are sealed with.
    session: Option<Arc<Session>>,
    /// Bytes of handshake messages `encapsulate` sent instead (`Noise::handshake_tx`).
    handshakes: usize,
    pool: Pool,
}

/// A session this close to REJECT_AFTER_MESSAGES is left to `encapsulate`, which retires
/// it: a batch never runs out of counters halfway.
const COUNTER_MARGIN: u64 = 4 * MAX_SEGMENTS as u64;

impl Batch {
    fn new(pool: Pool) -> Batch {
        Batch {
            buf: vec![0; MAX_GSO_BYTES + HANDSHAKE_INIT + 64],
            len: 0,
            padded: Vec::with_capacity(65_536),
            stride: 0,
            count: 0,
            closed: false,
            session: None,
            handshakes: 0,
            pool,
        }
    }

    /// Seals every datagram of the batch, spread over the pool: false if any could not
    /// be sealed (then nothing of it may go out: it holds plaintext).
    fn seal_all(&mut self) -> bool {
        let Some(session) = self.session.take() else {
            // Nothing laid out is sealable without a session: an empty batch only.
            return self.count == 0;
        };
        let (stride, count) = (self.stride, self.count);
        let width = self.pool.width().min(count);
        // Contiguous runs of whole datagrams, one per part.
        let per = count.div_ceil(width.max(1));
        let mut parts = Vec::with_capacity(width);
        let mut rest = &mut self.buf[..self.len];
        while !rest.is_empty() {
            let cut = (per * stride).min(rest.len());
            let (part, tail) = rest.split_at_mut(cut);
            parts.push(Mutex::new(Some(part)));
            rest = tail;
        }
        let failed = AtomicBool::new(false);
        let finished = self.pool.run(parts.len(), &|p| {
            let Some(part) = parts[p].lock().unwrap_or_else(|e| e.into_inner()).take() else {
                return;
            };
            for msg in part.chunks_mut(stride) {
                if session.seal_in_place(msg).is_none() {
                    failed.store(true, Ordering::Relaxed);
                }
            }
        });
        finished && !failed.load(Ordering::Relaxed)
    }

    fn send(&mut self, udp: &Udp, to: &mut Endpoint) {
        if self.count > 0 {
            if !self.seal_all() {
                tracing::warn!(to = %to.to, "a batch could not be sealed; dropped");
            } else if let Err(e) = udp.send_batch(to, &self.buf[..self.len], self.stride) {
                tracing::debug!(to = %to.to, error = %e, "sending to a peer failed");
            }
        }
        self.len = 0;
        self.count = 0;
        self.stride = 0;
        self.closed = false;
        self.session = None;
    }

    /// Pads `segment` (`padded_len`) and hands it to `encapsulate`, for a tunnel without
    /// a usable session (which queues it and handshakes).
    fn without_session(
        &mut self,
        tunn: &mut Tunn,
        segment: &[u8],
        mtu: usize,
        udp: &Udp,
        to: &mut Endpoint,
    ) {
        let padded = padded_len(segment.len(), mtu);
        let mut buf = std::mem::take(&mut self.padded);
        buf.clear();
        buf.extend_from_slice(segment);
        buf.resize(padded.max(segment.len()), 0);
        self.handshake_path(tunn, &buf, udp, to);
        self.padded = buf;
    }

    /// Lays `segment`, padded to `padded` bytes, out as the batch's next data message
    /// (sending the batch first if it cannot join it).
    fn place(
        &mut self,
        session: &Arc<Session>,
        segment: &[u8],
        padded: usize,
        udp: &Udp,
        to: &mut Endpoint,
    ) {
        let n = padded.max(segment.len()) + OVERHEAD;
        let other_session = self
            .session
            .as_ref()
            .is_some_and(|s| !Arc::ptr_eq(s, session));
        if self.count > 0
            && (self.closed
                || other_session
                || self.count == MAX_SEGMENTS
                || self.len + n > MAX_GSO_BYTES
                || n > self.stride)
        {
            self.send(udp, to);
        }
        let start = self.len;
        let Some(msg) = self.buf.get_mut(start..start + n) else {
            return; // larger than any datagram: the segmenter never makes one
        };
        let body = &mut msg[HEADER..n - TAG];
        body[..segment.len()].copy_from_slice(segment);
        body[segment.len()..].fill(0);
        if self.count == 0 {
            self.stride = n;
        }
        self.closed = n < self.stride;
        self.len = start + n;
        self.count += 1;
        if self.session.is_none() {
            self.session = Some(session.clone());
        }
    }

    /// `encapsulate` without a session: it queues `segment` and may write a handshake
    /// initiation, which goes out on its own.
    fn handshake_path(&mut self, tunn: &mut Tunn, segment: &[u8], udp: &Udp, to: &mut Endpoint) {
        let room = (segment.len() + OVERHEAD).max(HANDSHAKE_INIT);
        let mut out = vec![0u8; room];
        match tunn.encapsulate(segment, std::time::Instant::now(), &mut out) {
            TunnResult::WriteToNetwork(out) if out.first() == Some(&4) => {
                // A session after all (an exhausted one was retired): on its own.
                let _ = udp.send(to, out);
            }
            TunnResult::WriteToNetwork(out) => {
                self.handshakes += out.len();
                let _ = udp.send(to, out);
            }
            _ => {}
        }
    }
}

/// How many reads of the TUN queue in a row may fail (a moment apart) before the device
/// ends: the sending side never stops while the process lives on.
const READ_FAILURES: u32 = 50;
const READ_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

/// Where the batch being filled goes: a batch is sent when the next packet is for another
/// peer or endpoint, when it is full, or when the TUN queue has nothing more to read at
/// once. So the segments of back-to-back super-packets share sends: a 64 KiB TCP
/// super-packet at MTU 1420 is 47 datagrams, one more than a GSO send takes, and sending
/// per read made every other send a few datagrams long.
struct Pending {
    peer: Arc<super::peers::Peer>,
    udp: Arc<Udp>,
    to: Endpoint,
    /// The local address the peer's route named before the first send.
    source: Option<super::udp::Local>,
}

impl Pending {
    fn send(mut self, batch: &mut Batch) {
        batch.send(&self.udp, &mut self.to);
        self.peer.sent(self.source, &self.to);
    }
}

/// Whether `tun` has a packet to read now.
fn readable(tun: &std::fs::File) -> bool {
    let mut fd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(tun),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call; no wait (timeout 0).
    let ready = unsafe { libc::poll(&mut fd, 1, 0) };
    ready > 0 && fd.revents & libc::POLLIN != 0
}

/// Helper threads for each packet thread's crypto: one per core past the two the sending
/// and receiving threads keep busy, at most three (`WEFT_CRYPTO_HELPERS` overrides, 0 for
/// none). On two cores none: with one helper a flow fell from 3.91 to 3.35 Gbit/s there
/// (medians of 3; every core was already busy with the flow's two ends).
pub fn crypto_helpers() -> usize {
    if let Some(n) = std::env::var("WEFT_CRYPTO_HELPERS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        return n.min(16);
    }
    std::thread::available_parallelism().map_or(0, |n| n.get().saturating_sub(2).min(3))
}

/// Splits one read (`header`, `pkt`) into segments and puts them in `batch` for `p`'s
/// peer. The session is taken under the peer's lock and used without it (the receiving
/// thread opens the peer's messages meanwhile); without a usable session the segments go
/// through `encapsulate` under the lock, which queues them and handshakes. What `split`
/// says: the segments' count, or why the read was dropped.
fn encrypt_read(
    state: &super::peers::State,
    p: &mut Pending,
    batch: &mut Batch,
    (header, pkt): (&Header, &mut [u8]),
    headers: &mut Vec<u8>,
    mtu: usize,
) -> Result<usize, segment::SplitError> {
    let peer = &p.peer;
    let session = {
        let mut noise = lock(&peer.noise);
        let Some(tunn) = state.session(&mut noise, peer) else {
            return Ok(0); // no private key yet
        };
        tunn.sending()
            .filter(|s| s.sent() < REJECT_AFTER_MESSAGES - COUNTER_MARGIN)
            .cloned()
    };
    if let Some(session) = session {
        let mut bytes = 0;
        let result = segment::split(header, pkt, headers, |seg| {
            bytes += seg.len();
            batch.place(&session, seg, padded_len(seg.len(), mtu), &p.udp, &mut p.to)
        });
        let mut noise = lock(&peer.noise);
        if let Some(tunn) = state.session(&mut noise, peer) {
            tunn.sealed(bytes, std::time::Instant::now());
        }
        return result;
    }
    let mut noise = lock(&peer.noise);
    let Some(tunn) = state.session(&mut noise, peer) else {
        return Ok(0);
    };
    let result = segment::split(header, pkt, headers, |seg| {
        batch.without_session(tunn, seg, mtu, &p.udp, &mut p.to)
    });
    noise.handshake_tx += std::mem::take(&mut batch.handshakes);
    result
}

/// Runs until the TUN device is deleted (or its queue keeps failing): then it ends the
/// device, with the reason, so the process does not live on without a sending side.
pub fn run(device: Arc<Device>, mut tun: std::fs::File, beat: super::watchdog::Beat) {
    let vnet = device.offloads.vnet;
    let mut buf = vec![0u8; vnet::LEN + 65_536];
    let mut headers = Vec::with_capacity(256);
    let mut batch = Batch::new(Pool::new("wg-seal", crypto_helpers()));
    let mut pending: Option<Pending> = None;
    let mut failures = 0;
    loop {
        // Never wait for the next packet with a batch unsent.
        if pending.is_some() && !readable(&tun) {
            if let Some(p) = pending.take() {
                p.send(&mut batch);
            }
        }
        let read = tun.read(&mut buf);
        beat.beat();
        let n = match read {
            Ok(n) => {
                failures = 0;
                n
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if super::tun::deleted(&e, &tun) => {
                device.end("its interface was deleted".into());
                return;
            }
            Err(e) => {
                failures += 1;
                if failures >= READ_FAILURES {
                    device.end(format!(
                        "reading its TUN queue failed {failures} times in a row: {e}"
                    ));
                    return;
                }
                tracing::debug!(error = %e, "TUN read failed; retrying");
                std::thread::sleep(READ_RETRY);
                continue;
            }
        };
        let (header, pkt) = if vnet {
            let Some(h) = Header::decode(&buf[..n]) else {
                continue;
            };
            (h, &mut buf[vnet::LEN..n])
        } else {
            (Header::default(), &mut buf[..n])
        };
        let Some(dst) = wg::dst_address(pkt) else {
            continue;
        };
        let state = device.state();
        let Some(peer) = state.route(dst) else {
            continue; // no peer has this address: the kernel would answer ENOKEY
        };
        let Some(route) = peer.route() else {
            continue; // no endpoint yet: nowhere to send
        };
        let udp = device.udp();
        // The batch goes on with this packet only if it is for the same peer, endpoint
        // and sockets; else what it holds goes first.
        let same = pending.as_ref().is_some_and(|p| {
            Arc::ptr_eq(&p.peer, peer)
                && Arc::ptr_eq(&p.udp, &udp)
                && p.source == route.from
                && p.to.to == route.to
        });
        if !same {
            if let Some(p) = pending.take() {
                p.send(&mut batch);
            }
        }
        let p = pending.get_or_insert_with(|| Pending {
            peer: peer.clone(),
            udp,
            to: route,
            source: route.from,
        });
        let read = (&header, pkt);
        let result = encrypt_read(&state, p, &mut batch, read, &mut headers, device.mtu());
        if let Err(e) = result {
            tracing::debug!(?e, "dropped a packet the TUN device handed over");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{padded_len, Batch, Pool};

    /// A batch with datagrams laid out but no session to seal them with is never reported
    /// sealed: sending it would put plaintext on the wire.
    #[test]
    fn a_batch_without_a_session_is_never_sealed() {
        let mut batch = Batch::new(Pool::new("test", 0));
        assert!(batch.seal_all(), "an empty batch has nothing to seal");
        batch.buf[..100].fill(0x45);
        batch.len = 100;
        batch.stride = 100;
        batch.count = 1;
        assert!(!batch.seal_all());
    }

    #[test]
    fn packets_are_padded_to_sixteen_bytes_never_past_the_mtu() {
        assert_eq!(padded_len(1, 1420), 16);
        assert_eq!(padded_len(16, 1420), 16);
        assert_eq!(padded_len(60, 1420), 64);
        assert_eq!(padded_len(1409, 1420), 1420, "not past the MTU");
        assert_eq!(padded_len(1420, 1420), 1420);
        assert_eq!(
            padded_len(1328, 1420),
            1328,
            "a narrow route's MTU stays whole"
        );
        assert_eq!(padded_len(1500, 1420), 1500, "never shortened");
        assert_eq!(padded_len(61, 0), 61, "an unknown MTU pads nothing");
    }
}
