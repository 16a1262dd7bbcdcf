//! Relay benchmark (`weft-lab bench relay`): the lab's two sites (private nodes behind NATs
//! that map every flow to a random port, gateways on 1:1 public addresses; userspace
//! WireGuard). Each run, one lab, side by side:
//! - one iperf3 flow and the RTT (median of 20 pings) over a direct cross-site pair (a2 ->
//!   b3: out through site A's NAT to b3's public address) and over the relayed pair (a2 ->
//!   b2, through a gateway);
//! - the carrying gateway's agent process (which runs the relay) CPU per relayed Gbit/s;
//! - from a2's and b2's agents started (their devices deleted first) to a2–b2's first ping
//!   answered;
//! - failover: the carrying gateway's link cut while a 100 pps ping runs: the longest run
//!   of unanswered pings.
//!
//! `state` measures the relay's own table at cluster scale, in process: every node of a
//! cluster a member, every pair a gateway carries handshaken through it twice (a rekey),
//! with the table's size and the cost of each handshake message.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::{iperf, median};
use crate::lab::sites::Sites;
use crate::lab::{in_ns, Lab, LabConfig};
use crate::live_demo::median_rtt_ms;

const A2: usize = 0;
const B2: usize = 3;
const B3: usize = 4;
const GATEWAYS: [usize; 2] = [1, 2];

struct Run {
    direct_gbit: f64,
    relayed_gbit: f64,
    direct_rtt_ms: f64,
    relayed_rtt_ms: f64,
    gateway_cores_per_gbit: f64,
    start_to_up: Duration,
    failover: Duration,
}

/// The gateway carrying a2 -> b2, as a2's status says.
fn carrier(lab: &Lab) -> Option<usize> {
    let text = lab.status(A2);
    let b2 = lab.node_name(B2);
    let line = text.lines().find(|l| l.starts_with(&b2))?;
    GATEWAYS
        .into_iter()
        .find(|&g| line.contains(&format!("via {}", lab.node_name(g))))
}

/// User and system CPU seconds of node `i`'s agent process so far.
fn agent_cpu(lab: &Lab, i: usize) -> anyhow::Result<f64> {
    let pid = crate::netns::pids_in(&lab.nodes[i].ns)
        .into_iter()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.split(|b| *b == 0).nth(1) == Some(b"agent".as_slice()))
        })
        .context("node's agent process")?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit(')').next().unwrap_or_default();
    let f: Vec<u64> = after
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    // utime and stime: fields 14 and 15 of stat, 12 and 13 after the state field.
    Ok((f.get(10).copied().unwrap_or(0) + f.get(11).copied().unwrap_or(0)) as f64 / 100.0)
}

fn until(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> anyhow::Result<Duration> {
    let start = Instant::now();
    while !f() {
        anyhow::ensure!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(start.elapsed())
}

fn ping_once(lab: &Lab, from: usize, to: usize) -> bool {
    let (ns, ip) = (&lab.nodes[from].pods[0].ns, lab.nodes[to].pods[0].ip);
    in_ns(ns, &format!("ping -c 1 -W 1 {ip}")).is_ok()
}

fn one_run(weft: &std::path::Path) -> anyhow::Result<Run> {
    let mut cfg = LabConfig::wireguard(5, weft);
    cfg.pods_per_node = 1;
    cfg.net_conf = r#"{"Network": "10.244.0.0/16", "SubnetMax": "10.244.199.0", "Backend": {"Type": "wireguard", "PersistentKeepaliveInterval": 5}}"#.into();
    cfg.sites = Some(Sites::two());
    let mut lab = Lab::start(cfg).context("starting the lab")?;
    until("a2 -> b2 relayed", Duration::from_secs(20), || {
        carrier(&lab).is_some()
    })?;
    let gw = carrier(&lab).context("no gateway")?;
    let pod = |n: usize| (lab.nodes[n].pods[0].ns.clone(), lab.nodes[n].pods[0].ip);
    let (a2, b2, b3) = (pod(A2), pod(B2), pod(B3));
    let direct = iperf::flow(&a2.0, &b3.0, b3.1, 1)?;
    let cpu0 = agent_cpu(&lab, gw)?;
    let t0 = Instant::now();
    let relayed = iperf::flow(&a2.0, &b2.0, b2.1, 1)?;
    let gateway_cores = (agent_cpu(&lab, gw)? - cpu0) / t0.elapsed().as_secs_f64();
    let direct_rtt_ms = median_rtt_ms(&a2.0, b3.1, 20, "0.05").context("no ping replies")?;
    let relayed_rtt_ms = median_rtt_ms(&a2.0, b2.1, 20, "0.05").context("no ping replies")?;

    // From both ends' agents started, their devices gone, to the relayed pair up.
    for i in [A2, B2] {
        lab.stop_agent(i, "TERM")?;
        let _ = lab.on_node(i, "ip link del flannel-wg");
    }
    let started = Instant::now();
    for i in [A2, B2] {
        lab.start_agent(i)?;
    }
    until("a2 -> b2 after a start", Duration::from_secs(30), || {
        ping_once(&lab, A2, B2)
    })?;
    let start_to_up = started.elapsed();

    // Failover: the carrying gateway cut off under a 100 pps ping.
    until("a2 -> b2 relayed again", Duration::from_secs(20), || {
        carrier(&lab).is_some()
    })?;
    let gw = carrier(&lab).context("no gateway")?;
    let probe = crate::traffic::Probe::start(&a2.0, &b2.0, b2.1)?;
    std::thread::sleep(Duration::from_secs(1));
    lab.set_link(gw, false)?;
    until(
        "the pair on the other gateway",
        Duration::from_secs(30),
        || carrier(&lab).is_some_and(|g| g != gw) && ping_once(&lab, A2, B2),
    )?;
    std::thread::sleep(Duration::from_secs(1));
    let hole = probe.finish()?.longest_hole.map_or(0, |h| h.pings);
    Ok(Run {
        direct_gbit: direct.gbit_s,
        relayed_gbit: relayed.gbit_s,
        direct_rtt_ms,
        relayed_rtt_ms,
        gateway_cores_per_gbit: gateway_cores / relayed.gbit_s,
        start_to_up,
        failover: Duration::from_millis(hole * 10),
    })
}

/// The lab runs and the table at scale.
pub fn run(
    weft: &std::path::Path,
    runs: usize,
    nodes: usize,
    zones: usize,
) -> anyhow::Result<String> {
    let mut all = Vec::new();
    for r in 0..runs {
        let run = one_run(weft)?;
        eprintln!(
            "relay: run {}/{runs}: direct {:.2} Gbit/s {:.3} ms, relayed {:.2} Gbit/s {:.3} ms, gateway {:.2} cores/Gbit/s, up {:.2?} after start, failover {:.2?}",
            r + 1,
            run.direct_gbit,
            run.direct_rtt_ms,
            run.relayed_gbit,
            run.relayed_rtt_ms,
            run.gateway_cores_per_gbit,
            run.start_to_up,
            run.failover
        );
        all.push(run);
    }
    let m =
        |f: fn(&Run) -> f64| median(&all.iter().map(f).collect::<Vec<f64>>()).unwrap_or(f64::NAN);
    let (d, r) = (m(|r| r.direct_gbit), m(|r| r.relayed_gbit));
    let (drtt, rrtt) = (m(|r| r.direct_rtt_ms), m(|r| r.relayed_rtt_ms));
    let mut table = format!(
        "| runs | direct pair (Gbit/s) | relayed pair (Gbit/s) | relayed / direct | RTT direct (ms) | RTT relayed (ms) | RTT added (ms) | gateway CPU (cores per relayed Gbit/s) | agent start to relayed pair up (s) | failover (s) |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n| {} | {d:.2} | {r:.2} | {:.2} | {drtt:.3} | {rrtt:.3} | {:+.3} | {:.2} | {:.2} | {:.2} |\n",
        all.len(),
        r / d,
        rrtt - drtt,
        m(|r| r.gateway_cores_per_gbit),
        m(|r| r.start_to_up.as_secs_f64()),
        m(|r| r.failover.as_secs_f64()),
    );
    table += "\n";
    table += &state(nodes, zones)?;
    Ok(table)
}

/// The relay's table at scale: `zones` zones of `nodes / zones` private nodes and two
/// gateways each; one gateway of zone 0 carries the pairs the rendezvous hash gives it (a
/// quarter of the pairs between its zone's private nodes and the other zones'), each
/// handshaken twice (the first handshake and a rekey: at most two sessions' routes live
/// at once).
pub fn state(nodes: usize, zones: usize) -> anyhow::Result<String> {
    use weft_backends::userspace::relay::{Member, Table};
    use weft_backends::userspace::wg::cookie::write_mac1;
    let per_zone = nodes / zones;
    let key = |n: usize| {
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&(n as u64 + 1).to_le_bytes());
        k
    };
    let addr = |n: usize| -> SocketAddr {
        let n = n as u32;
        SocketAddr::from(([10, (n >> 16) as u8, (n >> 8) as u8, n as u8], 51820))
    };
    let members: Vec<Member> = (0..nodes)
        .map(|n| Member {
            node: n.to_string().into(),
            key: key(n),
            home: (n < per_zone).then(|| addr(n)),
        })
        .collect();
    let now = Instant::now();
    let mut table = Table::new(now);
    table.set_members(&members);
    // The pairs this gateway carries: (outside node, inside node), a quarter of them.
    let mut pairs: Vec<(usize, usize)> = (per_zone..nodes)
        .flat_map(|out| (0..per_zone).map(move |inside| (out, inside)))
        .filter(|(o, i)| (o * 31 + i * 17) % 4 == 0)
        .collect();
    // In an order where no node's handshakes bunch up (a rekey every two minutes spreads
    // them), one pair a millisecond: within the relay's limits, as a real cluster is.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for i in (1..pairs.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        pairs.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    let mut index = 1u32;
    let mut init_ns = Vec::new();
    let mut resp_ns = Vec::new();
    let mut dropped = 0usize;
    for round in 0..2 {
        for (k, &(out, inside)) in pairs.iter().enumerate() {
            // The outside node initiates from its NAT's mapping.
            let from = SocketAddr::from(([203, 0, 113, (out % 250) as u8], 20000 + (out as u16)));
            let mut init = vec![0u8; 148];
            init[0] = 1;
            init[4..8].copy_from_slice(&index.to_le_bytes());
            write_mac1(&key(inside), &mut init);
            let t = Instant::now();
            let ok = table
                .route(
                    from,
                    &init,
                    now + Duration::from_millis(k as u64 + round * 100_000),
                )
                .is_ok();
            init_ns.push(t.elapsed().as_nanos() as f64);
            let mut resp = vec![0u8; 92];
            resp[0] = 2;
            resp[4..8].copy_from_slice(&(index + 1).to_le_bytes());
            resp[8..12].copy_from_slice(&index.to_le_bytes());
            write_mac1(&key(out), &mut resp);
            let t = Instant::now();
            let ok = ok
                && table
                    .route(
                        addr(inside),
                        &resp,
                        now + Duration::from_millis(k as u64 + round * 100_000),
                    )
                    .is_ok();
            resp_ns.push(t.elapsed().as_nanos() as f64);
            dropped += usize::from(!ok);
            index += 2;
        }
    }
    let routes = table.routes();
    let bytes = table.estimated_bytes();
    Ok(format!(
        "| cluster | pairs through one gateway | relay routes | relay table (MiB, estimated) | registry entries per pair | initiation, median (µs) | response, median (µs) | handshake messages refused |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n| {nodes} private nodes in {zones} zones ({per_zone} a zone), 2 gateways a zone | {} | {routes} | {:.1} | 0 | {:.1} | {:.1} | {dropped} |\n",
        pairs.len(),
        bytes as f64 / (1 << 20) as f64,
        median(&init_ns).unwrap_or(f64::NAN) / 1e3,
        median(&resp_ns).unwrap_or(f64::NAN) / 1e3,
    ))
}
