//! Waiting in a test for a condition, never for a fixed time.

use std::time::{Duration, Instant};

/// Polls `ok` every 20 ms until it holds; returns how long that took. Panics naming `what`
/// once `limit` has passed.
pub fn until(what: &str, limit: Duration, ok: impl FnMut() -> bool) -> Duration {
    until_or(what, limit, ok, String::new)
}

/// As `until`; the panic message ends with `context()` (the agents' logs, say).
pub fn until_or(
    what: &str,
    limit: Duration,
    mut ok: impl FnMut() -> bool,
    context: impl FnOnce() -> String,
) -> Duration {
    let started = Instant::now();
    while !ok() {
        if started.elapsed() >= limit {
            panic!("{what}: not within {limit:?}\n{}", context());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    started.elapsed()
}
