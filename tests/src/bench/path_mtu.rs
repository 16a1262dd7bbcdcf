//! Path MTU benchmark (`weft-lab bench path-mtu`): the narrow path of the lab (node 3 behind
//! two routers joined by a 1400-byte link, every node's own interface at 1500, userspace
//! WireGuard), with the routers' ICMP errors allowed and dropped. Each run measures, side
//! by side in one lab: one iperf3 TCP flow across the narrow path both ways against the
//! same-MTU pair (node 1 -> node 2); the IP fragments that crossed the narrow link during
//! those flows; how long a path that narrows (1400 -> 1300) takes to be in use on the
//! peer's route; and what a pod's oversized don't-fragment ping hears back.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::iperf;
use super::{median, quantile};
use crate::lab::narrow::{self, Narrow};
use crate::lab::{in_ns, Lab, LabConfig};

/// One run's figures.
struct Run {
    /// Gbit/s: node 1 -> node 2 (same MTU), node 1 -> node 3, node 3 -> node 1.
    wide: f64,
    across: f64,
    back: f64,
    fragments: u64,
    /// From the narrow link's change to the new MTU on node 1's route to node 3.
    narrowed: Duration,
    /// What a 1400-byte don't-fragment ping from a node 1 pod to a node 3 pod heard.
    oversized: String,
}

/// The MTU on node `i`'s route to node `peer`'s subnet.
fn route_mtu(lab: &Lab, i: usize, peer: usize) -> anyhow::Result<Option<u32>> {
    let subnet = lab.nodes[peer].subnet.context("the peer has no subnet")?;
    let route = lab.on_node(i, &format!("ip route show {subnet}"))?;
    let words: Vec<&str> = route.split_whitespace().collect();
    Ok(words
        .iter()
        .position(|w| *w == "mtu")
        .and_then(|at| words.get(at + 1)?.parse().ok()))
}

fn wait_route_mtu(lab: &Lab, want: u32, within: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    while route_mtu(lab, 0, 2)? != Some(want) {
        if start.elapsed() > within {
            bail!("node 1's route to node 3 did not get MTU {want} within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(start.elapsed())
}

fn one_run(weft: &std::path::Path, drop_icmp: bool) -> anyhow::Result<Run> {
    let mut cfg = LabConfig::wireguard(3, weft);
    cfg.pods_per_node = 1;
    cfg.routed = vec![2];
    cfg.narrow = Some(Narrow {
        mtu: 1400,
        drop_icmp,
    });
    let lab = Lab::start(cfg).context("starting the lab")?;
    // 1400 less 60 of WireGuard over IPv4, to a multiple of 16.
    wait_route_mtu(&lab, 1328, Duration::from_secs(10))?;
    let pod = |n: usize| &lab.nodes[n].pods[0];
    let ip4 = |n: usize| -> anyhow::Result<std::net::Ipv4Addr> { Ok(pod(n).ip) };
    let wide = iperf::flow(&pod(0).ns, &pod(1).ns, ip4(1)?, 1)?.gbit_s;
    narrow::count_fragments(&lab.tag)?;
    let across = iperf::flow(&pod(0).ns, &pod(2).ns, ip4(2)?, 1)?.gbit_s;
    let back = iperf::flow(&pod(2).ns, &pod(0).ns, ip4(0)?, 1)?.gbit_s;
    let fragments = narrow::fragments(&lab.tag)?;
    let oversized = in_ns(
        &pod(0).ns,
        &format!("ping -M do -s 1372 -c 1 -W 2 {} 2>&1 || true", ip4(2)?),
    )?;
    let oversized = oversized
        .lines()
        .find(|l| l.contains("mtu") || l.contains("too long"))
        .unwrap_or("(no answer)")
        .trim()
        .to_string();
    narrow::set_narrow_mtu(&lab.tag, 1300)?;
    // 1300 less 60, to a multiple of 16.
    let narrowed = wait_route_mtu(&lab, 1232, Duration::from_secs(30))?;
    Ok(Run {
        wide,
        across,
        back,
        fragments,
        narrowed,
        oversized,
    })
}

/// `runs` runs with the routers' ICMP errors allowed and as many with them dropped; the
/// table of BENCHMARKS.md.
pub fn run(weft: &std::path::Path, runs: usize) -> anyhow::Result<String> {
    let mut table = String::from(
        "| routers' ICMP errors | runs | same-MTU pair (Gbit/s) | across the narrow path | and back | ratio, worse direction | fragments on the narrow link | narrowed path in use after (s), median / worst | a pod's 1400-byte DF ping hears |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    for drop_icmp in [false, true] {
        let mut all = Vec::new();
        for r in 0..runs {
            let run = one_run(weft, drop_icmp)?;
            eprintln!(
                "path MTU (ICMP {}): run {}/{runs}: {:.2} / {:.2} / {:.2} Gbit/s, {} fragments, narrowed in {:.2?}, oversized ping: {}",
                if drop_icmp { "dropped" } else { "allowed" },
                r + 1,
                run.wide,
                run.across,
                run.back,
                run.fragments,
                run.narrowed,
                run.oversized
            );
            all.push(run);
        }
        let pick = |f: fn(&Run) -> f64| all.iter().map(f).collect::<Vec<f64>>();
        let (wide, across, back) = (
            median(&pick(|r| r.wide)).unwrap_or(f64::NAN),
            median(&pick(|r| r.across)).unwrap_or(f64::NAN),
            median(&pick(|r| r.back)).unwrap_or(f64::NAN),
        );
        let narrowed = pick(|r| r.narrowed.as_secs_f64());
        table += &format!(
            "| {} | {} | {wide:.2} | {across:.2} | {back:.2} | {:.2} | {} | {:.1} / {:.1} | {} |\n",
            if drop_icmp { "dropped" } else { "allowed" },
            all.len(),
            across.min(back) / wide,
            all.iter().map(|r| r.fragments).max().unwrap_or(0),
            median(&narrowed).unwrap_or(f64::NAN),
            quantile(&narrowed, 1.0).unwrap_or(f64::NAN),
            all.first().map_or("", |r| r.oversized.as_str()),
        );
    }
    Ok(table)
}
