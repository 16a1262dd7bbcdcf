//! What to do about a dead pair: the smallest repair first, a bigger one only when the
//! smaller did not bring the pair back, and then a pause that doubles, said in the log,
//! never a loop.
//!
//! 1. `Reapply`: the peer as the plan has it (key, AllowedIPs, the registry's endpoint even
//!    where WireGuard had learned another that stopped answering).
//! 2. `Rehandshake`: the peer removed and added again in one device update: its sessions
//!    start over at the next packet (a session wedged on either side is dropped). Only for
//!    a pair that has answered since the watch began: one that never did has no session to
//!    drop, and its device retries the handshake on its own every 5 s. A node whose peers
//!    are mostly down (or not up yet) removed and added thousands of them at once, and the
//!    device's handshakes to all of them started over together.
//! 3. `RecreateDevice`: only when the device itself is at fault (every pair that carries
//!    traffic is dead, or the device does not answer): re-creating it drops every session,
//!    so a single dead pair never takes the others down with it.
//!
//! A pair is given `STEP_WAIT` after each step to answer (its probe goes out at once).
//! A pair that had roamed (WireGuard learned its endpoint from its packets: a peer behind
//! a NAT) is repaired by what its own packets show: its next keepalive or handshake shows
//! its current address, but only on a session this node still holds. So unless the
//! registry's endpoint is known to be reachable (it answers path-MTU probes,
//! `Book::answering`), the re-apply keeps the learned endpoint and the pair is never
//! re-handshaken; where it is reachable, the re-apply puts it back and the pair is given
//! its keepalive interval as well before its sessions are dropped. Overwriting the
//! endpoint a natted peer roamed to with the NAT's published one, then dropping the
//! sessions, left a pair whose NAT had rebound its ports down for more than 40 s.

use std::time::{Duration, Instant};

/// How long a pair has to answer after a repair step before the next one.
pub const STEP_WAIT: Duration = Duration::from_secs(2);
/// How long a re-created device has to answer before the pause.
pub const RECREATE_WAIT: Duration = Duration::from_secs(5);
/// How long a pair dead of `cause` has to answer a re-apply: `STEP_WAIT`, and for a pair
/// that had roamed, its keepalive interval (`keepalive` seconds, 0 for none) on top.
pub fn reapply_wait(cause: &super::Cause, keepalive: u16) -> Duration {
    match cause {
        super::Cause::Unanswered { endpoint, planned } if *endpoint != Some(*planned) => {
            STEP_WAIT + Duration::from_secs(keepalive.into())
        }
        _ => STEP_WAIT,
    }
}
/// The first pause after every step failed; it doubles up to `BACKOFF_MAX`.
pub const BACKOFF_FIRST: Duration = Duration::from_secs(10);
pub const BACKOFF_MAX: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Step {
    Reapply,
    Rehandshake,
    RecreateDevice,
}

impl Step {
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Reapply => "re-apply the peer",
            Step::Rehandshake => "re-handshake",
            Step::RecreateDevice => "re-create the device",
        }
    }

    /// The label `/metrics` counts it under.
    pub fn label(self) -> &'static str {
        match self {
            Step::Reapply => "reapply",
            Step::Rehandshake => "rehandshake",
            Step::RecreateDevice => "recreate",
        }
    }
}

/// What the escalation says for a dead pair now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Wait: a step is under way, or a pause.
    Wait,
    Do(Step),
    /// Every step was tried; nothing more until `until` (a pause of `pause`).
    BackOff {
        until: Instant,
        pause: Duration,
    },
}

/// One pair's repairs in its current dead stretch.
#[derive(Debug, Clone, Default)]
pub struct Repairs {
    /// The last step, when, and how long the pair has after it to answer.
    last: Option<(Step, Instant, Duration)>,
    /// The pause to take after the next round of steps.
    pause: Option<Duration>,
    paused_until: Option<Instant>,
}

impl Repairs {
    /// For a pair dead at `now`; `device_wide`: the device is at fault (see the module);
    /// `reapply_wait`: how long the pair has to answer a re-apply (`reapply_wait`), fixed
    /// when the stretch's first step is taken; `answered`: the pair has answered since the
    /// watch began (else a re-apply is all it is given before the pause). The step
    /// returned is taken to be done at `now`.
    pub fn next(
        &mut self,
        now: Instant,
        device_wide: bool,
        reapply_wait: Duration,
        answered: bool,
    ) -> Action {
        if self.paused(now) {
            return Action::Wait;
        }
        let step = match self.last {
            None => Step::Reapply,
            Some((_, at, wait)) if now.saturating_duration_since(at) < wait => return Action::Wait,
            Some((Step::Reapply, ..)) if answered => Step::Rehandshake,
            Some((Step::Rehandshake, ..)) if device_wide => Step::RecreateDevice,
            Some(_) => return self.pause(now),
        };
        let wait = match step {
            Step::Reapply => reapply_wait.max(STEP_WAIT),
            _ => STEP_WAIT,
        };
        self.last = Some((step, now, wait));
        Action::Do(step)
    }

    /// For a device that does not answer, at `now`: re-create it, then a doubling pause
    /// between tries.
    pub fn next_device(&mut self, now: Instant) -> Action {
        if self.paused(now) {
            return Action::Wait;
        }
        match self.last {
            None => {
                self.last = Some((Step::RecreateDevice, now, RECREATE_WAIT));
                Action::Do(Step::RecreateDevice)
            }
            // The new device process has had no time to start and be configured.
            Some((_, at, wait)) if now.saturating_duration_since(at) < wait => Action::Wait,
            Some(_) => self.pause(now),
        }
    }

    /// Whether a pause is still on at `now`; one that ended starts the next round.
    fn paused(&mut self, now: Instant) -> bool {
        match self.paused_until {
            Some(until) if now < until => true,
            Some(_) => {
                self.paused_until = None;
                self.last = None;
                false
            }
            None => false,
        }
    }

    /// Every step was tried: the pause, doubled for the next time.
    fn pause(&mut self, now: Instant) -> Action {
        let pause = self.pause.unwrap_or(BACKOFF_FIRST);
        self.pause = Some((pause * 2).min(BACKOFF_MAX));
        let until = now + pause;
        self.paused_until = Some(until);
        Action::BackOff { until, pause }
    }

    /// The step that was taken last in this stretch (the one that worked, once the pair
    /// answers).
    pub fn last_step(&self) -> Option<Step> {
        self.last.map(|(s, ..)| s)
    }

    /// Whether the stretch ever got past its first round (a pause was taken).
    pub fn backed_off(&self) -> bool {
        self.pause.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn actions(device_wide: bool, seconds: u64) -> Vec<(u64, Action)> {
        actions_of(device_wide, true, seconds)
    }

    fn actions_of(device_wide: bool, answered: bool, seconds: u64) -> Vec<(u64, Action)> {
        let start = Instant::now();
        let mut r = Repairs::default();
        (0..seconds)
            .map(|s| {
                let at = start + Duration::from_secs(s);
                (s, r.next(at, device_wide, STEP_WAIT, answered))
            })
            .filter(|(_, a)| *a != Action::Wait)
            .collect()
    }

    #[test]
    fn a_pair_that_never_answered_is_reapplied_and_never_rehandshaken() {
        for device_wide in [false, true] {
            let a = actions_of(device_wide, false, 40);
            assert_eq!(a[0], (0, Action::Do(Step::Reapply)));
            assert!(matches!(a[1], (2, Action::BackOff { pause, .. }) if pause == BACKOFF_FIRST));
            assert_eq!(a[2], (12, Action::Do(Step::Reapply)));
            assert!(a
                .iter()
                .all(|(_, a)| !matches!(a, Action::Do(Step::Rehandshake | Step::RecreateDevice))));
        }
    }

    #[test]
    fn a_single_pair_is_reapplied_then_rehandshaken_then_left_alone_with_a_doubling_pause() {
        let a = actions(false, 60);
        let steps: Vec<(u64, Option<Step>)> = a
            .iter()
            .map(|(s, a)| {
                (
                    *s,
                    match a {
                        Action::Do(step) => Some(*step),
                        _ => None,
                    },
                )
            })
            .collect();
        assert_eq!(
            steps,
            vec![
                (0, Some(Step::Reapply)),
                (2, Some(Step::Rehandshake)),
                (4, None), // pause 10 s
                (14, Some(Step::Reapply)),
                (16, Some(Step::Rehandshake)),
                (18, None), // pause 20 s
                (38, Some(Step::Reapply)),
                (40, Some(Step::Rehandshake)),
                (42, None), // pause 40 s
            ]
        );
        assert!(matches!(a[2].1, Action::BackOff { pause, .. } if pause == BACKOFF_FIRST));
        assert!(matches!(a[5].1, Action::BackOff { pause, .. } if pause == BACKOFF_FIRST * 2));
        // Never the device for one pair.
        assert!(!a
            .iter()
            .any(|(_, a)| *a == Action::Do(Step::RecreateDevice)));
    }

    #[test]
    fn a_device_at_fault_is_recreated_after_the_smaller_steps() {
        let a = actions(true, 8);
        assert_eq!(
            a,
            vec![
                (0, Action::Do(Step::Reapply)),
                (2, Action::Do(Step::Rehandshake)),
                (4, Action::Do(Step::RecreateDevice)),
                (6, a[3].1),
            ]
        );
        assert!(matches!(a[3].1, Action::BackOff { .. }));
    }

    #[test]
    fn the_pause_stops_doubling_at_its_bound() {
        let start = Instant::now();
        let mut r = Repairs::default();
        let mut pauses = Vec::new();
        for s in 0..4000 {
            if let Action::BackOff { pause, .. } =
                r.next(start + Duration::from_secs(s), false, STEP_WAIT, true)
            {
                pauses.push(pause.as_secs());
            }
        }
        assert_eq!(&pauses[..6], &[10, 20, 40, 80, 160, 300]);
        assert!(pauses[6..].iter().all(|p| *p == 300));
        assert!(r.backed_off());
    }
}
