//! The control loop's clocks and optional sources: the periodic check's interval, the
//! jittered resync and how near a key switch puts it off, sleeps that may last forever, and
//! the event sources that exist only on some nodes (polled only while present).

use std::time::{Duration, SystemTime};

use crate::keys::switch_watch;

/// The periodic resync waits while this node's announced key switch is this near (either
/// side of its moment): a full pass re-reads every link, address and route, which took up
/// to 2.8 s in the VM, and a switch that comes during it waits for its end. Seen in CI: a
/// node rotated 2.2 s late behind a resync pass and its peers' ping lost 7 in a row.
pub(super) const SWITCH_GUARD: Duration = Duration::from_secs(5);

/// A periodic check that, when one round outlasts the period (a slow machine), starts the
/// next a full period after it rather than at once: a check that is always due would keep
/// the loop from everything else it waits for.
pub(super) fn interval(period: Duration) -> tokio::time::Interval {
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval
}

/// The next event of `events` (`None` once they end); only polled while `events` is some.
pub(super) async fn next_event(events: &mut Option<tokio::sync::mpsc::Receiver<()>>) -> Option<()> {
    match events {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// The liveness watcher's next request; only polled while there is a watcher.
pub(super) async fn liveness_event(
    watcher: &mut Option<crate::liveness::Handle>,
) -> Option<crate::liveness::Event> {
    match watcher {
        Some(h) => h.events.recv().await,
        None => std::future::pending().await,
    }
}

/// The key-switch watcher's next report; only polled while there is a watcher.
pub(super) async fn switched(watcher: &mut Option<switch_watch::Handle>) -> Option<()> {
    match watcher {
        Some(h) => h.switched.recv().await,
        None => std::future::pending().await,
    }
}

/// `period`, or up to a fifth less at random (never more: a resync stays within its
/// period): agents started together (a rollout, a lab) would otherwise all resync at once,
/// each full pass slowed by the others (in the VM, three at once took 4–7 s instead of
/// 1.5–2.5 s).
pub(super) fn jittered(period: Duration) -> Duration {
    let r = weft_crypto::random_bytes::<2>().map_or(0, u16::from_be_bytes);
    period - (period / 5).mul_f64(f64::from(r) / f64::from(u16::MAX))
}

/// Whether a switch at `at` is within `SWITCH_GUARD` of `now`, before or after.
pub(super) fn switch_near(at: SystemTime, now: SystemTime) -> bool {
    let gap = match at.duration_since(now) {
        Ok(ahead) => ahead,
        Err(past) => past.duration(),
    };
    gap < SWITCH_GUARD
}

/// Sleeps for `wait`, or forever.
pub(super) async fn sleep_for(wait: Option<Duration>) {
    match wait {
        Some(wait) => tokio::time::sleep(wait).await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`, or forever.
pub(super) async fn sleep_until(at: Option<SystemTime>) {
    match at {
        Some(at) => {
            let wait = at.duration_since(SystemTime::now()).unwrap_or_default();
            tokio::time::sleep(wait).await
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resync_waits_only_near_a_key_switch() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let s = Duration::from_secs;
        assert!(switch_near(now + s(3), now), "3 s before the moment");
        assert!(
            switch_near(now - s(2), now),
            "2 s after it, the switch late"
        );
        assert!(!switch_near(now + s(30), now), "far ahead");
        // A switch stuck well past its moment (an unconfirmed announcement) holds the
        // resync no longer.
        assert!(!switch_near(now - s(6), now));
    }

    #[test]
    fn resyncs_are_spread_over_the_last_fifth_of_the_period() {
        let period = Duration::from_secs(30);
        let draws: Vec<Duration> = (0..200).map(|_| jittered(period)).collect();
        let (low, high) = (Duration::from_secs(24), period);
        assert!(draws.iter().all(|d| (low..=high).contains(d)), "{draws:?}");
        let spread = draws
            .iter()
            .max()
            .unwrap()
            .saturating_sub(*draws.iter().min().unwrap());
        assert!(spread > Duration::from_secs(4), "{spread:?}");
    }
}
