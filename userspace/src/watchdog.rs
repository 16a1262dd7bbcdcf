//! The device's own watch on its packet threads: one that has not moved for `STALL` while
//! packets wait on its queue (its UDP socket or the TUN queue is readable) is stalled, and
//! a device with a stalled thread ends, so that the agent makes it again. Without this a
//! device whose packet loop hangs (a bug, a lock never released) answers on its UAPI
//! socket as if all were well and moves nothing. Each thread beats once per read it
//! returns from; the timers thread checks.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::peers::lock;

/// A thread this long without a beat, with packets waiting all along, is stalled.
pub const STALL: Duration = Duration::from_secs(2);

/// A thread's beat: one per read it returned from.
#[derive(Clone)]
pub struct Beat(Arc<AtomicU64>);

impl Beat {
    pub fn beat(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

struct Watched {
    name: String,
    fd: RawFd,
    beats: Arc<AtomicU64>,
    last: u64,
    stalled_since: Option<Instant>,
}

#[derive(Default)]
pub struct Watchdog {
    watched: Mutex<Vec<Watched>>,
}

/// Whether `fd` has something to read now.
fn readable(fd: RawFd) -> bool {
    let mut poll = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no waiting.
    let n = unsafe { libc::poll(&mut poll, 1, 0) };
    n > 0 && poll.revents & libc::POLLIN != 0
}

impl Watchdog {
    /// Watches the thread `name` reading `fd`, until `unwatch(fd)`; returns its beat.
    pub fn watch(&self, name: &str, fd: RawFd) -> Beat {
        let beats = Arc::new(AtomicU64::new(0));
        lock(&self.watched).push(Watched {
            name: name.to_string(),
            fd,
            beats: beats.clone(),
            last: 0,
            stalled_since: None,
        });
        Beat(beats)
    }

    /// Stops watching the thread reading `fd` (it ends, and its descriptor closes next).
    pub fn unwatch(&self, fd: RawFd) {
        lock(&self.watched).retain(|w| w.fd != fd);
    }

    /// Looks at every thread at `now`; the reason to end the device if one is stalled.
    pub fn check(&self, now: Instant) -> Option<String> {
        self.check_with(now, readable)
    }

    fn check_with(&self, now: Instant, readable: impl Fn(RawFd) -> bool) -> Option<String> {
        let mut watched = lock(&self.watched);
        for w in watched.iter_mut() {
            let beats = w.beats.load(Ordering::Relaxed);
            if beats != w.last || !readable(w.fd) {
                w.last = beats;
                w.stalled_since = None;
                continue;
            }
            let since = *w.stalled_since.get_or_insert(now);
            if now.saturating_duration_since(since) >= STALL {
                return Some(format!(
                    "its {} thread has not moved for {} s with packets waiting",
                    w.name,
                    STALL.as_secs()
                ));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_that_stops_with_packets_waiting_is_stalled_and_an_idle_one_is_not() {
        let dog = Watchdog::default();
        let busy = dog.watch("wg-rx4", 10);
        let _idle = dog.watch("wg-tx", 11);
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        // fd 10 has packets waiting throughout; fd 11 never does.
        let waiting = |fd: RawFd| fd == 10;
        // Beating: never stalled.
        for ms in (0..5000).step_by(250) {
            busy.beat();
            assert_eq!(dog.check_with(at(ms), waiting), None);
        }
        // It stops beating.
        assert_eq!(dog.check_with(at(5000), waiting), None);
        assert_eq!(dog.check_with(at(6000), waiting), None);
        let why = dog
            .check_with(at(7000), waiting)
            .expect("not found stalled");
        assert!(why.contains("wg-rx4"), "{why}");
        // Once it beats again, or its queue empties, it is not.
        busy.beat();
        assert_eq!(dog.check_with(at(7250), waiting), None);
        assert_eq!(dog.check_with(at(9500), |_| false), None);
        dog.unwatch(10);
        assert_eq!(dog.check_with(at(20_000), waiting), None);
    }
}
