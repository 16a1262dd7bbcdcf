//! Key-rotation benchmark: how much a rotation disrupts traffic. Each run builds a
//! 3-node lab (etcd registry, userspace WireGuard), runs a TCP stream (1 KiB every 10 ms)
//! and a 100 pps ping from a pod on node 1 to a pod on node 2 (`crate::traffic`), and
//! rotates: node 1's key through its agent (`weft keys rotate`), every node's key through
//! the registry (`weft keys rotate --all`), and the PSK (`<prefix>/weft/psk`). Reported:
//! medians and worst cases of the stream's longest stall and of the pings lost. The PSK
//! row counts only if every device carries the new PSK afterwards.

use std::path::Path;
use std::time::{Duration, SystemTime};

use anyhow::Context;

use super::{median, quantile};
use crate::lab::{in_ns, Lab, LabConfig, ETCD_IP};
use crate::traffic::{Disruption, Probe};

const KINDS: [&str; 3] = ["one node (local)", "all nodes (--all)", "PSK"];

fn measured(lab: &Lab, act: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<Disruption> {
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    let probe = Probe::start(&a.ns, &b.ns, b.ip)?;
    act()?;
    std::thread::sleep(Duration::from_secs(2));
    probe.finish()
}

fn one_run(weft: &Path) -> anyhow::Result<Vec<Disruption>> {
    let mut cfg = LabConfig::wireguard(3, weft);
    cfg.pods_per_node = 1;
    // The lab's etcd speaks plain HTTP; the PSK rotation goes through it.
    cfg.extra_args.push("--etcd-insecure".into());
    let lab = Lab::start(cfg).context("starting the lab")?;
    let weft = weft.display().to_string();
    let first = weft_crypto::PresharedKey::generate()?.to_base64_secret();
    lab.etcd().etcdctl(&[
        "put",
        "/coreos.com/network/weft/psk",
        &format!(r#"{{"PSK": "{first}"}}"#),
    ])?;
    std::thread::sleep(Duration::from_secs(2));
    let mut out = Vec::new();
    out.push(measured(&lab, || {
        lab.on_node(0, &format!("{weft} keys rotate")).map(drop)
    })?);
    out.push(measured(&lab, || {
        in_ns(
            &format!("{}-etcd", lab.tag),
            &format!("{weft} keys rotate --all --etcd-endpoints=http://{ETCD_IP}:2379"),
        )
        .map(drop)
    })?);
    out.push(measured(&lab, || {
        let next = weft_crypto::PresharedKey::generate()?.to_base64_secret();
        let at = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)?
            .as_millis()
            + 3000;
        let value = format!(r#"{{"PSK": "{first}", "NextPSK": "{next}", "SwitchAt": {at}}}"#);
        lab.etcd()
            .etcdctl(&["put", "/coreos.com/network/weft/psk", &value])?;
        std::thread::sleep(Duration::from_secs(4));
        psk_in_use(&lab, &next)
    })?);
    Ok(out)
}

/// Fails unless every peer on every node's device carries `psk` (base64): the PSK row
/// measures a rotation that happened. The keys themselves are never printed.
fn psk_in_use(lab: &Lab, psk: &str) -> anyhow::Result<()> {
    for i in 0..lab.nodes.len() {
        let shown = lab.on_node(i, "wg show flannel-wg preshared-keys")?;
        let keys: Vec<&str> = shown
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .collect();
        let with_new = keys.iter().filter(|k| **k == psk).count();
        if keys.is_empty() || with_new != keys.len() {
            anyhow::bail!(
                "node {}: {with_new} of {} peers carry the new PSK after its moment",
                i + 1,
                keys.len()
            );
        }
    }
    Ok(())
}

/// `runs` runs; the table of BENCHMARKS.md.
pub fn run(weft: &Path, runs: usize) -> anyhow::Result<String> {
    let mut all: Vec<Vec<Disruption>> = vec![Vec::new(); KINDS.len()];
    for r in 0..runs {
        eprintln!("rotation: run {}/{runs}", r + 1);
        for (i, d) in one_run(weft)?.into_iter().enumerate() {
            eprintln!("  {}: {d}", KINDS[i]);
            all[i].push(d);
        }
    }
    let mut table = String::from(
        "| rotation | runs | longest TCP stall, median (ms) | worst (ms) | pings lost at 100 pps, median | worst | TCP resets |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for (kind, ds) in KINDS.iter().zip(&all) {
        let stall: Vec<f64> = ds.iter().map(|d| d.max_stall.as_secs_f64() * 1e3).collect();
        let lost: Vec<f64> = ds.iter().map(|d| d.pings_lost as f64).collect();
        let resets = ds.iter().filter(|d| d.stream_error.is_some()).count();
        table += &format!(
            "| {kind} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {resets} |\n",
            ds.len(),
            median(&stall).unwrap_or(f64::NAN),
            quantile(&stall, 1.0).unwrap_or(f64::NAN),
            median(&lost).unwrap_or(f64::NAN),
            quantile(&lost, 1.0).unwrap_or(f64::NAN),
        );
    }
    Ok(table)
}
