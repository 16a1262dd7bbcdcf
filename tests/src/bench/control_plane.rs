//! Control-plane benchmark: N synthetic nodes in a real etcd feed one real `weft agent` in
//! a lab node (userspace WireGuard here). Measured from the agent's own log timestamps and
//! checked against the kernel:
//! - cold convergence: from the agent's first full listing to the end of the reconcile
//!   that programmed every peer and route (then verified: N peers on the device, N+1
//!   routes);
//! - steady state: the writes of the next resync pass (must be 0);
//! - the agent's RSS (and the userspace device process's), and its CPU while idle;
//! - incremental latency under churn: nodes added, removed and re-keyed at a steady rate;
//!   latency from the etcd write to the agent's log line saying the peer was programmed.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use weft_crypto::PrivateKey;

use super::{field, log_time, median, quantile};
use crate::lab::{Lab, LabConfig};

const PREFIX: &str = "/coreos.com/network";

pub struct ControlPlane {
    pub nodes: usize,
    pub cold_ms: f64,
    pub first_pass_writes: u64,
    pub steady_writes: u64,
    /// How long that steady-state pass took.
    pub steady_pass_ms: f64,
    pub agent_rss_kib: u64,
    pub device_rss_kib: u64,
    pub idle_cpu_percent: f64,
    /// Milliseconds, per operation kind: add, remove, key change.
    pub churn: Vec<(&'static str, Vec<f64>)>,
    pub churn_rate: f64,
}

fn synthetic_key(i: u32, generation: u32) -> String {
    let mut seed = [7u8; 32];
    seed[..4].copy_from_slice(&i.to_be_bytes());
    seed[4..8].copy_from_slice(&generation.to_be_bytes());
    PrivateKey::from_bytes(seed).public_key().to_base64()
}

fn lease_key(i: u32) -> (String, String) {
    let subnet = format!("10.{}.{}.0", 1 + i / 256, i % 256);
    (
        format!("{PREFIX}/subnets/{subnet}-24"),
        format!("{subnet}-24"),
    )
}

fn lease_value(i: u32, generation: u32) -> String {
    format!(
        r#"{{"PublicIP":"203.0.113.{}","PublicIPv6":null,"BackendType":"wireguard","BackendData":{{"PublicKey":"{}","Port":51820}}}}"#,
        1 + i % 250,
        synthetic_key(i, generation)
    )
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The first line after `from` containing `needle`, waiting up to `limit`.
fn wait_line(path: &Path, needle: &str, after: usize, limit: Duration) -> anyhow::Result<String> {
    let t = Instant::now();
    loop {
        let log = read_log(path);
        if let Some(line) = log.lines().skip(after).find(|l| l.contains(needle)) {
            return Ok(line.to_string());
        }
        if t.elapsed() > limit {
            bail!(
                "no {needle:?} in the agent log within {limit:?}:\n{}",
                tail(&log)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

fn ms_between(a: SystemTime, b: SystemTime) -> f64 {
    b.duration_since(a).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

fn proc_field(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// User + system CPU ticks of `pid`.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit(')').next().unwrap_or_default();
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3, utime 14, stime 15 (1-based) → 11, 12 here.
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    get(11) + get(12)
}

/// The userspace device process in the same network namespace as `pid`.
fn device_pid(pid: u32) -> Option<u32> {
    let ns = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()?;
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let p: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(format!("/proc/{p}/cmdline")).ok()?;
        let same = std::fs::read_link(format!("/proc/{p}/ns/net")).ok()? == ns;
        (same && String::from_utf8_lossy(&cmd).contains("userspace-device")).then_some(p)
    })
}

pub fn run(weft: &Path, nodes: usize, churn: Duration, rate: f64) -> anyhow::Result<ControlPlane> {
    let mut cfg = LabConfig::wireguard(1, weft);
    cfg.pods_per_node = 0;
    cfg.net_conf = r#"{"Network": "10.0.0.0/8", "Backend": {"Type": "wireguard"}}"#.into();
    cfg.extra_args.push("--resync-period=3".into());
    cfg.seed = (0..nodes as u32)
        .map(|i| (lease_key(i).0, lease_value(i, 0)))
        .collect();
    let lab = Lab::start(cfg).context("starting the lab")?;
    let log = lab.nodes[0].agent_log();
    let listed = wait_line(&log, "first full listing", 0, Duration::from_secs(60))?;
    let after_listing = read_log(&log)
        .lines()
        .position(|l| l.contains("first full listing"))
        .unwrap_or(0);
    let first = wait_line(&log, "reconciled", after_listing, Duration::from_secs(120))?;
    let cold_ms = match (log_time(&listed), log_time(&first)) {
        (Some(a), Some(b)) => ms_between(a, b),
        _ => bail!("unreadable log timestamps: {listed:?} / {first:?}"),
    };
    let peers = lab.on_node(0, "wg show flannel-wg peers | wc -l")?;
    let routes = lab.on_node(0, "ip -4 route show proto 87 dev flannel-wg | wc -l")?;
    if peers.trim() != nodes.to_string() || routes.trim() != (nodes + 1).to_string() {
        bail!(
            "not converged after the first pass: {} peers, {} routes for {nodes} nodes\n{}",
            peers.trim(),
            routes.trim(),
            tail(&read_log(&log))
        );
    }
    let first_pass_writes = field(&first, "writes")
        .and_then(|w| w.parse().ok())
        .unwrap_or(0);
    // The next resync pass: nothing changed, nothing may be written.
    let lines = read_log(&log).lines().count();
    let steady = wait_line(&log, "reconciled", lines, Duration::from_secs(10))?;
    let steady_writes = field(&steady, "writes")
        .and_then(|w| w.parse().ok())
        .unwrap_or(u64::MAX);
    let steady_pass_ms: f64 = field(&steady, "took_ms")
        .and_then(|w| w.parse().ok())
        .unwrap_or(f64::NAN);

    let pid = lab.agent_pid(0).context("the agent's pid")?;
    let before = cpu_ticks(pid);
    let idle = Duration::from_secs(6);
    std::thread::sleep(idle);
    let ticks = cpu_ticks(pid) - before;
    // SAFETY: sysconf(3) has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let idle_cpu_percent = ticks as f64 / hz / idle.as_secs_f64() * 100.0;
    let agent_rss_kib = proc_field(pid, "VmRSS:");
    let device_rss_kib = device_pid(pid).map_or(0, |d| proc_field(d, "VmRSS:"));

    let churned = churn_phase(&lab, nodes as u32, churn, rate)?;
    Ok(ControlPlane {
        nodes,
        cold_ms,
        first_pass_writes,
        steady_writes,
        steady_pass_ms,
        agent_rss_kib,
        device_rss_kib,
        idle_cpu_percent,
        churn: churned,
        churn_rate: rate,
    })
}

/// Adds, removes and re-keys nodes at `rate` per second for `span`; returns the latencies
/// in ms per kind, from each etcd write to the agent's line saying it was programmed.
fn churn_phase(
    lab: &Lab,
    nodes: u32,
    span: Duration,
    rate: f64,
) -> anyhow::Result<Vec<(&'static str, Vec<f64>)>> {
    if span.is_zero() {
        return Ok(Vec::new());
    }
    let log = lab.nodes[0].agent_log();
    let start_line = read_log(&log).lines().count();
    let endpoint = lab.etcd().endpoint();
    let ns = lab
        .etcd()
        .netns()
        .context("the lab's etcd runs in a namespace")?
        .to_string();
    // One client, in etcd's namespace, writing on a fixed schedule.
    let writer = crate::netns::in_named_netns(&ns, move || -> anyhow::Result<_> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let mut client = etcd_client::Client::connect([endpoint], None).await?;
            // (kind, the key whose add or removal marks it programmed, write time)
            let mut writes: Vec<(&'static str, String, SystemTime)> = Vec::new();
            // Nodes that exist, with their key generation; changes cycle through them.
            let mut pool: std::collections::VecDeque<(u32, u32)> =
                (0..nodes).map(|i| (i, 0)).collect();
            let mut next_new = nodes;
            let interval = Duration::from_secs_f64(1.0 / rate);
            let t0 = tokio::time::Instant::now();
            let mut op = 0u32;
            while t0.elapsed() < span {
                tokio::time::sleep_until(t0 + interval * op).await;
                let at = SystemTime::now();
                match op % 3 {
                    0 => {
                        let (key, _) = lease_key(next_new);
                        client.put(key, lease_value(next_new, 0), None).await?;
                        writes.push(("add", synthetic_key(next_new, 0), at));
                        pool.push_back((next_new, 0));
                        next_new += 1;
                    }
                    1 => {
                        let Some((id, generation)) = pool.pop_front() else {
                            break;
                        };
                        let (key, _) = lease_key(id);
                        client
                            .put(key, lease_value(id, generation + 1), None)
                            .await?;
                        writes.push(("key change", synthetic_key(id, generation + 1), at));
                        pool.push_back((id, generation + 1));
                    }
                    _ => {
                        let Some((id, generation)) = pool.pop_front() else {
                            break;
                        };
                        let (key, _) = lease_key(id);
                        client.delete(key, None).await?;
                        writes.push(("remove", synthetic_key(id, generation), at));
                    }
                }
                op += 1;
            }
            Ok(writes)
        })
    });
    let writes = writer
        .join()
        .map_err(|_| anyhow::anyhow!("the churn writer panicked"))???;
    // Wait until every written key shows up in the log (or give up after 10 s).
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = read_log(&log);
        let last = writes
            .last()
            .map(|(_, id, _)| id.as_str())
            .unwrap_or_default();
        if text.lines().skip(start_line).any(|l| l.contains(last)) || Instant::now() > deadline {
            // The last write is in: give the pass that carried it time to log the rest.
            std::thread::sleep(Duration::from_millis(500));
            break read_log(&log);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if std::env::var_os("WEFT_BENCH_DEBUG").is_some() {
        for l in text
            .lines()
            .skip(start_line)
            .filter(|l| l.contains("reconciled"))
            .take(8)
        {
            eprintln!("{l}");
        }
    }
    // "…: add peer NODE (KEY) endpoint …" and "…: remove peer KEY", each by key: a key is
    // added once and removed once, so adds and removals are kept apart.
    let mut added: HashMap<String, SystemTime> = HashMap::new();
    let mut removed: HashMap<String, SystemTime> = HashMap::new();
    for line in text.lines().skip(start_line) {
        let Some(at) = log_time(line) else { continue };
        if let Some(rest) = line.split(": add peer ").nth(1) {
            if let Some((key, _)) = rest.split_once(" (").and_then(|(_, r)| r.split_once(')')) {
                added.entry(key.to_string()).or_insert(at);
            }
        } else if let Some(key) = line
            .split(": remove peer ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
        {
            removed.entry(key.to_string()).or_insert(at);
        }
    }
    let seen = |kind: &str, key: &str| {
        if kind == "remove" {
            removed.get(key).copied()
        } else {
            added.get(key).copied()
        }
    };
    let mut out: Vec<(&'static str, Vec<f64>)> =
        vec![("add", vec![]), ("remove", vec![]), ("key change", vec![])];
    for (kind, id, at) in &writes {
        if let Some(done) = seen(kind, id) {
            if let Some(slot) = out.iter_mut().find(|(k, _)| k == kind) {
                slot.1.push(ms_between(*at, done));
            }
        }
    }
    let programmed: usize = out.iter().map(|(_, v)| v.len()).sum();
    if programmed < writes.len() {
        let missing: Vec<String> = writes
            .iter()
            .filter(|(kind, id, _)| seen(kind, id).is_none())
            .take(3)
            .map(|(k, id, _)| format!("{k} {id}"))
            .collect();
        bail!(
            "only {programmed} of {} churn operations were programmed within 10 s; e.g. {missing:?}\n{}",
            writes.len(),
            tail(&text)
        );
    }
    Ok(out)
}

/// One table row per run, plus churn percentiles.
pub fn report(results: &[ControlPlane]) -> String {
    let mut out = String::from(
        "| nodes | cold convergence (ms) | first pass writes | steady-state writes | resync pass (ms) | agent RSS (MiB) | device process RSS (MiB) | idle CPU (%), resync every 3 s |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in results {
        out += &format!(
            "| {} | {:.0} | {} | {} | {:.0} | {:.1} | {:.1} | {:.2} |\n",
            r.nodes,
            r.cold_ms,
            r.first_pass_writes,
            r.steady_writes,
            r.steady_pass_ms,
            r.agent_rss_kib as f64 / 1024.0,
            r.device_rss_kib as f64 / 1024.0,
            r.idle_cpu_percent
        );
    }
    out += "\n| nodes | churn (ops/s) | operation | count | p50 (ms) | p99 (ms) |\n| ---: | ---: | --- | ---: | ---: | ---: |\n";
    for r in results {
        for (kind, v) in &r.churn {
            out += &format!(
                "| {} | {:.0} | {kind} | {} | {:.1} | {:.1} |\n",
                r.nodes,
                r.churn_rate,
                v.len(),
                median(v).unwrap_or(f64::NAN),
                quantile(v, 0.99).unwrap_or(f64::NAN)
            );
        }
    }
    out
}
