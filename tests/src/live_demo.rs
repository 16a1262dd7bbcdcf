//! The live demo: a 3-node mesh in the lab (encrypted by default; vxlan or host-gw on
//! request), measured and shown, then torn down.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::lab::{in_ns, Lab, LabConfig};
use crate::netns::in_named_netns;
use crate::tcp;

const TRANSFER_BYTES: u64 = 64 << 20;

fn weft_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating weft-lab")?;
    let weft = exe.with_file_name("weft");
    if !weft.exists() {
        bail!("{} not found next to weft-lab; build both (`cargo build --release -p weft -p weft-lab`)", weft.display());
    }
    Ok(weft)
}

/// Median RTT in ms of `count` pings `interval` seconds apart from namespace `from` to `to`.
pub fn median_rtt_ms(from: &str, to: Ipv4Addr, count: u32, interval: &str) -> Option<f64> {
    let out = in_ns(from, &format!("ping -c {count} -i {interval} -W 1 {to}")).ok()?;
    let times: Vec<f64> = out
        .lines()
        .filter_map(|l| {
            l.split("time=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    crate::bench::median(&times)
}

/// Streams `bytes` from pod `from` to pod `to`; returns (MiB/s, digests match).
pub fn transfer(from: &str, to_ns: &str, to: Ipv4Addr, bytes: u64) -> anyhow::Result<(f64, bool)> {
    transfer_to(from, to_ns, to.into(), bytes)
}

/// `transfer` to an address of either family.
pub fn transfer_to(
    from: &str,
    to_ns: &str,
    to: std::net::IpAddr,
    bytes: u64,
) -> anyhow::Result<(f64, bool)> {
    let (listening, ready) = std::sync::mpsc::channel();
    let at: std::net::IpAddr = if to.is_ipv6() {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    } else {
        Ipv4Addr::UNSPECIFIED.into()
    };
    let sink = in_named_netns(to_ns, move || {
        tcp::sink_on(at, 5201, move || {
            let _ = listening.send(());
        })
    });
    // Until the sink listens (or has failed: then its error comes from the join below).
    let _ = ready.recv_timeout(Duration::from_secs(10));
    let target = std::net::SocketAddr::new(to, 5201).to_string();
    let sent = in_named_netns(from, move || tcp::source(&target, bytes))
        .join()
        .map_err(|_| anyhow::anyhow!("the source thread panicked"))???;
    let received = sink
        .join()
        .map_err(|_| anyhow::anyhow!("the sink thread panicked"))???;
    let f: Vec<&str> = sent.split_whitespace().collect();
    let secs: f64 = f.get(2).and_then(|s| s.parse().ok()).unwrap_or(f64::NAN);
    let same = received
        .split_whitespace()
        .take(2)
        .eq(f.iter().take(2).copied());
    Ok((bytes as f64 / (1 << 20) as f64 / secs, same))
}

pub fn run(backend: &str) -> anyhow::Result<()> {
    let weft = weft_binary()?;
    let (cfg, what) = match backend {
        "wireguard" => (
            LabConfig::wireguard(3, weft),
            "wireguard backend (encrypted), etcd registry",
        ),
        "vxlan" => (
            LabConfig::backend(3, weft, "vxlan", false),
            "vxlan backend (not encrypted), etcd registry",
        ),
        "host-gw" => (
            LabConfig::backend(3, weft, "host-gw", false),
            "host-gw backend (not encrypted), etcd registry",
        ),
        other => bail!("unknown backend {other:?}: use wireguard, vxlan or host-gw"),
    };
    println!("weft demo: a 3-node pod network on this machine");
    println!("  {what}\n");
    let started = Instant::now();
    let lab = Lab::start(cfg).context("building the lab (this needs root)")?;
    println!(
        "lab ready in {:.1} s: underlay 198.51.100.0/24, etcd at {}, 3 nodes x 2 pods\n",
        started.elapsed().as_secs_f64(),
        crate::lab::ETCD_IP
    );
    println!("{:<6} {:<15} {:<16} pods", "node", "underlay", "pod subnet");
    for n in &lab.nodes {
        let pods: Vec<String> = n.pods.iter().map(|p| p.ip.to_string()).collect();
        println!(
            "n{:<5} {:<15} {:<16} {}",
            n.index,
            n.ip,
            n.subnet.map(|s| s.to_string()).unwrap_or_default(),
            pods.join(", ")
        );
    }
    for a in &lab.nodes {
        for b in lab.nodes.iter().filter(|b| b.index != a.index) {
            if !lab.ping(&a.pods[0].ns, b.pods[0].ip, Duration::from_secs(10)) {
                bail!(
                    "pod {} cannot reach pod {}; agent logs:\n{}",
                    a.pods[0].ip,
                    b.pods[0].ip,
                    lab.logs()
                );
            }
        }
    }
    println!("\npod-to-pod round trip, median of 5 pings (ms), over {backend}:");
    print!("{:<14}", "from \\ to");
    for b in &lab.nodes {
        print!("{:>14}", format!("n{} pod", b.index));
    }
    println!();
    for a in &lab.nodes {
        print!("{:<14}", format!("n{} pod", a.index));
        for b in &lab.nodes {
            let cell = if a.index == b.index {
                "-".to_string()
            } else {
                median_rtt_ms(&a.pods[0].ns, b.pods[0].ip, 5, "0.2")
                    .map_or("lost".into(), |r| format!("{r:.3}"))
            };
            print!("{cell:>14}");
        }
        println!();
    }
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    let (rate, intact) = transfer(&a.ns, &b.ns, b.ip, TRANSFER_BYTES)?;
    println!(
        "\nthroughput: {} MiB over TCP, n1 pod -> n2 pod: {rate:.0} MiB/s ({:.0} Mbit/s), SHA-256 {}",
        TRANSFER_BYTES >> 20,
        rate * 8.388_608,
        if intact { "matches" } else { "DIFFERS" }
    );
    let (title, show) = match backend {
        "wireguard" => ("`wg show flannel-wg`", "wg show flannel-wg"),
        "vxlan" => (
            "the vxlan neighbours and FDB",
            "ip neigh show dev flannel.1 nud permanent; bridge fdb show dev flannel.1 | grep dst",
        ),
        _ => ("weft's routes", "ip -4 route show proto 87"),
    };
    println!("\n{title} on n1:\n");
    print!("{}", lab.on_node(0, show)?);
    println!("\ntearing down the lab...");
    drop(lab);
    println!("done: every namespace, process and file the lab made is gone.");
    Ok(())
}
