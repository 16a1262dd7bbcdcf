//! Threads that take parts of a packet thread's crypto: a batch of datagrams is split
//! into parts, and the calling thread and the pool's helpers each seal or open some. The
//! caller takes any part no helper has started, so a helper that is not scheduled (every
//! core busy) costs nothing but the wake-up; `run` returns once every part is done.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// A job whose borrow `run` outlives: it is called with each part's number.
type Job = dyn Fn(usize) + Sync;

#[derive(Clone, Copy)]
struct JobRef(*const Job);
// SAFETY: the pointee is `Sync` and `run` keeps it alive until every part has returned.
unsafe impl Send for JobRef {}

#[derive(Default)]
struct Work {
    job: Option<JobRef>,
    parts: usize,
    /// The next part nobody has taken.
    next: usize,
    /// Parts taken and not finished, plus parts not taken.
    left: usize,
    /// A part of the current job panicked.
    panicked: bool,
    stop: bool,
}

#[derive(Default)]
struct Shared {
    work: Mutex<Work>,
    go: Condvar,
    done: Condvar,
}

fn lock(s: &Shared) -> MutexGuard<'_, Work> {
    s.work.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Takes the next part of the job, if any is left.
    fn take(w: &mut Work) -> Option<(JobRef, usize)> {
        let job = w.job?;
        (w.next < w.parts).then(|| {
            w.next += 1;
            (job, w.next - 1)
        })
    }

    fn finished<'a>(&'a self, mut w: MutexGuard<'a, Work>) -> MutexGuard<'a, Work> {
        w.left -= 1;
        if w.left == 0 {
            self.done.notify_all();
        }
        w
    }
}

pub struct Pool {
    shared: Arc<Shared>,
    helpers: usize,
}

impl Pool {
    /// A pool with `helpers` threads beside the caller (0: the caller does every part).
    pub fn new(name: &str, helpers: usize) -> Pool {
        let shared = Arc::new(Shared::default());
        let mut started = 0;
        for i in 0..helpers {
            let s = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || help(&s));
            match spawned {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!(error = %e, "starting a crypto helper thread failed"),
            }
        }
        Pool {
            shared,
            helpers: started,
        }
    }

    /// How many threads a batch's parts can spread over (the caller included).
    pub fn width(&self) -> usize {
        self.helpers + 1
    }

    /// Calls `job(p)` for every part `p` in `0..parts`, on this thread and the helpers;
    /// returns when all are done: true if every part returned, false if any panicked
    /// (then what the job was to produce is not to be used: a batch half sealed holds
    /// plaintext).
    #[must_use]
    pub fn run<'a>(&self, parts: usize, job: &'a (dyn Fn(usize) + Sync + 'a)) -> bool {
        if self.helpers == 0 || parts <= 1 {
            return (0..parts)
                .map(|p| catch_unwind(AssertUnwindSafe(|| job(p))).is_ok())
                .fold(true, |all, ok| all & ok);
        }
        // SAFETY (lifetime): the helpers call the job only between here and the wait for
        // `left == 0` below, and `job` outlives this call.
        let erased: *const (dyn Fn(usize) + Sync + 'a) = job;
        let erased: *const Job = unsafe { std::mem::transmute(erased) };
        {
            let mut w = lock(&self.shared);
            *w = Work {
                job: Some(JobRef(erased)),
                parts,
                next: 0,
                left: parts,
                panicked: false,
                stop: false,
            };
            self.shared.go.notify_all();
        }
        loop {
            let taken = Shared::take(&mut lock(&self.shared));
            let Some((_, p)) = taken else { break };
            // Caught here too: the helpers may still hold the job's borrow, so this call
            // must not unwind before they are done.
            let ok = catch_unwind(AssertUnwindSafe(|| job(p))).is_ok();
            let mut w = lock(&self.shared);
            w.panicked |= !ok;
            drop(self.shared.finished(w));
        }
        let mut w = lock(&self.shared);
        while w.left > 0 {
            w = self.shared.done.wait(w).unwrap_or_else(|p| p.into_inner());
        }
        w.job = None;
        !w.panicked
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        lock(&self.shared).stop = true;
        self.shared.go.notify_all();
    }
}

fn help(s: &Shared) {
    let mut w = lock(s);
    loop {
        if w.stop {
            return;
        }
        match Shared::take(&mut w) {
            Some((job, p)) => {
                drop(w);
                // SAFETY: `run` waits for this part (`left`) before the job's borrow ends.
                let f = unsafe { &*job.0 };
                let ok = catch_unwind(AssertUnwindSafe(|| f(p))).is_ok();
                if !ok {
                    tracing::error!("a crypto helper's part panicked");
                }
                let mut relocked = lock(s);
                relocked.panicked |= !ok;
                w = s.finished(relocked);
            }
            None => w = s.go.wait(w).unwrap_or_else(|p| p.into_inner()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Pool;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    #[test]
    fn every_part_runs_once_and_run_returns_after_the_last() {
        for helpers in [0, 1, 3] {
            let pool = Pool::new("test", helpers);
            for parts in [0, 1, 2, 7, 64] {
                let counts: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
                for _ in 0..200 {
                    assert!(pool.run(parts, &|p| {
                        counts[p].fetch_add(1, Ordering::Relaxed);
                    }));
                }
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 200));
            }
        }
    }

    #[test]
    fn parts_write_disjoint_halves_of_one_buffer() {
        let pool = Pool::new("test", 1);
        let mut buf = vec![0u8; 1000];
        for round in 1..=50u8 {
            let (a, b) = buf.split_at_mut(500);
            let halves = [Mutex::new(Some(a)), Mutex::new(Some(b))];
            assert!(pool.run(2, &|p| {
                if let Some(h) = halves[p].lock().unwrap().take() {
                    h.fill(round.wrapping_add(p as u8));
                }
            }));
            assert!(buf[..500].iter().all(|&x| x == round));
            assert!(buf[500..].iter().all(|&x| x == round.wrapping_add(1)));
        }
    }

    /// A part that panics, on a helper or on the calling thread, is reported: the caller
    /// never takes a half-done job for a whole one (a batch with an unsealed part holds
    /// plaintext). The pool keeps working after it.
    #[test]
    fn a_part_that_panics_is_reported_and_the_rest_still_run() {
        for helpers in [0, 1, 3] {
            let pool = Pool::new("test", helpers);
            for bad in 0..4 {
                let done = AtomicUsize::new(0);
                let ok = pool.run(4, &|p| {
                    if p == bad {
                        panic!("part {p}");
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                });
                assert!(!ok, "{helpers} helpers, part {bad}: reported");
                assert_eq!(done.load(Ordering::Relaxed), 3);
            }
            assert!(pool.run(4, &|_| {}), "{helpers} helpers: still working");
        }
    }
}
