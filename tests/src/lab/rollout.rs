//! A backend change rolled out node by node, as a DaemonSet's rolling update with
//! `maxUnavailable: 1` does: the config changed in the registry, then each agent stopped
//! (SIGTERM) and started again, `pace` apart (or once the one before is ready, if later).
//! Through it, every ordered pair of nodes' first pods pings at 10 pps, each pair's echoes
//! carrying a pattern that names the pair; a capture of the underlay and a watch of the
//! leases (who publishes an encrypting backend, from when) tell which pairs were in clear
//! and when.

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};

use super::capture::{records, UnderlayCapture};
use super::Lab;
use crate::traffic::{longest_hole, ping_reply, ping_summary};

/// The pings' interval: 10 a second.
const INTERVAL: Duration = Duration::from_millis(100);
/// The pattern's first bytes; then `<from>-<to>-` and padding: 16 bytes in all.
const TAG: &str = "roll:";

/// How the rollout goes.
#[derive(Debug, Clone)]
pub struct Rollout {
    /// The new `Backend` object of the config.
    pub backend: serde_json::Value,
    /// Between two restarts, at least.
    pub pace: Duration,
    /// Nodes from this index on are not restarted until `stall` has passed (a rollout
    /// stopped halfway); `None`: none stalls.
    pub stall: Option<(usize, Duration)>,
    /// Run once the stall has begun (what an operator looks at meanwhile).
    pub at_stall: Option<fn(&Lab) -> anyhow::Result<()>>,
}

/// One ordered pair's pings over the rollout.
#[derive(Debug, Clone)]
pub struct PairFigures {
    pub from: usize,
    pub to: usize,
    pub sent: usize,
    pub received: usize,
    /// The longest run of unanswered pings, as time.
    pub longest_gap: Duration,
    /// When each unanswered ping between two answered ones was sent (Unix seconds).
    pub lost_at: Vec<f64>,
}

impl PairFigures {
    pub fn loss(&self) -> f64 {
        if self.sent == 0 {
            return 1.0;
        }
        1.0 - self.received as f64 / self.sent as f64
    }
}

/// A pair's echo seen in clear on the underlay.
#[derive(Debug, Clone)]
pub struct ClearPacket {
    pub from: usize,
    pub to: usize,
    pub at: SystemTime,
}

/// What a rollout did.
#[derive(Debug)]
pub struct RolloutReport {
    pub pairs: Vec<PairFigures>,
    pub clear: Vec<ClearPacket>,
    /// Per node, the moments its lease began or stopped publishing an encrypting backend
    /// (`true`: from then on it publishes one), as the watch of the leases saw them.
    pub encrypting: Vec<Vec<(SystemTime, bool)>>,
    pub took: Duration,
    /// When each node's agent was stopped for its restart, in the order of the rollout.
    pub restarts: Vec<SystemTime>,
}

impl RolloutReport {
    pub fn longest_gap(&self) -> Duration {
        self.pairs
            .iter()
            .map(|p| p.longest_gap)
            .max()
            .unwrap_or_default()
    }

    pub fn worst_loss(&self) -> f64 {
        self.pairs.iter().map(PairFigures::loss).fold(0.0, f64::max)
    }

    /// Whether node `i` published an encrypting backend at `at`.
    pub fn encrypting_at(&self, i: usize, at: SystemTime) -> bool {
        self.encrypting[i]
            .iter()
            .take_while(|(t, _)| *t <= at)
            .last()
            .is_some_and(|(_, e)| *e)
    }

    /// When node `i` last began publishing an encrypting backend at or before `at`, if it
    /// publishes one then.
    fn encrypting_since(&self, i: usize, at: SystemTime) -> Option<SystemTime> {
        let upto: Vec<&(SystemTime, bool)> = self.encrypting[i]
            .iter()
            .take_while(|(t, _)| *t <= at)
            .collect();
        match upto.last() {
            Some((_, true)) => upto
                .iter()
                .rev()
                .take_while(|(_, e)| *e)
                .last()
                .map(|(t, _)| *t),
            _ => None,
        }
    }

    /// How long after both its ends published an encrypting backend each clear echo was
    /// seen, at most (zero if none was): the time a node takes to read its peer's move and
    /// move the pair. An echo whose end stops publishing one within `lag` after it (the
    /// lease watch reads every 100 ms, and sees a change late) counts as zero.
    pub fn clear_lateness(&self, lag: Duration) -> (Duration, Option<String>) {
        let mut worst = (Duration::ZERO, None);
        for p in &self.clear {
            let (Some(a), Some(b)) = (
                self.encrypting_since(p.from, p.at),
                self.encrypting_since(p.to, p.at),
            ) else {
                continue;
            };
            let stops_soon = [p.from, p.to].iter().any(|&i| {
                self.encrypting[i]
                    .iter()
                    .any(|(t, e)| !*e && *t > p.at && *t <= p.at + lag)
            });
            if stops_soon {
                continue;
            }
            let late = p.at.duration_since(a.max(b)).unwrap_or_default();
            if late > worst.0 {
                worst = (late, Some(format!("{} -> {}", p.from, p.to)));
            }
        }
        worst
    }

    /// The pairs seen in clear, each with its first and last clear echo.
    pub fn clear_pairs(&self) -> BTreeMap<(usize, usize), (SystemTime, SystemTime)> {
        let mut pairs: BTreeMap<(usize, usize), (SystemTime, SystemTime)> = BTreeMap::new();
        for p in &self.clear {
            let e = pairs.entry((p.from, p.to)).or_insert((p.at, p.at));
            e.0 = e.0.min(p.at);
            e.1 = e.1.max(p.at);
        }
        pairs
    }
}

impl std::fmt::Display for RolloutReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rollout of {:.1} s: longest gap of any pair {} ms, worst pair's loss {:.1} %, {} clear echoes over {} pairs, the last {} ms after both its ends encrypted",
            self.took.as_secs_f64(),
            self.longest_gap().as_millis(),
            self.worst_loss() * 100.0,
            self.clear.len(),
            self.clear_pairs().len(),
            self.clear_lateness(Duration::from_secs(1)).0.as_millis()
        )
    }
}

/// The pattern of pair `from -> to`'s echoes: 16 bytes, as `ping -p` takes them (hex).
fn pattern(from: usize, to: usize) -> String {
    let text = format!("{TAG}{from}-{to}-");
    let padded = format!("{text:_<16}");
    padded
        .bytes()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The pair a frame's echo names, if it carries a pattern.
fn pair_in(frame: &[u8]) -> Option<(usize, usize)> {
    let at = frame.windows(TAG.len()).position(|w| w == TAG.as_bytes())?;
    let rest = frame.get(at + TAG.len()..at + 16)?;
    let text = std::str::from_utf8(rest).ok()?;
    let mut parts = text.split('-');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Every lease's "publishes an encrypting backend", read every 100 ms.
struct LeaseWatch {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Vec<(SystemTime, bool)>>>,
}

fn encrypting(lease: &serde_json::Value) -> bool {
    let kinds = ["wireguard", "ipsec"];
    let primary = lease["BackendType"]
        .as_str()
        .is_some_and(|t| kinds.contains(&t));
    let also = lease["WeftAlso"]
        .as_object()
        .is_some_and(|m| m.keys().any(|k| kinds.contains(&k.as_str())));
    primary || also
}

/// The longest prefix all of `keys` share.
fn common_prefix(keys: &[String]) -> String {
    let Some(first) = keys.first() else {
        return String::new();
    };
    let mut len = first.len();
    for k in keys {
        len = len.min(
            first
                .bytes()
                .zip(k.bytes())
                .take_while(|(a, b)| a == b)
                .count(),
        );
    }
    first[..len].to_string()
}

impl LeaseWatch {
    fn start(lab: &Lab) -> anyhow::Result<LeaseWatch> {
        let keys: Vec<String> = (0..lab.nodes.len())
            .map(|i| lab.lease_key(i).context("a node's lease key"))
            .collect::<anyhow::Result<_>>()?;
        let etcd = lab.etcd().ctl();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen: Vec<Vec<(SystemTime, bool)>> = vec![Vec::new(); keys.len()];
            // All the leases in one read: `get --prefix` prints key and value lines.
            let prefix = common_prefix(&keys);
            loop {
                let read = Instant::now();
                let text = etcd.run(&["get", "--prefix", &prefix]).unwrap_or_default();
                let at = SystemTime::now();
                let mut lines = text.lines();
                while let (Some(key), Some(value)) = (lines.next(), lines.next()) {
                    let Some(i) = keys.iter().position(|k| k == key) else {
                        continue;
                    };
                    let Ok(value) = serde_json::from_str::<serde_json::Value>(value) else {
                        continue;
                    };
                    let now = encrypting(&value);
                    if seen[i].last().map(|(_, e)| *e) != Some(now) {
                        seen[i].push((at, now));
                    }
                }
                if stopped.load(Ordering::Relaxed) {
                    return seen;
                }
                std::thread::sleep(Duration::from_millis(100).saturating_sub(read.elapsed()));
            }
        });
        Ok(LeaseWatch { stop, thread })
    }

    fn finish(self) -> anyhow::Result<Vec<Vec<(SystemTime, bool)>>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the lease watch panicked"))
    }
}

/// Every ordered pair's 10 pps ping.
struct PairPings {
    pings: Vec<(usize, usize, Child, PathBuf)>,
}

impl PairPings {
    fn start(lab: &Lab) -> anyhow::Result<PairPings> {
        let mut pings = Vec::new();
        // Pairs by the nodes' places in the lab (0, 1, …).
        for (ia, a) in lab.nodes.iter().enumerate() {
            for (ib, b) in lab.nodes.iter().enumerate().filter(|(ib, _)| *ib != ia) {
                let (Some(from), Some(to)) = (a.pods.first(), b.pods.first()) else {
                    continue;
                };
                let out = lab.dir().join(format!("rollout-{ia}-{ib}.ping"));
                let child = Command::new("ip")
                    .args([
                        "netns", "exec", &from.ns, "ping", "-n", "-D", "-O", "-i", "0.1",
                    ])
                    .args(["-p", &pattern(ia, ib)])
                    .arg(to.ip.to_string())
                    .stdout(fs::File::create(&out)?)
                    .stderr(Stdio::null())
                    .spawn()
                    .context("starting a pair's ping")?;
                pings.push((ia, ib, child, out));
            }
        }
        Ok(PairPings { pings })
    }

    fn finish(mut self) -> anyhow::Result<Vec<PairFigures>> {
        let mut figures = Vec::new();
        for (from, to, mut child, out) in std::mem::take(&mut self.pings) {
            super::run(Command::new("kill").args(["-INT", &child.id().to_string()]))?;
            child.wait()?;
            let text = fs::read_to_string(&out).unwrap_or_default();
            let (sent, received) = ping_summary(&text)
                .with_context(|| format!("{from} -> {to}'s ping printed no summary"))?;
            let replies: Vec<(u64, f64)> = text.lines().filter_map(ping_reply).collect();
            // Unanswered at the start or the end count too: as holes from the edges.
            let first = replies.iter().map(|r| r.0).min().unwrap_or(sent as u64 + 1);
            let last = replies.iter().map(|r| r.0).max().unwrap_or(0);
            let edges = (first.saturating_sub(1)).max((sent as u64).saturating_sub(last));
            let mut sorted = replies.clone();
            sorted.sort_by_key(|r| r.0);
            let lost_at = sorted
                .windows(2)
                .flat_map(|w| (1..w[1].0 - w[0].0).map(move |k| w[0].1 + 0.1 * k as f64))
                .collect();
            let hole = longest_hole(replies).map_or(0, |h| h.pings).max(edges);
            figures.push(PairFigures {
                from,
                to,
                sent,
                received,
                longest_gap: INTERVAL * hole as u32,
                lost_at,
            });
        }
        Ok(figures)
    }
}

impl Drop for PairPings {
    fn drop(&mut self) {
        for (_, _, child, _) in &mut self.pings {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Lab {
    /// Rolls the config's backend out to `rollout.backend` node by node (see the module
    /// doc), each pair pinging throughout; returns once every node runs it, its old
    /// backend's devices are gone from every node (`gone`), and every pair answers.
    pub fn roll_out(&mut self, rollout: &Rollout, gone: &[&str]) -> anyhow::Result<RolloutReport> {
        self.assert_all_pairs();
        let capture = UnderlayCapture::start(self)?;
        let leases = LeaseWatch::start(self)?;
        let pings = PairPings::start(self)?;
        let started = Instant::now();
        // Settled pings before the change.
        std::thread::sleep(Duration::from_secs(1));
        let conf = serde_json::json!({
            "Network": "10.244.0.0/16",
            "SubnetMax": "10.244.199.0",
            "Backend": rollout.backend,
        });
        let key = format!("{}/config", self.cfg.etcd_prefix);
        self.etcd().etcdctl(&["put", &key, &conf.to_string()])?;
        let kind = rollout.backend["Type"]
            .as_str()
            .unwrap_or("wireguard")
            .to_string();
        let mut restarts = Vec::new();
        for i in 0..self.nodes.len() {
            let restarted = Instant::now();
            if let Some((_, stall)) = rollout.stall.filter(|(at, _)| *at == i) {
                let looked = Instant::now();
                if let Some(look) = rollout.at_stall {
                    look(self)?;
                }
                std::thread::sleep(stall.saturating_sub(looked.elapsed()));
            }
            restarts.push(SystemTime::now());
            self.stop_agent(i, "TERM")?;
            // A node another agent ran (flanneld) comes back as the lab's weft.
            self.cfg.launchers.remove(&i);
            self.start_agent(i)?;
            let published = crate::wait::first_within(
                crate::wait::bound(Duration::from_secs(20), Duration::from_secs(60)),
                || {
                    self.published_lease(i)
                        .filter(|l| l["BackendType"] == kind.as_str())
                        .map(|_| ())
                },
            );
            if published.is_none() {
                bail!("node {i} did not publish {kind}:\n{}", self.logs());
            }
            if i + 1 < self.nodes.len() {
                std::thread::sleep(rollout.pace.saturating_sub(restarted.elapsed()));
            }
        }
        // Done: every node's old devices retired, every pair answering.
        for i in 0..self.nodes.len() {
            for dev in gone {
                let ns = self.nodes[i].ns.clone();
                let left = crate::wait::first_within(
                    crate::wait::bound(Duration::from_secs(30), Duration::from_secs(60)),
                    || {
                        super::fabric::in_ns(&ns, &format!("ip link show {dev}"))
                            .is_err()
                            .then_some(())
                    },
                );
                if left.is_none() {
                    bail!(
                        "{dev} still on node {i} after the rollout:\n{}",
                        self.logs()
                    );
                }
            }
        }
        self.assert_all_pairs();
        // A second of settled pings after it.
        std::thread::sleep(Duration::from_secs(1));
        let took = started.elapsed();
        let pairs = pings.finish()?;
        let encrypting = leases.finish()?;
        let (_, bytes) = capture.finish_with_bytes()?;
        let clear = records(&bytes)?
            .into_iter()
            .filter_map(|r| {
                let (from, to) = pair_in(r.frame)?;
                Some(ClearPacket { from, to, at: r.at })
            })
            .collect();
        Ok(RolloutReport {
            pairs,
            clear,
            encrypting,
            took,
            restarts,
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_pattern_names_its_pair_in_16_bytes() {
        let hex = super::pattern(3, 12);
        assert_eq!(hex.len(), 32);
        let bytes: Vec<u8> = (0..16)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let mut frame = vec![0u8; 40];
        frame.extend(&bytes);
        frame.extend(&bytes);
        assert_eq!(super::pair_in(&frame), Some((3, 12)));
        assert_eq!(super::pair_in(b"nothing here"), None);
    }
}
