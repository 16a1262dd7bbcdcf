//! Waiting in a test for a condition, never for a fixed time; and watching a window in
//! which something must not happen all through it.

use std::time::{Duration, Instant};

/// Polls `ok` until it holds; returns how long that took. Panics naming `what` once `limit`
/// has passed. Between checks it waits 20 ms, or as long as the last check took if that was
/// longer: a check that starts processes (`wg show`, `nft list`: 0.1 s and more each under
/// the VM's emulation) then takes at most half a CPU from the agents it waits for.
pub fn until(what: &str, limit: Duration, ok: impl FnMut() -> bool) -> Duration {
    until_or(what, limit, ok, String::new)
}

/// As `until`; the panic message ends with `context()` (the agents' logs, say).
pub fn until_or(
    what: &str,
    limit: Duration,
    ok: impl FnMut() -> bool,
    context: impl FnOnce() -> String,
) -> Duration {
    let started = Instant::now();
    if !holds_within(limit, ok) {
        panic!("{what}: not within {limit:?}\n{}", context());
    }
    started.elapsed()
}

/// Polls `ok` as `until` does; whether it held before `limit` passed (it does not panic).
pub fn holds_within(limit: Duration, mut ok: impl FnMut() -> bool) -> bool {
    first_within(limit, || ok().then_some(())).is_some()
}

/// Polls `read` until it gives a value, and returns it. Panics naming `what` once `limit`
/// has passed.
pub fn found<T>(what: &str, limit: Duration, read: impl FnMut() -> Option<T>) -> T {
    found_or(what, limit, read, String::new)
}

/// As `found`; the panic message ends with `context()` (the last value read, the agents'
/// logs, say).
pub fn found_or<T>(
    what: &str,
    limit: Duration,
    read: impl FnMut() -> Option<T>,
    context: impl FnOnce() -> String,
) -> T {
    first_within(limit, read)
        .unwrap_or_else(|| panic!("{what}: not within {limit:?}\n{}", context()))
}

/// Polls `read` as `until` does; the first value it gives before `limit` passed.
pub fn first_within<T>(limit: Duration, mut read: impl FnMut() -> Option<T>) -> Option<T> {
    let started = Instant::now();
    loop {
        let check = Instant::now();
        if let Some(value) = read() {
            return Some(value);
        }
        if started.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(check.elapsed().max(Duration::from_millis(20)));
    }
}

/// As `until`, in async code: between checks it sleeps on the runtime's clock, so the
/// tasks it waits for (a registry on the same runtime) go on meanwhile.
pub async fn until_async(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    found_async(what, limit, || std::future::ready(ok().then_some(()))).await;
    started.elapsed()
}

/// As `found`, in async code: `read` gives a future (an etcd read, say).
pub async fn found_async<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    limit: Duration,
    mut read: impl FnMut() -> F,
) -> T {
    let started = Instant::now();
    loop {
        let check = Instant::now();
        if let Some(value) = read().await {
            return value;
        }
        if started.elapsed() >= limit {
            panic!("{what}: not within {limit:?}");
        }
        tokio::time::sleep(check.elapsed().max(Duration::from_millis(20))).await;
    }
}

/// Checks `ok` for the whole of `span`, as often as `until` does (and once more at its
/// end); panics naming `what` and when at the first check that fails. A window in which
/// something must not happen is watched all through it, not read once at its end.
pub fn throughout(what: &str, span: Duration, ok: impl FnMut() -> bool) {
    throughout_or(what, span, ok, String::new)
}

/// As `throughout`; the panic message ends with `context()` (the agents' logs, say).
pub fn throughout_or(
    what: &str,
    span: Duration,
    mut ok: impl FnMut() -> bool,
    context: impl FnOnce() -> String,
) {
    let started = Instant::now();
    if holds_within(span, || !ok()) {
        panic!(
            "{what}: failed {:?} into {span:?}\n{}",
            started.elapsed(),
            context()
        );
    }
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::panic::AssertUnwindSafe;
    use std::time::{Duration, Instant};

    /// The message a test's panic carried.
    fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
        payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default()
    }

    #[test]
    fn a_window_that_holds_is_checked_until_its_end() {
        let (started, mut checks) = (Instant::now(), 0);
        super::throughout("always", Duration::from_millis(200), || {
            checks += 1;
            true
        });
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(checks >= 4, "{checks} checks");
    }

    #[test]
    fn found_returns_the_first_value_read_and_panics_naming_what_it_waited_for() {
        let mut reads = 0;
        let value = super::found("the third read", Duration::from_secs(5), || {
            reads += 1;
            (reads == 3).then_some(reads * 10)
        });
        assert_eq!((value, reads), (30, 3));
        let (started, gave_up) = (Instant::now(), Cell::new(None));
        let failed = std::panic::catch_unwind(AssertUnwindSafe(|| {
            super::found_or(
                "nothing",
                Duration::from_millis(100),
                || None::<()>,
                || {
                    gave_up.set(Some(started.elapsed()));
                    "the last read".into()
                },
            )
        }));
        let message = failed.expect_err("a read that never gives a value passed");
        let text = panic_text(message);
        assert!(text.starts_with("nothing: not within 100ms"), "{text}");
        assert!(text.ends_with("the last read"), "{text}");
        assert_gave_up_soon(gave_up.get(), Duration::from_millis(100));
    }

    #[test]
    fn a_failure_inside_the_window_ends_it_there() {
        let (started, gave_up) = (Instant::now(), Cell::new(None));
        let failed = std::panic::catch_unwind(AssertUnwindSafe(|| {
            super::throughout_or(
                "flag",
                Duration::from_secs(10),
                || started.elapsed() < Duration::from_millis(100),
                || {
                    gave_up.set(Some(started.elapsed()));
                    String::new()
                },
            )
        }));
        let message = failed.expect_err("the failing check passed");
        let text = panic_text(message);
        assert!(text.starts_with("flag: failed"), "{text}");
        assert_gave_up_soon(gave_up.get(), Duration::from_millis(100));
    }

    /// The wait ended at `due` or within a second of it (its polls are 20 ms apart; the
    /// margin is for a loaded machine), not at the end of its window. Timed when the message's context is
    /// read, before the panic: a panic hook that prints a symbolized backtrace
    /// (`RUST_BACKTRACE=1`, as in CI) takes more than a second on its own.
    fn assert_gave_up_soon(gave_up: Option<Duration>, due: Duration) {
        let after = gave_up.expect("the wait gave up without reading its context");
        assert!(
            after >= due && after < due + Duration::from_secs(1),
            "gave up {after:?} in, due at {due:?}"
        );
    }
}
