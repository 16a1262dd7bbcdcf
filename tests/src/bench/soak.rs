//! The soak (`weft-lab bench soak [--minutes 30] [--nodes 1000] [--rate 50]`): the
//! control-plane benchmark's lab (two real agents, N synthetic nodes in etcd) under churn
//! for a long time: nodes added, re-keyed and removed at `rate` per second throughout,
//! while a pod on the measured node streams TCP and pings (100 a second) a pod on the
//! other, and the other node rotates its key halfway through.
//! Every minute the measured agent's and its userspace device process's RSS, open fds and
//! threads are sampled; the report gives each series' value before the churn, after its
//! first minute and at the end, and its slope from the first minute on (least squares, per
//! minute), and the churn latency p99 of the first and the last minute. The first minute
//! is left out of the slope: in it the agent first runs the churn's code (its binary's
//! pages are read in, about 7 MiB of RSS) and its buffers reach their working size, which
//! a short run would report as growth.
//!
//! It fails (and says which) unless: fds and threads end where they were after the first
//! minute; RSS grows by at most `RSS_SLOPE_KIB` a minute; the last minute's churn p99 is
//! at most `P99_GROWTH` times the first's; and the pod traffic kept going (no reset, at
//! most `PINGS_LOST` pings lost, the rotation included).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;

use super::control_plane::{
    churn_writes, device_pid, proc_field, read_log, start_lab_with, wait_line, Registry,
};
use super::{churn, quantile};
use crate::traffic::{Disruption, Probe};

/// The RSS growth a minute (agent and device each) the soak allows from minute 1 on: twice
/// the 28 KiB a minute measured (BENCHMARKS.md).
const RSS_SLOPE_KIB: f64 = 64.0;
/// How much the last minute's churn p99 may exceed the first's.
const P99_GROWTH: f64 = 1.5;
/// Pings the pod traffic may lose over the whole soak, the key rotation included (twice
/// the rotation's claim, docs/key-rotation.md).
const PINGS_LOST: u64 = 6;

/// One process's use of the machine at one moment.
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    rss_kib: u64,
    fds: u64,
    threads: u64,
}

fn usage(pid: u32) -> Usage {
    Usage {
        rss_kib: proc_field(pid, "VmRSS:"),
        fds: std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64),
        threads: proc_field(pid, "Threads:"),
    }
}

/// Least-squares slope of `ys` over their index.
fn slope(ys: &[f64]) -> f64 {
    let n = ys.len() as f64;
    if ys.len() < 2 {
        return 0.0;
    }
    let mean_x = (n - 1.0) / 2.0;
    let mean_y = ys.iter().sum::<f64>() / n;
    let (mut num, mut den) = (0.0, 0.0);
    for (x, y) in ys.iter().enumerate() {
        let dx = x as f64 - mean_x;
        num += dx * (y - mean_y);
        den += dx * dx;
    }
    num / den
}

pub fn run(weft: &Path, nodes: usize, minutes: u64, rate: f64) -> anyhow::Result<String> {
    let lab = start_lab_with(weft, Registry::Etcd, nodes, 2)?;
    let log = lab.nodes[0].agent_log();
    wait_line(&log, "reconciled", 0, Duration::from_secs(120))?;
    let (pairs, unreachable) = lab.all_pairs(Duration::from_secs(30));
    if !unreachable.is_empty() {
        anyhow::bail!(
            "{} of {pairs} pod pairs unreachable: {unreachable:?}",
            unreachable.len()
        );
    }
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    let probe = Probe::start(&a.ns, &b.ns, b.ip)?;
    let pid = lab.agent_pid(0).context("the agent's pid")?;
    let device = device_pid(pid).context("the userspace device process")?;
    let start_line = read_log(&log).lines().count();

    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut samples = Vec::new();
            let t0 = Instant::now();
            let mut next = t0;
            while !stop.load(Ordering::Relaxed) {
                if Instant::now() >= next {
                    samples.push((usage(pid), usage(device)));
                    next += Duration::from_secs(60);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            samples.push((usage(pid), usage(device)));
            samples
        })
    };
    let t0 = SystemTime::now();
    let span = Duration::from_secs(minutes * 60);
    let mut rotate = lab.node_shell(1, &format!("{} keys rotate", weft.display()));
    let rotation = std::thread::spawn(move || {
        std::thread::sleep(span / 2);
        crate::lab::run(&mut rotate).map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
    });
    let writes = churn_writes(&lab, nodes as u32, span, rate);
    let rotated = match rotation.join() {
        Ok(r) => r.context("the key rotation halfway")?,
        Err(_) => anyhow::bail!("the rotation thread panicked"),
    };
    let traffic = probe.finish()?;
    stop.store(true, Ordering::Relaxed);
    let samples = sampler
        .join()
        .map_err(|_| anyhow::anyhow!("the sampler panicked"))?;
    let done = churn::programmed(&log, start_line, &writes?)?;

    let minute_of = |at: SystemTime| at.duration_since(t0).map_or(0, |d| d.as_secs() / 60);
    let p99_in = |m: u64| {
        let ms: Vec<f64> = done
            .iter()
            .filter(|(_, at, _)| minute_of(*at) == m)
            .map(|(_, _, ms)| *ms)
            .collect();
        quantile(&ms, 0.99).unwrap_or(f64::NAN)
    };
    let last = minutes.saturating_sub(1);
    let mut out = format!(
        "Soak: {nodes} nodes, churn {rate}/s for {minutes} min ({} operations, all programmed), \
         {} samples\n\n| Series | before churn | after minute 1 | last | slope per minute from \
         minute 1 |\n| --- | ---: | ---: | ---: | ---: |\n",
        done.len(),
        samples.len()
    );
    type Pick = fn(&(Usage, Usage)) -> u64;
    let series: [(&str, Pick); 6] = [
        ("agent RSS (KiB)", |s| s.0.rss_kib),
        ("agent open fds", |s| s.0.fds),
        ("agent threads", |s| s.0.threads),
        ("device RSS (KiB)", |s| s.1.rss_kib),
        ("device open fds", |s| s.1.fds),
        ("device threads", |s| s.1.threads),
    ];
    for (name, pick) in series {
        let ys: Vec<f64> = samples.iter().map(|s| pick(s) as f64).collect();
        let warm = ys.get(1..).unwrap_or_default();
        out += &format!(
            "| {name} | {} | {} | {} | {:+.2} |\n",
            ys.first().copied().unwrap_or(0.0),
            warm.first().copied().unwrap_or(0.0),
            ys.last().copied().unwrap_or(0.0),
            slope(warm)
        );
    }
    let (p99_first, p99_last) = (p99_in(0), p99_in(last));
    out += &format!(
        "| churn p99 (ms) | | {p99_first:.1} (minute 1) | {p99_last:.1} (minute {minutes}) | |\n\n\
         Pod traffic, node 1 to node 2, through the churn and node 2's key rotation \
         ({}): {traffic}\n",
        rotated.lines().last().unwrap_or_default().trim()
    );
    let failed = verdict(&samples, (p99_first, p99_last), &traffic);
    if !failed.is_empty() {
        anyhow::bail!("{out}\nThe soak failed:\n- {}", failed.join("\n- "));
    }
    Ok(out + "\nEvery bound held: fds and threads flat, RSS growth, churn p99, pod traffic.\n")
}

/// What the soak's bounds say about a run (empty: every one held).
fn verdict(samples: &[(Usage, Usage)], p99: (f64, f64), traffic: &Disruption) -> Vec<String> {
    let mut failed = Vec::new();
    let warm = samples.get(1..).unwrap_or_default();
    for (who, pick) in [
        (
            "agent",
            (|s: &(Usage, Usage)| s.0) as fn(&(Usage, Usage)) -> Usage,
        ),
        ("device", |s| s.1),
    ] {
        let series: Vec<Usage> = warm.iter().map(pick).collect();
        let (Some(first), Some(last)) = (series.first(), series.last()) else {
            failed.push("too few samples (run at least 2 minutes)".into());
            return failed;
        };
        if (first.fds, first.threads) != (last.fds, last.threads) {
            failed.push(format!(
                "{who}: fds {} -> {}, threads {} -> {} (flat expected)",
                first.fds, last.fds, first.threads, last.threads
            ));
        }
        let rss: Vec<f64> = series.iter().map(|u| u.rss_kib as f64).collect();
        let growth = slope(&rss);
        if growth > RSS_SLOPE_KIB {
            failed.push(format!(
                "{who}: RSS grows {growth:+.1} KiB a minute (at most {RSS_SLOPE_KIB})"
            ));
        }
    }
    // A minute without a p99 (NaN) fails too.
    let held = p99.1 <= p99.0 * P99_GROWTH;
    if !held {
        failed.push(format!(
            "churn p99 {:.1} ms in the last minute against {:.1} ms in the first (at most {P99_GROWTH}x)",
            p99.1, p99.0
        ));
    }
    if traffic.stream_error.is_some() || traffic.pings_lost > PINGS_LOST {
        failed.push(format!(
            "pod traffic: {traffic} (no reset, at most {PINGS_LOST} pings lost)"
        ));
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(rss_kib: u64, fds: u64) -> (Usage, Usage) {
        let u = Usage {
            rss_kib,
            fds,
            threads: 3,
        };
        (u, u)
    }

    #[test]
    fn the_verdict_names_each_bound_broken() {
        let calm = Disruption {
            stream_bytes: 1,
            max_stall: Duration::ZERO,
            stall_from_unix_s: None,
            stream_error: None,
            pings_sent: 1000,
            pings_lost: 2,
            longest_hole: None,
        };
        let flat = [at(100, 9), at(200, 9), at(210, 9), at(220, 9)];
        assert!(verdict(&flat, (20.0, 25.0), &calm).is_empty());
        let leaky = [at(100, 9), at(200, 9), at(400, 10), at(600, 11)];
        let lossy = Disruption {
            pings_lost: 40,
            ..calm.clone()
        };
        let failed = verdict(&leaky, (20.0, 45.0), &lossy);
        assert_eq!(failed.len(), 6, "{failed:?}");
        assert!(
            verdict(&flat, (f64::NAN, 1.0), &calm).len() == 1,
            "no p99 is a failure"
        );
    }

    #[test]
    fn slopes_are_least_squares_per_step() {
        assert_eq!(super::slope(&[5.0, 5.0, 5.0]), 0.0);
        assert!((super::slope(&[1.0, 3.0, 5.0, 7.0]) - 2.0).abs() < 1e-9);
        assert_eq!(super::slope(&[4.0]), 0.0);
    }
}
