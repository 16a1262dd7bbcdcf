//! The soak (`weft-lab bench soak [--minutes 30] [--nodes 1000] [--rate 50]`): the
//! control-plane benchmark's lab (one real agent, N synthetic nodes in etcd) under churn
//! for a long time: nodes added, re-keyed and removed at `rate` per second throughout.
//! Every minute the agent's and the userspace device process's RSS, open fds and threads
//! are sampled; the report gives each series' value before the churn, after its first
//! minute and at the end, and its slope from the first minute on (least squares, per
//! minute; flat is the target), and the churn latency p99 of the first and the last minute
//! (the target: equal). The first minute is left out of the slope: in it the agent first
//! runs the churn's code (its binary's pages are read in, about 7 MiB of RSS) and its
//! buffers reach their working size, which a short run would report as growth.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;

use super::control_plane::{
    churn_writes, device_pid, proc_field, read_log, start_lab, wait_line, Registry,
};
use super::{churn, quantile};

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
    let lab = start_lab(weft, Registry::Etcd, nodes)?;
    let log = lab.nodes[0].agent_log();
    wait_line(&log, "reconciled", 0, Duration::from_secs(120))?;
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
    let writes = churn_writes(&lab, nodes as u32, span, rate);
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
    out += &format!(
        "| churn p99 (ms) | | {:.1} (minute 1) | {:.1} (minute {minutes}) | |\n",
        p99_in(0),
        p99_in(last)
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn slopes_are_least_squares_per_step() {
        assert_eq!(super::slope(&[5.0, 5.0, 5.0]), 0.0);
        assert!((super::slope(&[1.0, 3.0, 5.0, 7.0]) - 2.0).abs() < 1e-9);
        assert_eq!(super::slope(&[4.0]), 0.0);
    }
}
