//! The control-plane benchmark's table (medians of the runs of each size) and its targets:
//! `--check` names every target a run missed, and the command then fails, so a change
//! that makes the agent slower or bigger is seen.

use super::control_plane::{ControlPlane, Registry};
use super::{median, quantile};

/// One size's runs, as the table shows them: each figure the median of the runs' own.
pub struct Summary {
    pub registry: Registry,
    pub nodes: usize,
    pub runs: usize,
    pub cold_ms: f64,
    pub first_pass_writes: u64,
    /// The most any run's steady-state pass wrote (the target is 0 in every run).
    pub steady_writes: u64,
    pub steady_pass_ms: f64,
    pub agent_rss_mib: f64,
    pub device_rss_mib: f64,
    pub idle_cpu_percent: f64,
    pub churn_rate: f64,
    /// Per operation kind: operations in all runs, median of the runs' p50 and p99 (ms).
    pub churn: Vec<(&'static str, usize, f64, f64)>,
}

fn mid(values: impl Iterator<Item = f64>) -> f64 {
    median(&values.collect::<Vec<_>>()).unwrap_or(f64::NAN)
}

/// The summary of `runs`, all of one registry and size; `None` when there are none.
pub fn summarize(runs: &[ControlPlane]) -> Option<Summary> {
    let first = runs.first()?;
    let mib = |kib: u64| kib as f64 / 1024.0;
    let churn = first
        .churn
        .iter()
        .map(|(kind, _)| {
            let of_kind = |r: &ControlPlane| -> Vec<f64> {
                r.churn
                    .iter()
                    .find(|(k, _)| k == kind)
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default()
            };
            let count = runs.iter().map(|r| of_kind(r).len()).sum();
            let p50 = mid(runs.iter().filter_map(|r| median(&of_kind(r))));
            let p99 = mid(runs.iter().filter_map(|r| quantile(&of_kind(r), 0.99)));
            (*kind, count, p50, p99)
        })
        .collect();
    Some(Summary {
        registry: first.registry,
        nodes: first.nodes,
        runs: runs.len(),
        cold_ms: mid(runs.iter().map(|r| r.cold_ms)),
        first_pass_writes: first.first_pass_writes,
        steady_writes: runs.iter().map(|r| r.steady_writes).max().unwrap_or(0),
        steady_pass_ms: mid(runs.iter().map(|r| r.steady_pass_ms)),
        agent_rss_mib: mid(runs.iter().map(|r| mib(r.agent_rss_kib))),
        device_rss_mib: mid(runs.iter().map(|r| mib(r.device_rss_kib))),
        idle_cpu_percent: mid(runs.iter().map(|r| r.idle_cpu_percent)),
        churn_rate: first.churn_rate,
        churn,
    })
}

pub fn report(results: &[Summary]) -> String {
    let mut out = String::from(
        "| registry | nodes | runs | cold convergence (ms) | first pass writes | steady-state writes | resync pass (ms) | agent RSS (MiB) | device process RSS (MiB) | idle CPU (%), resync every 3 s |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in results {
        out += &format!(
            "| {} | {} | {} | {:.0} | {} | {} | {:.0} | {:.1} | {:.1} | {:.2} |\n",
            r.registry.name(),
            r.nodes,
            r.runs,
            r.cold_ms,
            r.first_pass_writes,
            r.steady_writes,
            r.steady_pass_ms,
            r.agent_rss_mib,
            r.device_rss_mib,
            r.idle_cpu_percent
        );
    }
    out += "\n| registry | nodes | churn (ops/s) | operation | count | p50 (ms) | p99 (ms) |\n| --- | ---: | ---: | --- | ---: | ---: | ---: |\n";
    for r in results {
        for (kind, count, p50, p99) in &r.churn {
            out += &format!(
                "| {} | {} | {:.0} | {kind} | {count} | {p50:.1} | {p99:.1} |\n",
                r.registry.name(),
                r.nodes,
                r.churn_rate,
            );
        }
    }
    out
}

/// One size's targets (issue: "each event costs what it changes").
struct Target {
    nodes: usize,
    cold_ms: Option<f64>,
    /// Churn at this many operations a second: p99 of every kind at most `churn_p99_ms`.
    churn_rate: f64,
    churn_p99_ms: f64,
    rss_mib: Option<f64>,
}

const TARGETS: [Target; 3] = [
    Target {
        nodes: 5_000,
        cold_ms: None,
        churn_rate: 50.0,
        churn_p99_ms: 25.0,
        rss_mib: None,
    },
    Target {
        nodes: 10_000,
        cold_ms: Some(1_500.0),
        churn_rate: 100.0,
        churn_p99_ms: 50.0,
        rss_mib: Some(60.0),
    },
    Target {
        nodes: 25_000,
        cold_ms: Some(5_000.0),
        churn_rate: 50.0,
        churn_p99_ms: 100.0,
        rss_mib: None,
    },
];

/// Every target `results` miss, one line each; empty when all are met. Every size must
/// write nothing in its steady state; the sizes with targets of their own are held to
/// them, and a churn target measured at a lower rate than its own counts as missed.
pub fn check(results: &[Summary]) -> Vec<String> {
    let mut missed = Vec::new();
    for r in results {
        let at = format!("{} nodes ({})", r.nodes, r.registry.name());
        if r.steady_writes > 0 {
            missed.push(format!(
                "{at}: the steady-state pass wrote {} times (target 0)",
                r.steady_writes
            ));
        }
        let Some(t) = TARGETS.iter().find(|t| t.nodes == r.nodes) else {
            continue;
        };
        if let Some(cold) = t.cold_ms.filter(|c| r.cold_ms > *c) {
            missed.push(format!(
                "{at}: cold convergence {:.0} ms (target ≤ {cold:.0} ms)",
                r.cold_ms
            ));
        }
        if let Some(limit) = t.rss_mib {
            for (what, mib) in [("agent", r.agent_rss_mib), ("device", r.device_rss_mib)] {
                if mib > limit {
                    missed.push(format!(
                        "{at}: {what} RSS {mib:.1} MiB (target ≤ {limit:.0} MiB)"
                    ));
                }
            }
        }
        if r.churn.is_empty() {
            continue;
        }
        if r.churn_rate < t.churn_rate {
            missed.push(format!(
                "{at}: churn measured at {:.0} ops/s; the target is at {:.0} (--rate {:.0})",
                r.churn_rate, t.churn_rate, t.churn_rate
            ));
            continue;
        }
        for (kind, _, _, p99) in r.churn.iter().filter(|c| c.3 > t.churn_p99_ms) {
            missed.push(format!(
                "{at}: churn {kind} p99 {p99:.1} ms at {:.0} ops/s (target ≤ {:.0} ms)",
                r.churn_rate, t.churn_p99_ms
            ));
        }
    }
    missed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(nodes: usize, cold_ms: f64, p99: f64, steady_writes: u64) -> ControlPlane {
        ControlPlane {
            registry: Registry::Etcd,
            nodes,
            cold_ms,
            first_pass_writes: nodes as u64,
            steady_writes,
            steady_pass_ms: 10.0,
            agent_rss_kib: 50 * 1024,
            device_rss_kib: 50 * 1024,
            idle_cpu_percent: 1.0,
            churn: vec![("add", vec![1.0, 2.0, p99])],
            churn_rate: 100.0,
        }
    }

    #[test]
    fn each_figure_is_the_median_of_the_runs() {
        let s = summarize(&[
            run(10_000, 900.0, 40.0, 0),
            run(10_000, 2000.0, 45.0, 0),
            run(10_000, 1000.0, 90.0, 0),
        ])
        .unwrap();
        assert_eq!((s.runs, s.cold_ms), (3, 1000.0));
        assert_eq!(s.churn, vec![("add", 9, 2.0, 45.0)]);
        assert!(check(&[s]).is_empty());
    }

    #[test]
    fn a_missed_target_is_named() {
        let slow = summarize(&[run(10_000, 1600.0, 80.0, 2)]).unwrap();
        let missed = check(&[slow]);
        assert_eq!(missed.len(), 3, "{missed:?}");
        assert!(missed[0].contains("wrote 2 times"), "{missed:?}");
        assert!(missed[1].contains("cold convergence 1600 ms"), "{missed:?}");
        assert!(missed[2].contains("add p99 80.0 ms"), "{missed:?}");
        // A size without targets of its own is held to a quiet steady state only.
        assert!(check(&[summarize(&[run(100, 9e9, 9e9, 0)]).unwrap()]).is_empty());
    }
}
