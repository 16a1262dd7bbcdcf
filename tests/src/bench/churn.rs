//! The churn phase of the control-plane benchmark: nodes added, re-keyed and removed at a
//! steady rate through the registry (etcd puts and deletes, or Node creations, annotation
//! patches and deletions on the API server), and the latency from each write to the agent's
//! log line saying the peer was added or removed.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::bail;

use super::control_plane::{ms_between, read_log, synthetic_key, tail};
use super::log_time;

/// One registry write: node id and its key generation.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    Add(u32),
    Rekey(u32, u32),
    Remove(u32),
}

/// A write as made: its kind, the key whose add or removal marks it programmed, when.
pub type Write = (&'static str, String, SystemTime);

/// Cycles add → key change → remove at `rate` per second for `span`, over nodes
/// `0..nodes` (new ones numbered from `nodes`), calling `write` for each.
pub fn schedule(
    nodes: u32,
    span: Duration,
    rate: f64,
    mut write: impl FnMut(Op) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<Write>> {
    let mut writes = Vec::new();
    let mut pool: VecDeque<(u32, u32)> = (0..nodes).map(|i| (i, 0)).collect();
    let mut next_new = nodes;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let t0 = Instant::now();
    let mut op = 0u32;
    while t0.elapsed() < span {
        if let Some(wait) = (t0 + interval * op).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let at = SystemTime::now();
        match op % 3 {
            0 => {
                write(Op::Add(next_new))?;
                writes.push(("add", synthetic_key(next_new, 0), at));
                pool.push_back((next_new, 0));
                next_new += 1;
            }
            1 => {
                let Some((id, generation)) = pool.pop_front() else {
                    break;
                };
                write(Op::Rekey(id, generation + 1))?;
                writes.push(("key change", synthetic_key(id, generation + 1), at));
                pool.push_back((id, generation + 1));
            }
            _ => {
                let Some((id, generation)) = pool.pop_front() else {
                    break;
                };
                write(Op::Remove(id))?;
                writes.push(("remove", synthetic_key(id, generation), at));
            }
        }
        op += 1;
    }
    Ok(writes)
}

/// Latencies per kind (add, remove, key change) from the agent log after `start_line`;
/// fails if a write was not programmed within 10 s.
pub fn analyse(
    log: &Path,
    start_line: usize,
    writes: &[Write],
) -> anyhow::Result<Vec<(&'static str, Vec<f64>)>> {
    let mut out: Vec<(&'static str, Vec<f64>)> =
        vec![("add", vec![]), ("remove", vec![]), ("key change", vec![])];
    for (kind, _, ms) in programmed(log, start_line, writes)? {
        if let Some(slot) = out.iter_mut().find(|(k, _)| *k == kind) {
            slot.1.push(ms);
        }
    }
    Ok(out)
}

/// Each write with its latency in ms: (kind, when written, ms); fails if a write was not
/// programmed within 10 s.
pub fn programmed(
    log: &Path,
    start_line: usize,
    writes: &[Write],
) -> anyhow::Result<Vec<(&'static str, SystemTime, f64)>> {
    // Wait until every written key shows up in the log (or give up after 10 s).
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = read_log(log);
        let last = writes
            .last()
            .map(|(_, id, _)| id.as_str())
            .unwrap_or_default();
        if text.lines().skip(start_line).any(|l| l.contains(last)) || Instant::now() > deadline {
            // The last write is in: give the pass that carried it time to log the rest.
            std::thread::sleep(Duration::from_millis(500));
            break read_log(log);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // "…: add peer NODE (KEY) endpoint …" and "…: remove peer KEY", each by key: a key is
    // added once and removed once, so adds and removals are kept apart.
    let mut added: HashMap<String, SystemTime> = HashMap::new();
    let mut removed: HashMap<String, SystemTime> = HashMap::new();
    for line in text.lines().skip(start_line) {
        let Some(at) = log_time(line) else { continue };
        if let Some(rest) = line.split(": add peer ").nth(1) {
            if let Some((key, _)) = rest.split_once(" (").and_then(|(_, r)| r.split_once(')')) {
                added.entry(key.to_string()).or_insert(at);
            }
        } else if let Some(key) = line
            .split(": remove peer ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
        {
            removed.entry(key.to_string()).or_insert(at);
        }
    }
    let seen = |kind: &str, key: &str| {
        if kind == "remove" {
            removed.get(key).copied()
        } else {
            added.get(key).copied()
        }
    };
    let mut out = Vec::new();
    for (kind, id, at) in writes {
        if let Some(done) = seen(kind, id) {
            out.push((*kind, *at, ms_between(*at, done)));
        }
    }
    let programmed = out.len();
    if programmed < writes.len() {
        let missing: Vec<String> = writes
            .iter()
            .filter(|(kind, id, _)| seen(kind, id).is_none())
            .take(3)
            .map(|(k, id, _)| format!("{k} {id}"))
            .collect();
        bail!(
            "only {programmed} of {} churn operations were programmed within 10 s; e.g. {missing:?}\n{}",
            writes.len(),
            tail(&text)
        );
    }
    Ok(out)
}
