//! `weft-lab bench post-quantum [--rounds 200] [--peers 1000]`: what one post-quantum round
//! costs each of the two nodes, measured on the exchange itself in this process (each
//! side's CPU time, by the thread's clock), the bytes it puts inside the tunnel and on the
//! underlay, and what that makes of an agent's CPU with `--peers` peers at the default
//! 2-minute period (each node leads about half of its pairs and follows the others).

use std::time::Duration;

use weft_crypto::pq::{Exchange, KemKeyPair, Own, Timing};
use weft_crypto::PrivateKey;

use super::median;

/// This thread's CPU time.
pub(super) fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Runs `f`, adding its CPU time to `total`.
fn timed<T>(total: &mut Duration, f: impl FnOnce() -> T) -> T {
    let start = thread_cpu();
    let out = f();
    *total += thread_cpu().saturating_sub(start);
    out
}

fn own() -> anyhow::Result<Own> {
    Ok(Own {
        key: PrivateKey::generate()?,
        kem: KemKeyPair::generate()?,
        previous_kem: None,
    })
}

/// Per round: (leader's CPU, follower's CPU, datagrams, payload bytes).
fn round(
    lead: (&Own, &mut Exchange),
    follow: (&Own, &mut Exchange),
    now: u64,
) -> anyhow::Result<(Duration, Duration, usize, usize)> {
    let (mut l_cpu, mut f_cpu) = (Duration::ZERO, Duration::ZERO);
    let (mut datagrams, mut bytes) = (0, 0);
    let (lo, lx) = lead;
    let (fo, fx) = follow;
    let mut to_follower = timed(&mut l_cpu, || lx.poll(now))?.send;
    for _ in 0..4 {
        let mut to_leader = Vec::new();
        for d in to_follower.drain(..) {
            (datagrams, bytes) = (datagrams + 1, bytes + d.len());
            to_leader.extend(timed(&mut f_cpu, || fx.receive(fo, &d, now))?);
        }
        for d in to_leader {
            (datagrams, bytes) = (datagrams + 1, bytes + d.len());
            to_follower.extend(timed(&mut l_cpu, || lx.receive(lo, &d, now))?);
        }
        to_follower.extend(timed(&mut l_cpu, || lx.poll(now))?.send);
        if to_follower.is_empty() {
            break;
        }
    }
    anyhow::ensure!(
        lx.psk(now + 10_000).map(|i| &i.psk) == fx.psk(now + 10_000).map(|i| &i.psk),
        "the round did not end in one PSK"
    );
    Ok((l_cpu, f_cpu, datagrams, bytes))
}

pub fn run(rounds: usize, peers: usize) -> anyhow::Result<String> {
    let (mut a, mut b) = (own()?, own()?);
    if a.key.public_key() > b.key.public_key() {
        std::mem::swap(&mut a, &mut b);
    }
    let timing = Timing::default();
    let t0 = 1_800_000_000_000u64;
    let mut lx = Exchange::new(&a, b.key.public_key(), b.kem.encaps_key(), timing, t0)?;
    let mut fx = Exchange::new(&b, a.key.public_key(), a.kem.encaps_key(), timing, t0)?;
    let (mut leader, mut follower) = (Vec::new(), Vec::new());
    let (mut datagrams, mut payload) = (0, 0);
    for r in 0..rounds {
        let now = t0 + r as u64 * 1_000;
        lx.fall_back(now);
        let (l, f, n, bytes) = round((&a, &mut lx), (&b, &mut fx), now)?;
        leader.push(l.as_secs_f64() * 1e6);
        follower.push(f.as_secs_f64() * 1e6);
        (datagrams, payload) = (n, bytes);
    }
    let (l, f) = (
        median(&leader).unwrap_or(0.0),
        median(&follower).unwrap_or(0.0),
    );
    // Inside the tunnel: IPv4 and UDP headers; on the underlay WireGuard adds its own
    // (IPv4 20, UDP 8, data header 16, tag 16) and pads the inner packet to 16 bytes.
    let inner = payload + datagrams * 28;
    let outer: usize = inner.div_ceil(16) * 16 + datagrams * (20 + 8 + 16 + 16);
    let period = Duration::from_millis(timing.period).as_secs_f64();
    let per_node_us = (l + f) / 2.0 * peers as f64;
    let cpu_share = per_node_us / 1e6 / period * 100.0;
    Ok(format!(
        "post-quantum round (ML-KEM-768, libcrux), median of {rounds} rounds:\n\
         | side | CPU per round |\n| --- | ---: |\n\
         | leader (encapsulate, decapsulate, derive) | {l:.0} µs |\n\
         | follower (decapsulate, encapsulate, derive) | {f:.0} µs |\n\
         per round: {datagrams} datagrams, {payload} bytes of messages, {inner} bytes inside the tunnel, about {outer} on the underlay\n\
         a node with {peers} peers at the {period:.0} s period: {per_node_us:.0} µs of CPU a period, {cpu_share:.4} % of one core; {:.1} KiB a period each way on the underlay\n",
        outer as f64 * peers as f64 / 2.0 / 1024.0
    ))
}
