//! `weft-lab bench flood`: one TCP flow (iperf3) and the RTT between two pods over a
//! userspace WireGuard pair, alone and while a third host on the underlay floods node 2
//! with handshake initiations that pass the first check (a valid mac1, which anyone who
//! knows node 2's public key can compute) as fast as one core sends them: weft's userspace
//! device and Debian's wireguard-go side by side, the same flood, runs interleaved.

use std::net::UdpSocket;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;

use super::data_plane::{topology, userspace_wg, Hand};
use super::iperf;
use super::median;
use crate::lab::in_ns;
use crate::live_demo::median_rtt_ms;
use crate::netns::in_named_netns;

/// One implementation's figures: (Gbit/s, RTT ms) alone, then under the flood, and the
/// flood's rate (initiations a second).
struct Sample {
    alone: (f64, f64),
    flooded: (f64, f64),
    rate: f64,
}

/// Node 2's WireGuard public key (`userspace_wg` keeps node N's private key in `keyN-1`).
fn node2_public(h: &Hand) -> anyhow::Result<[u8; 32]> {
    let private = std::fs::read_to_string(h.dir.path().join("key1"))?;
    let key: weft_crypto::PrivateKey = private.trim().parse().context("node 2's key")?;
    Ok(*key.public_key().as_bytes())
}

/// 4,096 initiations to `to` with garbage inside and a valid mac1.
fn initiations(to: &[u8; 32]) -> Vec<Vec<u8>> {
    let mut seed = 0x5eed_f100_0d00_u64;
    (0..4096u32)
        .map(|i| {
            let mut m = vec![0u8; 148];
            m[0] = 1;
            m[4..8].copy_from_slice(&i.to_le_bytes());
            for b in &mut m[8..116] {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                *b = seed as u8;
            }
            weft_backends::userspace::wg::cookie::write_mac1(to, &mut m);
            m
        })
        .collect()
}

fn one(daemon: &str) -> anyhow::Result<Sample> {
    let h = topology(&["fl"], &userspace_wg(daemon.to_string()))?;
    let (from, to_ns, to) = (h.ns(3), h.ns(4), "10.244.2.2".parse()?);
    let fl = h.ns(5).to_string();
    in_ns(
        h.ns(0),
        &format!(
            "ip link add fl type veth peer name eth0 netns {fl} && ip link set fl master br0 up"
        ),
    )?;
    in_ns(
        &fl,
        "ip addr add 198.51.100.3/24 dev eth0 && ip link set eth0 up",
    )?;
    in_ns(
        from,
        "ping -c 20 -i 0.05 -W 1 -q 10.244.2.2 >/dev/null; true",
    )?;
    let alone = (
        iperf::flow(from, to_ns, to, 1)?.gbit_s,
        median_rtt_ms(from, to, 20, "0.05").context("no ping replies")?,
    );
    let flood = initiations(&node2_public(&h)?);
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flooder = {
        let (stop, sent) = (stop.clone(), sent.clone());
        in_named_netns(&fl, move || {
            let Ok(s) = UdpSocket::bind("198.51.100.3:0") else {
                return;
            };
            while !stop.load(Ordering::Relaxed) {
                for d in &flood {
                    if s.send_to(d, "198.51.100.2:51820").is_ok() {
                        sent.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        })
    };
    let start = Instant::now();
    let flooded = (|| -> anyhow::Result<(f64, f64)> {
        Ok((
            iperf::flow(from, to_ns, to, 1)?.gbit_s,
            median_rtt_ms(from, to, 20, "0.05").context("no ping replies under the flood")?,
        ))
    })();
    stop.store(true, Ordering::Relaxed);
    let _ = flooder.join();
    let rate = sent.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    Ok(Sample {
        alone,
        flooded: flooded?,
        rate,
    })
}

/// Runs both implementations `runs` times, interleaved; returns the table.
pub fn run(weft: &Path, runs: usize) -> anyhow::Result<String> {
    let weft_daemon = format!(
        "({} userspace-device wg0 >/dev/null 2>&1 &) && \
         for i in $(seq 200); do [ -S /var/run/wireguard/wg0.sock ] && break; sleep 0.05; done",
        weft.display()
    );
    let setups = [
        ("weft userspace", weft_daemon),
        ("wireguard-go, Debian's", "wireguard-go wg0".to_string()),
    ];
    let mut samples: Vec<Vec<Sample>> = setups.iter().map(|_| Vec::new()).collect();
    for round in 0..runs {
        for (i, (name, daemon)) in setups.iter().enumerate() {
            eprintln!("flood: round {} of {runs}: {name}", round + 1);
            samples[i].push(one(daemon).with_context(|| format!("{name}, round {}", round + 1))?);
        }
    }
    let med = |v: &[Sample], f: fn(&Sample) -> f64| {
        median(&v.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
    };
    let mut out = format!(
        "| implementation | one flow alone, median of {runs} (Gbit/s) | under the flood | flooded / alone | RTT alone (ms) | RTT under the flood (ms) | flood (initiations/s) | runs, flooded (Gbit/s) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n"
    );
    for ((name, _), v) in setups.iter().zip(&samples) {
        let (a, f) = (med(v, |s| s.alone.0), med(v, |s| s.flooded.0));
        out += &format!(
            "| {name} | {a:.2} | {f:.2} | {:.2} | {:.3} | {:.3} | {:.0} | {} |\n",
            f / a,
            med(v, |s| s.alone.1),
            med(v, |s| s.flooded.1),
            med(v, |s| s.rate),
            v.iter()
                .map(|s| format!("{:.2}", s.flooded.0))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(out)
}
