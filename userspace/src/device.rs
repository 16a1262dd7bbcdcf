//! One userspace WireGuard device: its TUN interface, UDP sockets and state, and the
//! threads that move packets (one sending, one receiving per socket, one for timers).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use super::wg::TunnResult;

use super::peers::{lock, read, write, Peer, State};
use super::tun::{Offloads, Tun};
use super::uapi::Sockets;
use super::udp::Udp;
use super::{rx, tx};

/// How often every session's timers run (handshake retries, keepalives, rekeying).
const TIMER_TICK: Duration = Duration::from_millis(250);

pub struct Device {
    pub name: String,
    /// The interface's index when the device created it: a later interface of the same
    /// name (a successor) is not this device's.
    pub index: u32,
    pub offloads: Offloads,
    /// The interface's MTU as last read (the timers refresh it): data messages are padded
    /// to a multiple of 16 bytes, never past it.
    mtu: AtomicU32,
    state: Arc<RwLock<State>>,
    udp: RwLock<Arc<Udp>>,
    /// Bumped when the sockets are replaced; receivers of older ones stop.
    generation: AtomicU64,
    /// A handle on the TUN queue for each new receiving thread.
    tun: std::fs::File,
    rebinding: Mutex<()>,
    /// Why the device cannot go on (its interface deleted, a queue or socket that keeps
    /// failing): set once by the thread that found it; the process ends on it.
    ended: Mutex<Option<String>>,
    end: tokio::sync::Notify,
    /// The packet threads' beats, which the timers thread checks.
    watchdog: super::watchdog::Watchdog,
    /// Where the receiving threads put handshake messages for the handshake thread.
    pub handshakes: super::handshakes::Queue,
    /// Deletes the interface (its name, its index) when the device stops: the caller's
    /// rtnetlink, so this crate speaks none.
    delete: fn(&str, u32),
    /// Where the peers' newest initiation timestamps are kept across a restart of the
    /// device (`replay_file`), if anywhere.
    replay_file: Option<std::path::PathBuf>,
}

impl Device {
    /// Creates the interface, binds a port (any, until one is set) and starts the threads.
    /// `delete` removes the interface when the device stops (it must delete only the
    /// interface with that index, never a successor that took its name); `replay_file`
    /// keeps the peers' newest initiation timestamps across a restart (what an earlier
    /// device saved there is taken at once).
    pub fn start(
        name: &str,
        delete: fn(&str, u32),
        replay_file: Option<std::path::PathBuf>,
    ) -> std::io::Result<Arc<Device>> {
        let tun = Tun::open(name)?;
        let index = super::ifindex(name).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("the TUN interface {name} vanished as it was created"),
            )
        })?;
        if let Err(e) = super::tun::set_mtu(name, super::tun::DEFAULT_MTU) {
            tracing::warn!(device = name, error = %e, "setting the interface's MTU failed");
        }
        let udp = Arc::new(Udp::bind(0, 0)?);
        let mut state = State::default();
        state.listen_port = udp.port;
        if let Some(path) = &replay_file {
            state.remember_saved(super::replay_file::load(path), Instant::now());
        }
        let (handshakes, queued) = super::handshakes::queue();
        let device = Arc::new(Device {
            name: name.to_string(),
            index,
            offloads: tun.offloads,
            mtu: AtomicU32::new(interface_mtu(name)),
            state: Arc::new(RwLock::new(state)),
            udp: RwLock::new(udp.clone()),
            generation: AtomicU64::new(0),
            tun: tun.try_clone()?,
            rebinding: Mutex::new(()),
            ended: Mutex::new(None),
            end: tokio::sync::Notify::new(),
            watchdog: Default::default(),
            handshakes,
            delete,
            replay_file,
        });
        tracing::info!(
            device = name,
            vnet_header = tun.offloads.vnet,
            tso = tun.offloads.tso,
            uso = tun.offloads.uso,
            udp_gso = udp.gso(),
            udp_gro = udp.gro,
            "userspace WireGuard device offloads"
        );
        let d = device.clone();
        let reader = tun.file;
        let beat = device.watchdog.watch("sending", reader.as_raw_fd());
        device.spawn(&format!("wg-tx-{name}"), move || tx::run(d, reader, beat))?;
        device.spawn_receivers(&udp, 0)?;
        let d = Arc::downgrade(&device);
        device.spawn(&format!("wg-timers-{name}"), move || timers(d))?;
        let d = Arc::downgrade(&device);
        device.spawn(&format!("wg-hs-{name}"), move || {
            handshake_thread(d, queued)
        })?;
        Ok(device)
    }

    pub fn state(&self) -> RwLockReadGuard<'_, State> {
        read(&self.state)
    }

    pub fn shared_state(&self) -> Arc<RwLock<State>> {
        self.state.clone()
    }

    pub fn udp(&self) -> Arc<Udp> {
        read(&self.udp).clone()
    }

    /// The interface's MTU (0 while unknown).
    pub fn mtu(&self) -> usize {
        self.mtu.load(Ordering::Relaxed) as usize
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Whether the interface this device created still exists, in this network namespace
    /// or another one it was moved to (`tun::attached`), and nothing has ended the device.
    pub fn interface_exists(&self) -> bool {
        lock(&self.ended).is_none() && super::tun::attached(&self.tun)
    }

    /// Ends the device for `why`: the first reason given is kept, and `ended` returns it.
    pub fn end(&self, why: String) {
        let mut ended = lock(&self.ended);
        if ended.is_none() {
            tracing::warn!(device = %self.name, why = %why, "the device cannot go on");
            *ended = Some(why);
            self.end.notify_one();
        }
    }

    /// Waits until something ends the device (`end`); returns why.
    pub async fn ended(&self) -> String {
        loop {
            if let Some(why) = lock(&self.ended).clone() {
                return why;
            }
            self.end.notified().await;
        }
    }

    /// Stops the device: its sockets close and its interface is deleted (here; one moved
    /// to another namespace goes when the process's last handle on its queue closes).
    pub fn stop(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.udp().shutdown();
        (self.delete)(&self.name, self.index);
    }

    fn spawn_receivers(self: &Arc<Self>, udp: &Arc<Udp>, generation: u64) -> std::io::Result<()> {
        for (family, socket) in [("4", &udp.v4), ("6", &udp.v6)] {
            let Some(socket) = socket else { continue };
            let fd = socket.as_raw_fd();
            let (d, u, tun) = (self.clone(), udp.clone(), self.tun.try_clone()?);
            let beat = self.watchdog.watch(&format!("IPv{family} receiving"), fd);
            self.spawn(&format!("wg-rx{family}-{}", self.name), move || {
                rx::run(d.clone(), tun, fd, (generation, beat));
                d.watchdog.unwatch(fd);
                drop(u); // the socket stays open until its receiver is done with it
            })?;
        }
        Ok(())
    }
}

/// The interface's MTU, 0 if it cannot be read (the interface is going away).
fn interface_mtu(name: &str) -> u32 {
    super::tun::mtu(name)
        .ok()
        .and_then(|m| u32::try_from(m).ok())
        .unwrap_or(0)
}

impl Device {
    /// Runs one of the device's threads. One that panics ends the device: without one of
    /// its threads a device is half-alive (it answers on its UAPI socket and moves no
    /// packets), and ending it lets the agent make it again.
    fn spawn(
        self: &Arc<Self>,
        name: &str,
        f: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<()> {
        let device = Arc::downgrade(self);
        let thread = name.to_string();
        let run = move || {
            if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                if let Some(device) = device.upgrade() {
                    device.end(format!("its thread {thread} panicked: {what}"));
                }
            }
        };
        std::thread::Builder::new()
            .name(name.chars().take(15).collect())
            .spawn(run)
            .map(|_| ())
    }
}

impl Sockets for Arc<Device> {
    fn rebind(&self, port: u16, fwmark: u32) -> std::io::Result<u16> {
        let _one_at_a_time = lock(&self.rebinding);
        let old = self.udp();
        if port == old.port && port != 0 {
            old.set_mark(fwmark)?;
            return Ok(port);
        }
        let new = Arc::new(Udp::bind_retrying(port, fwmark)?);
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        *write(&self.udp) = new.clone();
        old.shutdown();
        self.spawn_receivers(&new, generation)?;
        Ok(new.port)
    }
}

impl Device {
    /// Writes the peers' newest initiation timestamps to the replay file, if one was
    /// consumed since the last write.
    fn save_timestamps(&self) {
        let Some(path) = &self.replay_file else {
            return;
        };
        let state = self.state();
        if !state.handshaken.swap(false, Ordering::Relaxed) {
            return;
        }
        let all = state.timestamps();
        drop(state);
        if let Err(e) = super::replay_file::save(path, &all) {
            tracing::warn!(path = %path.display(), error = %e, "saving the peers' handshake timestamps failed");
        }
    }
}

/// The handshake thread's outputs: answers go out the device's current UDP sockets; it
/// delivers nothing to the TUN device.
struct Answers(Arc<Device>);

impl rx::Outputs for Answers {
    fn send(&mut self, mut to: super::udp::Endpoint, datagram: &[u8]) {
        let _ = self.0.udp().send(&mut to, datagram);
    }

    fn deliver(&mut self, _: &[u8]) {}
}

/// Works through the queued handshake messages until the device is gone.
fn handshake_thread(
    device: std::sync::Weak<Device>,
    queued: std::sync::mpsc::Receiver<super::handshakes::Job>,
) {
    let mut plain = vec![0u8; 65_536];
    loop {
        let Some(d) = device.upgrade() else { return };
        let shared = d.handshakes.shared().clone();
        drop(d);
        let Some(job) = super::handshakes::next(&queued, &shared, Duration::from_secs(1)) else {
            continue;
        };
        let Some(d) = device.upgrade() else { return };
        let mut out = Answers(d.clone());
        super::handshakes::run_job(&d.state(), &job, &shared, &mut plain, &mut out);
    }
}

/// Runs every session's timers until the device is gone.
fn timers(device: std::sync::Weak<Device>) {
    let mut buf = vec![0u8; 256];
    // The key of the peer at which the last tick's handshake budget ran out.
    let mut cursor: Option<[u8; 32]> = None;
    loop {
        std::thread::sleep(TIMER_TICK);
        let Some(device) = device.upgrade() else {
            return;
        };
        // Read by name in this namespace: an interface moved to another one keeps the
        // MTU last read here.
        let mtu = interface_mtu(&device.name);
        if mtu != 0 {
            device.mtu.store(mtu, Ordering::Relaxed);
        }
        if let Some(why) = device.watchdog.check(Instant::now()) {
            device.end(why);
        }
        device.save_timestamps();
        let mut peers: Vec<Arc<Peer>> = {
            let state = device.state();
            state.peers.values().cloned().collect()
        };

        in_turn(&mut peers, |p| p.key, cursor);
        let udp = device.udp();
        // A handshake costs three X25519 operations, and 10,000 unanswered peers retry
        // theirs every 5 s: the read lock is held for one peer at a time (held over all of
        // them, it kept a control request's write waiting, and the packet threads behind
        // it, for 100-190 ms).
        cursor = budgeted(
            &peers,
            |p| p.key,
            |peer, held| {
                let state = device.state();
                // Removed (or replaced) since the list was taken: its timers are over.
                if !state
                    .peers
                    .get(&peer.key)
                    .is_some_and(|p| Arc::ptr_eq(p, peer))
                {
                    return false;
                }
                peer_timers(&state, peer, &udp, &mut buf, held)
            },
        );
    }
}

/// Puts `items` in key order from the first after `cursor`, wrapping round: each tick
/// starts where the last one's budget ran out, so every peer has its turn.
fn in_turn<T, K: Ord + Copy>(items: &mut [T], key: impl Fn(&T) -> K, cursor: Option<K>) {
    items.sort_unstable_by_key(|i| key(i));
    let from = cursor.map_or(0, |c| items.partition_point(|i| key(i) <= c));
    items.rotate_left(from);
}

/// Runs each item's timers in order (`run(item, held)`, which says whether a handshake
/// went out); once `HANDSHAKES_PER_TICK` went out, the rest are `held`. The key of the
/// item at which the budget ran out, if it did.
fn budgeted<T, K: Copy>(
    items: &[T],
    key: impl Fn(&T) -> K,
    mut run: impl FnMut(&T, bool) -> bool,
) -> Option<K> {
    let mut handshakes = 0;
    let mut cursor = None;
    for item in items {
        let held = cursor.is_some();
        handshakes += usize::from(run(item, held));
        if !held && handshakes >= HANDSHAKES_PER_TICK {
            cursor = Some(key(item));
        }
    }
    cursor
}

/// The handshakes the timers start in one tick for peers without a session, about: past
/// it, those peers wait for the next tick, which starts where this one stopped (800 a
/// second, about an eighth of a core). Retries to thousands of peers that never answer
/// (nodes down) took 80 % of a core and starved the agent's changes. A peer with a session
/// (its keepalives and rekeys) is never held back, nor one with traffic to send: that
/// handshakes on the sending path.
const HANDSHAKES_PER_TICK: usize = 200;

/// One peer's timers: a handshake or keepalive due goes out; with `held`, only if the peer
/// has a session. Whether a handshake went out.
fn peer_timers(state: &State, peer: &Peer, udp: &Udp, buf: &mut [u8], held: bool) -> bool {
    let now = Instant::now();
    let mut noise = lock(&peer.noise);
    let session = noise.tunn.as_deref().is_some_and(|t| t.established());
    if held && !session {
        return false;
    }
    // Looked at only for a peer without a tunnel (none of an active mesh's).
    let keepalive = || lock(&peer.config).keepalive != 0 && peer.route().is_some();
    let initiate = std::mem::take(&mut noise.initiate);
    let out = if initiate || (noise.tunn.is_none() && keepalive()) {
        // A PSK or private key change: a handshake at once, whatever the timers say. So
        // does a peer with a persistent keepalive and nothing sent yet: kernel WireGuard
        // sends its first keepalive as soon as the interval is set, which is how a node
        // behind NAT opens its mapping.
        state
            .session(&mut noise, peer)
            .map(|tunn| tunn.format_handshake_initiation(now, buf, initiate))
    } else {
        noise
            .tunn
            .as_deref_mut()
            .map(|tunn| tunn.update_timers(now, buf))
    };
    let Some(TunnResult::WriteToNetwork(out)) = out else {
        return false; // no session state yet, or nothing due
    };
    let handshake = out.first() == Some(&super::rx::HANDSHAKE_INIT);
    if out.first() != Some(&super::rx::DATA) {
        noise.handshake_tx += out.len();
    }
    let _ = peer.send(udp, out);
    handshake
}

#[cfg(test)]
mod tests {
    use super::{budgeted, in_turn, HANDSHAKES_PER_TICK};

    #[test]
    fn handshakes_past_the_budget_wait_their_turn_and_sessions_never_wait() {
        // 1,000 peers: every third has a session (its timers always run; no handshake
        // here); the others handshake whenever they are let.
        let mut peers: Vec<u32> = (0..1000).rev().collect();
        let session = |p: u32| p.is_multiple_of(3);
        let mut cursor = None;
        let mut served = std::collections::BTreeMap::<u32, usize>::new();
        for tick in 0..4 {
            in_turn(&mut peers, |p| *p, cursor);
            let (mut handshakes, mut sessions_run) = (0, 0);
            cursor = budgeted(
                &peers,
                |p| *p,
                |&p, held| {
                    if session(p) {
                        sessions_run += 1;
                        return false;
                    }
                    if held {
                        return false;
                    }
                    *served.entry(p).or_default() += 1;
                    handshakes += 1;
                    true
                },
            );
            assert_eq!(handshakes, HANDSHAKES_PER_TICK, "tick {tick}");
            assert_eq!(sessions_run, 334, "tick {tick}: every session's timers ran");
        }
        // Four ticks of 200 went through the 666 without a session in turn: each once,
        // then 134 again from the lowest key; none twice before every other had its turn.
        assert_eq!(served.len(), 666);
        let twice: Vec<u32> = served
            .iter()
            .filter(|(_, n)| **n == 2)
            .map(|(p, _)| *p)
            .collect();
        assert_eq!(twice.len(), 134);
        assert_eq!(
            twice.first(),
            Some(&1),
            "the second round starts at the lowest key"
        );
        // Under the budget, nothing is held.
        assert_eq!(budgeted(&peers[..10], |p| *p, |_, held| !held), None);
    }
}
