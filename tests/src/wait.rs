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

/// Set by the VM runner for every scenario it runs: the CPU is emulated (tens of times
/// slower than this machine's), so timing bounds take their emulated value.
pub const EMULATED_ENV: &str = "WEFT_LAB_EMULATED";

/// Whether this run is under the VM runner's emulated CPU.
pub fn emulated() -> bool {
    std::env::var_os(EMULATED_ENV).is_some()
}

/// A timing bound: `native` on this machine, `emulated` in the VM. Each test names both
/// next to the claim it checks (the docs state the VM's figures apart).
pub fn bound<T>(native: T, emulated: T) -> T {
    if self::emulated() {
        emulated
    } else {
        native
    }
}
