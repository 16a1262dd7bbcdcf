//! A gateway's relay: it carries the WireGuard datagrams of pairs whose two nodes cannot
//! reach each other (private nodes in two zones behind NATs) without holding any of their
//! keys, so it never sees their packets in clear. Each end sets the peer's endpoint to the
//! relay's address; the relay is invisible to WireGuard otherwise, and works the same for
//! kernel WireGuard and the userspace device on either end.
//!
//! `table` decides where each datagram goes (pure); this module owns the UDP sockets: one
//! receiving thread per family, reading GRO batches and forwarding each run of datagrams
//! for one destination as one GSO send (`crate::udp`), with large socket buffers. The
//! table is saved to a tmpfs file (`persist`) once a second when it changed and when the
//! relay stops, and loaded at start: a gateway whose agent restarts keeps carrying.

mod limit;
pub mod persist;
pub mod table;

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::udp::{self, Endpoint, Udp};
pub use table::{Drop as DropReason, Member, PairBytes, Table};

/// The relay's default UDP port.
pub const DEFAULT_PORT: u16 = 51824;
/// How often a receiving thread wakes with nothing received, to expire and save.
const TICK: Duration = Duration::from_millis(500);
const SAVE_EVERY: Duration = Duration::from_secs(1);
const SAVE_ANYWAY: Duration = Duration::from_secs(10);
const DROPS: [DropReason; 7] = [
    DropReason::NotWireguard,
    DropReason::Limited,
    DropReason::UnknownResponder,
    DropReason::NoRoute,
    DropReason::Loop,
    DropReason::Full,
    DropReason::Taken,
];

/// What the relay has done since it started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub datagrams: u64,
    pub bytes: u64,
    pub routes: usize,
    pub members: usize,
    /// Datagrams dropped, by reason (`DropReason::label`).
    pub dropped: Vec<(&'static str, u64)>,
    pub pairs: Vec<PairBytes>,
    /// Routes loaded from the state file at start.
    pub restored: usize,
}

struct Shared {
    table: Mutex<Table>,
    udp: Udp,
    stop: AtomicBool,
    state: Option<PathBuf>,
    datagrams: AtomicU64,
    bytes: AtomicU64,
    dropped: [AtomicU64; 7],
    restored: usize,
    saved: Mutex<Instant>,
}

impl Shared {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn drop_count(&self, why: DropReason) {
        if let Some(i) = DROPS.iter().position(|d| *d == why) {
            self.dropped[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Expires old routes; saves the table when it changed and a second has passed (or
    /// `now_or_never`).
    fn housekeeping(&self, force: bool) {
        let now = Instant::now();
        let text = {
            let mut t = self.table();
            t.expire(now);
            let mut saved = self.saved.lock().unwrap_or_else(|p| p.into_inner());
            let since = now.saturating_duration_since(*saved);
            // Changed routes within a second; the refreshed lifetimes of routes in use at
            // least every `SAVE_ANYWAY`.
            let due = force || (since >= SAVE_EVERY && t.take_dirty()) || since >= SAVE_ANYWAY;
            if self.state.is_none() || !due {
                return;
            }
            *saved = now;
            persist::render(&t, now)
        };
        if let Some(path) = &self.state {
            if let Err(e) = persist::save(path, &text) {
                tracing::warn!(path = %path.display(), error = %e, "relay: saving its routes");
            }
        }
    }
}

/// A running relay; dropping it saves its routes and stops its threads.
pub struct Relay {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Relay {
    /// Binds `port` (0: any) on every family this host has and starts forwarding; with
    /// `state`, loads the routes saved there and saves them there.
    pub fn start(port: u16, state: Option<PathBuf>) -> std::io::Result<Relay> {
        let udp = Udp::bind_retrying(port, 0)?;
        let now = Instant::now();
        let mut table = Table::new(now);
        let restored = state
            .as_deref()
            .map_or(0, |p| persist::load(p, &mut table, now));
        let shared = Arc::new(Shared {
            table: Mutex::new(table),
            udp,
            stop: AtomicBool::new(false),
            state,
            datagrams: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            dropped: Default::default(),
            restored,
            saved: Mutex::new(now),
        });
        let mut threads = Vec::new();
        for v6 in [false, true] {
            let socket = if v6 { &shared.udp.v6 } else { &shared.udp.v4 };
            let Some(socket) = socket else { continue };
            socket.set_read_timeout(Some(TICK))?;
            let fd = socket.as_raw_fd();
            let shared = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(if v6 { "relay-v6" } else { "relay-v4" }.into())
                    .spawn(move || receive_loop(&shared, fd))?,
            );
        }
        tracing::info!(
            port = shared.udp.port,
            restored,
            gro = shared.udp.gro,
            gso = shared.udp.gso(),
            "relay: forwarding"
        );
        Ok(Relay { shared, threads })
    }

    pub fn port(&self) -> u16 {
        self.shared.udp.port
    }

    /// The nodes it may carry datagrams to.
    pub fn set_members(&self, members: &[Member]) {
        self.shared.table().set_members(members);
    }

    pub fn stats(&self) -> Stats {
        let t = self.shared.table();
        Stats {
            datagrams: self.shared.datagrams.load(Ordering::Relaxed),
            bytes: self.shared.bytes.load(Ordering::Relaxed),
            routes: t.routes(),
            members: t.members(),
            dropped: DROPS
                .iter()
                .zip(&self.shared.dropped)
                .map(|(d, n)| (d.label(), n.load(Ordering::Relaxed)))
                .collect(),
            pairs: t.pair_bytes(),
            restored: self.shared.restored,
        }
    }
}

impl std::ops::Drop for Relay {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.udp.shutdown();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.shared.housekeeping(true);
    }
}

fn receive_loop(shared: &Shared, fd: std::os::fd::RawFd) {
    let mut buf = vec![0u8; 1 << 16];
    let mut cmsg = udp::cmsg_buffer();
    let mut to: Vec<Option<SocketAddr>> = Vec::with_capacity(udp::MAX_SEGMENTS);
    let mut failed = false;
    while !shared.stop.load(Ordering::Relaxed) {
        match udp::receive(fd, &mut buf, &mut cmsg) {
            Ok(None) => break,
            Ok(Some(batch)) => {
                forward(
                    shared,
                    &buf[..batch.len],
                    batch.segment,
                    batch.from,
                    &mut to,
                );
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => {
                if shared.stop.load(Ordering::Relaxed) {
                    break;
                }
                if !failed {
                    tracing::warn!(error = %e, "relay: receiving");
                    failed = true;
                }
            }
        }
        shared.housekeeping(false);
    }
}

/// Forwards one receive (`data`: datagrams of `segment` bytes but the last, from `from`):
/// each run of datagrams for one destination in one send.
fn forward(
    shared: &Shared,
    data: &[u8],
    segment: usize,
    from: SocketAddr,
    to: &mut Vec<Option<SocketAddr>>,
) {
    let segment = segment.max(1);
    to.clear();
    {
        let now = Instant::now();
        let mut t = shared.table();
        for msg in data.chunks(segment) {
            match t.route(from, msg, now) {
                Ok(dest) => to.push(Some(dest)),
                Err(why) => {
                    shared.drop_count(why);
                    to.push(None);
                }
            }
        }
    }
    let mut i = 0;
    while i < to.len() {
        let Some(dest) = to[i] else {
            i += 1;
            continue;
        };
        let mut j = i + 1;
        while j < to.len() && to[j] == Some(dest) {
            j += 1;
        }
        let run = &data[i * segment..(j * segment).min(data.len())];
        let mut ep = Endpoint::to(dest);
        match shared.udp.send_batch(&mut ep, run, segment) {
            Ok(()) => {
                shared
                    .datagrams
                    .fetch_add((j - i) as u64, Ordering::Relaxed);
                shared.bytes.fetch_add(run.len() as u64, Ordering::Relaxed);
            }
            Err(e) => tracing::debug!(to = %dest, error = %e, "relay: sending"),
        }
        i = j;
    }
}

#[cfg(test)]
mod tests;
