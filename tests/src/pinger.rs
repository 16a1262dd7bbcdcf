//! A steady ping from one pod to another whose replies can be read while it runs: when a
//! request sent after a moment was first answered (traffic back after a fault), whether any was missed in
//! a stretch (a pair that a repair must not disturb), and the totals at the end.

use std::io::BufRead;
use std::net::IpAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use crate::traffic::{longest_hole, ping_reply, ping_summary, Hole};

/// Now, in seconds since the Unix epoch (ping's `-D` clock).
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// Now, in milliseconds since the Unix epoch (the unit of an announced switch moment).
pub fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis()
}

type Replies = Arc<Mutex<Vec<(u64, f64)>>>;

pub struct Pinger {
    child: Child,
    replies: Replies,
    reader: JoinHandle<String>,
    interval: Duration,
}

/// What a finished ping saw.
#[derive(Debug, Clone)]
pub struct PingLog {
    pub sent: u64,
    pub received: u64,
    pub longest_hole: Option<Hole>,
}

impl Pinger {
    /// Pings `to` from network namespace `from` every `interval`.
    pub fn start(from: &str, to: impl Into<IpAddr>, interval: Duration) -> anyhow::Result<Pinger> {
        let mut child = Command::new("ip")
            .args(["netns", "exec", from, "ping", "-D", "-O", "-W", "1", "-i"])
            .arg(format!("{:.3}", interval.as_secs_f64()))
            .arg(to.into().to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let out = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("ping's output was not piped"))?;
        let replies: Replies = Arc::default();
        let seen = replies.clone();
        let reader = std::thread::spawn(move || {
            let mut rest = String::new();
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                match ping_reply(&line) {
                    Some(r) => {
                        if let Ok(mut v) = seen.lock() {
                            v.push(r);
                        }
                    }
                    None if line.contains("no answer yet") => {}
                    None => {
                        rest.push_str(&line);
                        rest.push('\n');
                    }
                }
            }
            rest
        });
        Ok(Pinger {
            child,
            replies,
            reader,
            interval,
        })
    }

    fn replies(&self) -> Vec<(u64, f64)> {
        self.replies.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Echo requests left unanswered among those sent between `from` and `to` (Unix
    /// seconds), judged by the replies' sequence numbers: 0 when nothing was lost then.
    pub fn lost_between(&self, from: f64, to: f64) -> u64 {
        let replies = self.replies();
        let within: Vec<u64> = replies
            .iter()
            .filter(|(_, at)| *at >= from && *at <= to)
            .map(|(seq, _)| *seq)
            .collect();
        let (Some(first), Some(last)) = (within.iter().min(), within.iter().max()) else {
            // Nothing answered in the stretch: every request sent in it was lost.
            return ((to - from) / self.interval.as_secs_f64()).floor() as u64;
        };
        (last - first + 1).saturating_sub(within.len() as u64)
    }

    /// The first request that was surely sent after `t`: past the last one answered by
    /// then, and past a second's worth more (replies to requests sent before `t` may
    /// still be on their way: on a slow path, for longer than the interval).
    fn first_sent_after(&self, t: f64) -> u64 {
        let answered_by_then = self
            .replies()
            .iter()
            .filter(|(_, at)| *at <= t)
            .map(|(seq, _)| *seq)
            .max();
        let in_flight = (1.0 / self.interval.as_secs_f64()).ceil() as u64;
        answered_by_then.map_or(0, |last| last + 1 + in_flight)
    }

    /// Waits until a request sent after `t` is answered (`first_sent_after`); how long
    /// after `t` that was: traffic back after a fault made, or lifted, at `t`.
    pub fn wait_reply_after(&self, t: f64, limit: Duration) -> Option<Duration> {
        let deadline = std::time::Instant::now() + limit;
        let first = self.first_sent_after(t);
        loop {
            let answered = self
                .replies()
                .iter()
                .filter(|(seq, _)| *seq >= first)
                .map(|(_, at)| *at)
                .reduce(f64::min);
            if let Some(at) = answered {
                return Some(Duration::from_secs_f64((at - t).max(0.0)));
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn finish(mut self) -> anyhow::Result<PingLog> {
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        self.child.wait()?;
        let replies = self.replies.clone();
        let text = self
            .reader
            .join()
            .map_err(|_| anyhow::anyhow!("reading ping's output panicked"))?;
        let (sent, received) = ping_summary(&text)
            .ok_or_else(|| anyhow::anyhow!("ping printed no summary: {text:?}"))?;
        let replies = replies.lock().map(|v| v.clone()).unwrap_or_default();
        Ok(PingLog {
            sent: sent as u64,
            received: received as u64,
            longest_hole: longest_hole(replies),
        })
    }
}
