//! Liveness benchmark: how soon each fault on one pair is named by the agent and traffic is
//! back (`crate::faults`: a 3-node lab, etcd registry, userspace WireGuard, a 10 pps ping on
//! the faulted pair and one on another pair). Each run makes every fault; the table has the
//! medians and the worst of `runs` runs, and what the other pair lost in all of them.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;

use super::{median, quantile};
use crate::faults::{Measured, GROUPS};
use crate::lab::{Lab, LabConfig};

/// Generous limits: the benchmark reports what it measures; the tests hold the targets.
const LIMITS: (Duration, Duration) = (Duration::from_secs(30), Duration::from_secs(60));

fn one_run(weft: &Path) -> anyhow::Result<Vec<Measured>> {
    let mut out = Vec::new();
    for group in GROUPS {
        let lab = Lab::start(LabConfig::wireguard(3, weft)).context("starting the lab")?;
        lab.assert_all_pairs();
        for fault in group {
            let m = fault.measure(&lab, LIMITS)?;
            eprintln!("  {m}");
            out.push(m);
            lab.assert_all_pairs();
            // Until every repair of this fault is over (a pair alive again, a device made
            // again): the next fault starts from a healthy mesh.
            std::thread::sleep(Duration::from_secs(3));
        }
    }
    Ok(out)
}

/// `runs` runs; the table of BENCHMARKS.md.
pub fn run(weft: &Path, runs: usize) -> anyhow::Result<String> {
    let mut all: Vec<Vec<Measured>> = Vec::new();
    for r in 0..runs {
        eprintln!("liveness: run {}/{runs}", r + 1);
        all.push(one_run(weft)?);
    }
    let mut table = String::from(
        "| fault on one pair | runs | named after, median (s) | worst (s) | traffic back after, median (s) | worst (s) | other pair: pings lost |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let faults = all
        .first()
        .map(|r| r.iter().map(|m| m.fault).collect::<Vec<_>>());
    for fault in faults.unwrap_or_default() {
        let ms: Vec<&Measured> = all.iter().flatten().filter(|m| m.fault == fault).collect();
        let named: Vec<f64> = ms.iter().map(|m| m.named.as_secs_f64()).collect();
        let back: Vec<f64> = ms.iter().map(|m| m.back.as_secs_f64()).collect();
        let lost: u64 = ms.iter().map(|m| m.other_lost).sum();
        let ended = if fault.lifts() {
            " (after it ended)"
        } else {
            ""
        };
        table += &format!(
            "| {} | {} | {:.1} | {:.1} | {:.1}{ended} | {:.1} | {lost} |\n",
            fault.name(),
            ms.len(),
            median(&named).unwrap_or(f64::NAN),
            quantile(&named, 1.0).unwrap_or(f64::NAN),
            median(&back).unwrap_or(f64::NAN),
            quantile(&back, 1.0).unwrap_or(f64::NAN),
        );
    }
    Ok(table)
}
