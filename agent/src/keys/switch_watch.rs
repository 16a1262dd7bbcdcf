//! The key-switch watcher: a thread of its own that, while a peer's announced key is near
//! its moment (the plan's `KeyWatch`), reads the device every `HANDSHAKE_POLL` and, as
//! soon as the next key has handshaken, moves the peer's AllowedIPs to it in one device
//! update (`WgImpl::move_to_next_key`). Until then the rotating node's packets arrive on
//! an entry that may not carry them, so every millisecond here is traffic lost; the
//! control loop's passes, `nft` runs and a slow registry never delay it, because it runs
//! beside the loop on its own device connection and reads nothing else.
//!
//! What it switched is shared with the loop (`Switched`): the key is recorded before the
//! device is changed, and a pass reads the devices before it reads the record, so a pass
//! that sees the moved AllowedIPs also plans with the next key and never moves them back.
//! The loop is then woken, and its pass removes the entry of the key being left.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};
use weft_backends::apply::wireguard::devices::WgImpl;
use weft_backends::model::{KeyMove, KeyWatch};
use weft_crypto::PublicKey;

/// Peers' next keys the watcher has switched to, shared with the control loop.
#[derive(Clone, Default)]
pub struct Switched(Arc<Mutex<BTreeSet<PublicKey>>>);

impl Switched {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<PublicKey>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records `key` as switched to; false if it already was.
    pub fn insert(&self, key: PublicKey) -> bool {
        self.lock().insert(key)
    }

    pub fn contains(&self, key: &PublicKey) -> bool {
        self.lock().contains(key)
    }

    /// Forgets every key not in `announced` (a rotation that ended), and returns the rest.
    pub fn keep_only(&self, announced: &[PublicKey]) -> BTreeSet<PublicKey> {
        let mut keys = self.lock();
        keys.retain(|k| announced.contains(k));
        keys.clone()
    }
}

/// The loop's end of the watcher.
pub struct Handle {
    /// The last plan's watch.
    pub watch: watch::Sender<Option<KeyWatch>>,
    /// Told after each switch.
    pub switched: mpsc::Receiver<()>,
}

impl Handle {
    /// Hands the watcher the plan's watch (if it changed).
    pub fn follow(&self, watch: Option<&KeyWatch>) {
        self.watch.send_if_modified(|w| {
            let changed = w.as_ref() != watch;
            if changed {
                *w = watch.cloned();
            }
            changed
        });
    }
}

/// Starts the watcher on a thread of its own, on device handle `wg` (see
/// `Dataplane::another_wg_handle`); it ends when the handle is dropped.
pub fn spawn(wg: WgImpl, switched: Switched) -> std::io::Result<Handle> {
    let (watch_tx, watch_rx) = watch::channel(None);
    let (done_tx, done_rx) = mpsc::channel(16);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("key-switch".into())
        .spawn(move || {
            raise_priority();
            runtime.block_on(run(wg, watch_rx, switched, done_tx))
        })?;
    Ok(Handle {
        watch: watch_tx,
        switched: done_rx,
    })
}

/// The niceness of the watcher's thread: its reads are what a rotation's loss waits on, and
/// it works only while a switch is near (a read every `HANDSHAKE_POLL`, a few hundred
/// microseconds each). Under a starved CPU (the VM's emulation) it saw a handshake 226 ms
/// late at the default, a hole of 15 pings at 100 pps.
const NICE: libc::c_int = -10;

/// Gives the calling thread `NICE` (Linux: a thread's own priority, by its thread id).
/// Without the privilege (CAP_SYS_NICE) it keeps the default, said once at debug.
fn raise_priority() {
    // SAFETY: gettid and setpriority take and return plain integers.
    let done = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, NICE)
    };
    if done != 0 {
        debug!(
            error = %std::io::Error::last_os_error(),
            "the key-switch watcher keeps the default priority"
        );
    }
}

async fn run(
    mut wg: WgImpl,
    mut plan: watch::Receiver<Option<KeyWatch>>,
    switched: Switched,
    tell: mpsc::Sender<()>,
) {
    // When the device was last read: the watch's own schedule (`KeyWatch::next_poll`)
    // says when to read it next.
    let mut last = None;
    loop {
        let current = plan.borrow_and_update().clone();
        let now = SystemTime::now();
        let due = current.as_ref().and_then(|w| w.next_poll(last, now));
        if let (Some(w), Some(at)) = (&current, due) {
            if at <= now {
                if poll(&mut wg, w, &switched).await {
                    let _ = tell.try_send(());
                }
                last = Some(now);
                continue;
            }
        }
        let wait = due.map(|at| at.duration_since(now).unwrap_or_default());
        tokio::select! {
            changed = plan.changed() => if changed.is_err() {
                return;
            },
            () = sleep_for(wait) => {}
        }
    }
}

async fn sleep_for(wait: Option<Duration>) {
    match wait {
        Some(wait) => tokio::time::sleep(wait).await,
        None => std::future::pending().await,
    }
}

/// One read of each device with a pending switch; switches every next key found
/// handshaken. True if one was.
async fn poll(wg: &mut WgImpl, watch: &KeyWatch, switched: &Switched) -> bool {
    let pending: Vec<&KeyMove> = watch
        .moves
        .iter()
        .filter(|m| !switched.contains(&m.next.public_key))
        .collect();
    let devices: BTreeSet<&str> = pending.iter().map(|m| m.device.as_str()).collect();
    let mut any = false;
    for device in devices {
        let handshakes = match wg.handshakes(device).await {
            Ok(h) => h,
            Err(e) => {
                debug!(error = %e, device, "reading handshakes for a key switch");
                continue;
            }
        };
        for moved in pending.iter().filter(|m| m.device == device) {
            if let Some(at) = handshakes.get(&moved.next.public_key) {
                switch(wg, moved, *at, switched).await;
                any = true;
            }
        }
    }
    any
}

async fn switch(wg: &mut WgImpl, moved: &KeyMove, handshake: Duration, switched: &Switched) {
    // Recorded first: a pass reading the device after the change plans with the key.
    switched.insert(moved.next.public_key);
    let started = Instant::now();
    let result = wg.move_to_next_key(moved).await;
    let now = SystemTime::now();
    // Signed: a clock behind the rotating node's sees the handshake before the moment.
    let since = |t: SystemTime| match now.duration_since(t) {
        Ok(d) => d.as_millis() as i64,
        Err(e) => -(e.duration().as_millis() as i64),
    };
    let handshake_at = SystemTime::UNIX_EPOCH + handshake;
    let (node, key) = (&moved.next.node, moved.next.public_key);
    match result {
        Ok(()) => info!(
            node = %node,
            device = %moved.device,
            key = %key,
            cause = "handshake",
            since_handshake_ms = since(handshake_at),
            since_moment_ms = since(moved.announced),
            update_ms = started.elapsed().as_millis(),
            "switched to a peer's next key"
        ),
        Err(e) => warn!(
            node = %node,
            key = %key,
            error = %e,
            "switching to a peer's next key on its handshake failed; the next pass does it"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's niceness.
    fn own_nice() -> libc::c_int {
        // SAFETY: gettid and getpriority take and return plain integers.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
    }

    #[test]
    fn the_watcher_thread_runs_at_a_higher_priority_where_allowed() {
        let (before, after) = std::thread::spawn(|| {
            let before = own_nice();
            raise_priority();
            (before, own_nice())
        })
        .join()
        .unwrap();
        // SAFETY: geteuid takes nothing.
        if unsafe { libc::geteuid() } == 0 {
            assert_eq!(after, NICE, "before: {before}");
        } else {
            assert!(after == before || after == NICE);
        }
        // Only that thread: this one keeps its own.
        assert_ne!(own_nice(), NICE);
    }
}
