//! The receiving side: read a GRO batch of datagrams from a UDP socket, find each data
//! message's peer by the receiver index in its header, decrypt, check the inner source
//! against the peer's AllowedIPs, and write the packets to the TUN device, TCP segments of
//! one flow coalesced into one write. A run of data messages for one session takes the
//! session once (`rx_data`). Handshake messages go to the handshake thread's queue
//! (`handshakes`): no Diffie-Hellman runs here.

use std::io::Write;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;

use super::coalesce::Coalescer;
use super::device::Device;
use super::handshakes::{self, is_handshake, Queue};
use super::peers::State;
use super::pool::Pool;
use super::udp::{self, Endpoint, Local};
use super::vnet;
use super::wg::ratelimit::Limiter;
use super::wg::session::{index_of, is_data};

/// The message types a thread outside this module tells apart by their first byte.
pub(super) const DATA: u8 = 4;
pub(super) const HANDSHAKE_INIT: u8 = 1;

/// Where the receiving side's output goes: datagrams back to the network (handshake
/// answers, cookie replies, queued packets) and packets to the TUN device (as the device
/// takes them: with a vnet header when it has them). The device's own is its UDP
/// sockets and TUN queue; the fuzz targets' is a sink.
pub trait Outputs {
    fn send(&mut self, to: Endpoint, datagram: &[u8]);
    fn deliver(&mut self, packet: &[u8]);
}

/// The device's outputs: its current UDP sockets and one TUN queue.
struct DeviceOutputs {
    device: Arc<Device>,
    tun: std::fs::File,
}

impl Outputs for DeviceOutputs {
    fn send(&mut self, mut to: Endpoint, datagram: &[u8]) {
        let _ = self.device.udp().send(&mut to, datagram);
    }

    fn deliver(&mut self, pkt: &[u8]) {
        let out = if self.device.offloads.vnet {
            pkt
        } else {
            &pkt[vnet::LEN..]
        };
        if let Err(e) = self.tun.write(out) {
            tracing::debug!(error = %e, "TUN write failed");
        }
    }
}

/// The receiving side of one socket: decryption and coalescing buffers, its outputs, and
/// the crypto helpers a long run of data messages is opened with.
pub struct Receiver<O> {
    out: O,
    plain: Vec<u8>,
    coalescer: Coalescer,
    pool: Pool,
    /// Where handshake messages go: the device's handshake thread; without one (the
    /// tests, the fuzz targets), they are handled here, never under load.
    handshakes: Option<Queue>,
    limiter: Limiter,
}

impl<O: Outputs> Receiver<O> {
    /// A receiver writing to `out`; `vnet`: the TUN device takes GSO writes (without, no
    /// segments are merged).
    pub fn new(out: O, vnet: bool) -> Self {
        Self::with_helpers(out, vnet, super::tx::crypto_helpers())
    }

    /// Sends handshake messages to the handshake thread's queue.
    pub fn with_queue(mut self, queue: Queue) -> Self {
        self.handshakes = Some(queue);
        self
    }

    /// A receiver whose long runs of data messages are opened by this many helper threads
    /// beside it.
    pub fn with_helpers(out: O, vnet: bool, helpers: usize) -> Self {
        Receiver {
            out,
            plain: vec![0u8; 65_536],
            coalescer: Coalescer::new(vnet),
            pool: Pool::new("wg-open", helpers),
            handshakes: None,
            limiter: Limiter::default(),
        }
    }

    /// Whether a packet is being coalesced, which `flush` would write.
    pub fn holding(&self) -> bool {
        self.coalescer.holds()
    }

    /// Writes the packet being coalesced, if any: `batch` keeps it open for the next
    /// batch's segments of the same flow (the sender's super-packets span GSO sends), so
    /// this must come before the receiver waits for more.
    pub fn flush(&mut self) {
        let out = &mut self.out;
        self.coalescer.flush(&mut |pkt: &[u8]| out.deliver(pkt));
    }

    /// A handshake or cookie message: queued for the handshake thread.
    fn control(&mut self, state: &State, datagram: &[u8], from: (SocketAddr, Option<Local>)) {
        if !is_handshake(datagram) {
            return;
        }
        match &self.handshakes {
            Some(queue) => queue.push(datagram, from),
            None => handshakes::handle(
                state,
                datagram,
                from,
                (false, &self.limiter),
                &mut self.plain,
                &mut self.out,
            ),
        }
    }

    /// Handles the datagrams of one receive from `from` (to this host's `local` address,
    /// when known), against the device's `state`: `buf` holds them back to back, each
    /// `segment` bytes but the last (0: one datagram). The last TCP segment delivered
    /// may be held for the next batch to continue (`flush` writes it).
    pub fn batch(
        &mut self,
        state: &State,
        buf: &mut [u8],
        segment: usize,
        from: (SocketAddr, Option<Local>),
    ) {
        let segment = if segment == 0 {
            buf.len().max(1)
        } else {
            segment
        };
        let total = buf.len();
        let end_of = |at: usize| (at + segment).min(total);
        let mut at = 0;
        while at < buf.len() {
            let datagram_at = |at: usize| &buf[at..end_of(at)];
            let d = datagram_at(at);
            if !is_data(d) {
                self.control(state, d, from);
                at += d.len();
                continue;
            }
            // The run of data messages for the same session.
            let r = index_of(d);
            let mut end = at + d.len();
            while end < buf.len() && is_data(datagram_at(end)) && index_of(datagram_at(end)) == r {
                end += datagram_at(end).len();
            }
            if let Some(peer) = state.by_receiver(r).cloned() {
                let run = &mut buf[at..end];
                if self.pool.width() > 1 && run.len() >= data::SPLIT_RUN * segment {
                    self.data_run_split(state, (&peer, r), run, segment, from);
                } else {
                    self.data_run(state, (&peer, r), run, segment, from);
                }
            }
            at = end;
        }
    }
}

/// How many receives in a row may fail before the device ends (each failure past the
/// first few waits a moment, so a socket that keeps failing never spins a core).
const RECEIVE_FAILURES: u32 = 200;
const RECEIVE_RETRY: std::time::Duration = std::time::Duration::from_millis(10);

/// Runs until `fd`'s socket is shut down for a newer one (`generation` moved on). A socket
/// shut down under it otherwise, or one that keeps failing, ends the device with the
/// reason: the process does not live on without a receiving side.
pub fn run(
    device: Arc<Device>,
    tun: std::fs::File,
    fd: RawFd,
    (generation, beat): (u64, super::watchdog::Beat),
) {
    let vnet = device.offloads.vnet;
    let out = DeviceOutputs {
        device: device.clone(),
        tun,
    };
    let mut rx = Receiver::new(out, vnet).with_queue(device.handshakes.clone());
    let mut buf = vec![0u8; 65_536];
    let mut cmsg = udp::cmsg_buffer();
    let mut failures = 0;
    // Whether a packet is being coalesced: then the next receive does not wait, and
    // what was coalesced goes out when nothing more is there (or the receive fails).
    let mut holding = false;
    loop {
        let received = if holding {
            udp::receive_now(fd, &mut buf, &mut cmsg)
        } else {
            udp::receive(fd, &mut buf, &mut cmsg)
        };
        beat.beat();
        if device.generation() != generation {
            return;
        }
        if holding && received.is_err() {
            rx.flush();
            holding = false;
            if received
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock)
            {
                continue;
            }
        }
        match received {
            Ok(Some(b)) => {
                failures = 0;
                if b.len > 0 {
                    let from = (b.from, b.local);
                    rx.batch(&device.state(), &mut buf[..b.len], b.segment, from);
                    // Only a TCP segment being coalesced waits on the next receive: a
                    // ping, a handshake or anything written at once costs no extra call.
                    holding = rx.holding();
                }
            }
            Ok(None) => {
                device.end("its UDP socket was shut down".into());
                return;
            }
            // Destroyed from outside (`ss -K`): it says so once, then never receives again.
            Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => {
                device.end(format!("its UDP socket was destroyed: {e}"));
                return;
            }
            Err(e) => {
                failures += 1;
                if failures >= RECEIVE_FAILURES {
                    device.end(format!(
                        "receiving on its UDP socket failed {failures} times in a row: {e}"
                    ));
                    return;
                }
                tracing::debug!(error = %e, "UDP receive failed");
                if failures > 3 {
                    std::thread::sleep(RECEIVE_RETRY);
                }
            }
        }
    }
}

#[path = "rx_data.rs"]
mod data;

#[cfg(test)]
#[path = "rx_tests.rs"]
mod tests;
