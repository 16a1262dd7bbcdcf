//! Rollout benchmark (`weft-lab bench rollout`): a running cluster changes backend node by
//! node, as the README's migration does (etcd registry, 4 nodes with a pod each, the
//! config's `Backend.Type` changed, then each agent stopped with SIGTERM and started
//! again, `--pace` seconds apart), with every ordered pair of pods pinging at 10 pps
//! (`Lab::roll_out`). Per rollout: the longest gap of any pair (its longest run of
//! unanswered pings), the worst pair's loss over the rollout, how long the rollout took
//! and how many pairs were seen in clear. Four rollouts a run, in two labs: vxlan ->
//! wireguard -> vxlan and host-gw -> wireguard -> host-gw. With `--baseline WEFT`, an
//! earlier weft binary runs the same rollouts beside this one, each run.

use std::path::Path;
use std::time::Duration;

use serde_json::json;

use super::median;
use crate::lab::rollout::{Rollout, RolloutReport};
use crate::lab::{Lab, LabConfig};

/// A backend rolled out to, with the devices gone after it.
type Step = (&'static str, &'static [&'static str]);

/// The rollouts of one lab: its first backend, then each backend it rolls out to.
const LABS: [(&str, [Step; 2]); 2] = [
    (
        "vxlan",
        [("wireguard", &["flannel.1"]), ("vxlan", &["flannel-wg"])],
    ),
    (
        "host-gw",
        [("wireguard", &[]), ("host-gw", &["flannel-wg"])],
    ),
];

/// One rollout's figures.
struct Figures {
    gap: Duration,
    loss: f64,
    took: Duration,
    clear_pairs: usize,
    /// The last clear echo's lateness after both its ends encrypted.
    late: Duration,
}

impl From<&RolloutReport> for Figures {
    fn from(r: &RolloutReport) -> Self {
        Figures {
            gap: r.longest_gap(),
            loss: r.worst_loss(),
            took: r.took,
            clear_pairs: r.clear_pairs().len(),
            late: r.clear_lateness(Duration::from_secs(1)).0,
        }
    }
}

/// Every rollout of one run with `weft`, in order; a rollout that fails is `None` (its
/// error printed), and the lab's later rollouts are not run.
fn one_run(weft: &Path, pace: Duration) -> Vec<(String, Option<Figures>)> {
    let mut out = Vec::new();
    for (first, steps) in LABS {
        let lab = Lab::start(LabConfig::backend(4, weft, first, false));
        let mut lab = match lab {
            Ok(lab) => lab,
            Err(e) => {
                eprintln!("rollout: a {first} lab did not start: {e:#}");
                out.extend(
                    steps
                        .iter()
                        .map(|(to, _)| (format!("{first} -> {to}"), None)),
                );
                continue;
            }
        };
        let mut from = first;
        let mut failed = false;
        for (to, gone) in steps {
            let name = format!("{from} -> {to}");
            from = to;
            if failed {
                out.push((name, None));
                continue;
            }
            let rollout = Rollout {
                backend: json!({ "Type": to }),
                pace,
                stall: None,
                at_stall: None,
            };
            match lab.roll_out(&rollout, gone) {
                Ok(report) => {
                    eprintln!("{name}: {report}");
                    out.push((name, Some(Figures::from(&report))));
                }
                Err(e) => {
                    eprintln!("{name}: failed: {e:#}");
                    out.push((name, None));
                    failed = true;
                }
            }
        }
    }
    out
}

/// The benchmark's table: per rollout, the medians over `runs` of this binary's figures
/// and, with a baseline, the baseline's beside them.
pub fn run(
    weft: &Path,
    baseline: Option<&Path>,
    runs: usize,
    pace: Duration,
) -> anyhow::Result<String> {
    let mut ours: Vec<Vec<(String, Option<Figures>)>> = Vec::new();
    let mut theirs: Vec<Vec<(String, Option<Figures>)>> = Vec::new();
    for run in 0..runs {
        eprintln!("run {} of {runs}", run + 1);
        ours.push(one_run(weft, pace));
        if let Some(base) = baseline {
            theirs.push(one_run(base, pace));
        }
    }
    let names: Vec<String> = ours
        .first()
        .map(|r| r.iter().map(|(n, _)| n.clone()).collect())
        .unwrap_or_default();
    let med = |runs: &[Vec<(String, Option<Figures>)>], i: usize| -> Option<String> {
        let got: Vec<&Figures> = runs.iter().filter_map(|r| r.get(i)?.1.as_ref()).collect();
        if got.is_empty() {
            return None;
        }
        let gap = median(&got.iter().map(|f| f.gap.as_secs_f64()).collect::<Vec<_>>())?;
        let worst_gap = got.iter().map(|f| f.gap).max()?.as_secs_f64();
        let loss = median(&got.iter().map(|f| f.loss * 100.0).collect::<Vec<_>>())?;
        let worst_loss = got.iter().map(|f| f.loss).fold(0.0, f64::max) * 100.0;
        let took = median(&got.iter().map(|f| f.took.as_secs_f64()).collect::<Vec<_>>())?;
        let clear = median(&got.iter().map(|f| f.clear_pairs as f64).collect::<Vec<_>>())?;
        let late = got.iter().map(|f| f.late).max()?.as_millis();
        Some(format!(
            "{gap:.1} s (worst {worst_gap:.1}) | {loss:.1} % (worst {worst_loss:.1}) | {took:.0} s | {clear:.0} of 12, {late} ms at most after both ends encrypted | {} of {}",
            got.len(),
            runs.len()
        ))
    };
    let mut out = format!(
        "rollout: 4 nodes (etcd, userspace WireGuard), every ordered pair pinging at 10 pps, agents restarted {} s apart; medians of {runs} runs\n\n",
        pace.as_secs()
    );
    out += "| rollout | binary | longest gap of any pair | worst pair's loss | took | pairs seen in clear | runs that completed |\n";
    out += "| --- | --- | --- | --- | --- | --- | --- |\n";
    for (i, name) in names.iter().enumerate() {
        let row = |who: &str, cell: Option<String>| {
            format!(
                "| {name} | {who} | {} |\n",
                cell.unwrap_or_else(|| "failed | - | - | - | 0".into())
            )
        };
        out += &row("this weft", med(&ours, i));
        if baseline.is_some() {
            out += &row("baseline", med(&theirs, i));
        }
    }
    Ok(out)
}
