//! One TCP flow measured with iperf3 (the SHA-256 transfer of `live_demo::transfer` tops
//! out near 500 MiB/s, below what a fast tunnel carries), with the machine's CPU over the
//! same seconds, and a pod's MTU.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::lab::in_ns;

/// How long the flow runs.
const SECS: u32 = 5;
/// iperf3's port: not 5201, which the SHA-256 transfer uses.
const PORT: u16 = 5202;

/// What one flow gave.
pub struct Flow {
    /// Received at the far end.
    pub gbit_s: f64,
    /// Busy CPU of the whole machine (in cores) per Gbit/s carried.
    pub cores_per_gbit_s: f64,
}

/// Busy and total jiffies of all CPUs, from /proc/stat.
fn cpu_jiffies() -> anyhow::Result<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let line = stat
        .lines()
        .find(|l| l.starts_with("cpu "))
        .context("/proc/stat has no cpu line")?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().context("a /proc/stat cpu field"))
        .collect::<anyhow::Result<_>>()?;
    let total: u64 = fields.iter().take(8).sum();
    // idle and iowait are the 4th and 5th fields.
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    Ok((total - idle, total))
}

/// Whether `ns` has a TCP socket listening on `port`.
fn listening(ns: &str, port: u16) -> bool {
    in_ns(ns, &format!("ss -Htln 'sport = :{port}'"))
        .map(|out| !out.trim().is_empty())
        .unwrap_or(false)
}

/// Runs `parallel` iperf3 TCP flows at once from `from` to `to` (a server in `to_ns`):
/// their sum.
pub fn flow(from: &str, to_ns: &str, to: Ipv4Addr, parallel: u32) -> anyhow::Result<Flow> {
    in_ns(to_ns, &format!("iperf3 -s -1 -D -p {PORT}"))
        .context("starting iperf3's server (apt-get install iperf3)")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !listening(to_ns, PORT) {
        if Instant::now() > deadline {
            bail!("iperf3's server in {to_ns} did not listen on {PORT} within 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let (busy0, total0) = cpu_jiffies()?;
    let out = in_ns(
        from,
        &format!("iperf3 -c {to} -p {PORT} -t {SECS} -P {parallel} -J"),
    )
    .context("running iperf3's client")?;
    let (busy1, total1) = cpu_jiffies()?;
    let report: serde_json::Value = serde_json::from_str(&out).context("iperf3's JSON report")?;
    let bits = report["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .with_context(|| format!("iperf3 reported no received rate: {out}"))?;
    let gbit_s = bits / 1e9;
    let busy_cores = (busy1 - busy0) as f64 / (total1 - total0).max(1) as f64 * cpus;
    Ok(Flow {
        gbit_s,
        cores_per_gbit_s: busy_cores / gbit_s,
    })
}

/// The MTU of `eth0` in the pod namespace `ns` (the lab sets it from subnet.env).
pub fn pod_mtu(ns: &str) -> anyhow::Result<u32> {
    let out = in_ns(ns, "ip -o link show eth0")?;
    out.split_whitespace()
        .skip_while(|w| *w != "mtu")
        .nth(1)
        .and_then(|m| m.parse().ok())
        .with_context(|| format!("the MTU of eth0 in {ns}: {out:?}"))
}
