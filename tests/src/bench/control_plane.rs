//! Control-plane benchmark: N synthetic nodes in a real etcd (or as Node objects, with a
//! kubelet's full status, in the lab's Kubernetes API server) feed one real `weft agent`
//! in a lab node (userspace WireGuard here). Measured from the agent's own log timestamps and
//! checked against the kernel:
//! - cold convergence: from the agent's first full listing to the end of the reconcile
//!   that programmed every peer and route (then verified: N peers on the device, N+1
//!   routes);
//! - steady state: the writes of the next resync pass (must be 0);
//! - the agent's RSS (and the userspace device process's), and its CPU while idle;
//! - incremental latency under churn: nodes added, removed and re-keyed at a steady rate;
//!   latency from the registry write to the agent's log line saying the peer was
//!   programmed (`churn`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use weft_crypto::PrivateKey;

use super::churn::{self, Op};
use super::{field, log_time};
use crate::lab::{Lab, LabConfig};

const PREFIX: &str = "/coreos.com/network";

/// Which registry feeds the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registry {
    Etcd,
    Kube,
}

impl Registry {
    pub fn name(self) -> &'static str {
        match self {
            Registry::Etcd => "etcd",
            Registry::Kube => "kube",
        }
    }
}

pub struct ControlPlane {
    pub registry: Registry,
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

pub(super) fn synthetic_key(i: u32, generation: u32) -> String {
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

const ANNOTATION: &str = "flannel.alpha.coreos.com";

fn backend_data(i: u32, generation: u32) -> String {
    format!(
        r#"{{"PublicKey":"{}","Port":51820}}"#,
        synthetic_key(i, generation)
    )
}

/// Synthetic node `i` as a Node: its name, pod CIDR and flannel's annotations.
fn kube_node(i: u32) -> (String, String, BTreeMap<String, String>) {
    let (_, subnet) = lease_key(i);
    let cidr = subnet.replace('-', "/");
    let annotations = [
        ("kube-subnet-manager", "true".to_string()),
        ("backend-type", "wireguard".into()),
        ("public-ip", format!("203.0.113.{}", 1 + i % 250)),
        ("backend-data", backend_data(i, 0)),
    ]
    .into_iter()
    .map(|(k, v)| (format!("{ANNOTATION}/{k}"), v))
    .collect();
    (format!("syn-{i}"), cidr, annotations)
}

pub(super) fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The first line after `from` containing `needle`, waiting up to `limit`.
pub(super) fn wait_line(
    path: &Path,
    needle: &str,
    after: usize,
    limit: Duration,
) -> anyhow::Result<String> {
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

pub(super) fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

pub(super) fn ms_between(a: SystemTime, b: SystemTime) -> f64 {
    b.duration_since(a).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

pub(super) fn proc_field(pid: u32, key: &str) -> u64 {
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
pub(super) fn device_pid(pid: u32) -> Option<u32> {
    let ns = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()?;
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let p: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(format!("/proc/{p}/cmdline")).ok()?;
        let same = std::fs::read_link(format!("/proc/{p}/ns/net")).ok()? == ns;
        (same && String::from_utf8_lossy(&cmd).contains("userspace-device")).then_some(p)
    })
}

/// The lab of these benchmarks: one real agent (no pods), `nodes` synthetic nodes in
/// `registry`.
pub(super) fn start_lab(weft: &Path, registry: Registry, nodes: usize) -> anyhow::Result<Lab> {
    start_lab_with(weft, registry, nodes, 1)
}

/// As `start_lab`, with `real` nodes running agents (node 0 is the one measured), each
/// with a pod when there are several.
pub(super) fn start_lab_with(
    weft: &Path,
    registry: Registry,
    nodes: usize,
    real: usize,
) -> anyhow::Result<Lab> {
    let mut cfg = match registry {
        Registry::Etcd => LabConfig::wireguard(real, weft),
        Registry::Kube => LabConfig::kube(real, weft),
    };
    cfg.pods_per_node = usize::from(real > 1);
    // The agent's own subnet comes from 10.200.0.0 up, apart from the synthetic nodes'
    // (10.1.0.0 up, `lease_key`): otherwise it could pick the subnet of a node the churn
    // adds later, and that add would overwrite the agent's own lease instead of adding a
    // peer (seen as an add that was never programmed).
    cfg.net_conf =
        r#"{"Network": "10.0.0.0/8", "SubnetMin": "10.200.0.0", "Backend": {"Type": "wireguard"}}"#
            .into();
    cfg.extra_args.push("--resync-period=3".into());
    match registry {
        Registry::Etcd => {
            cfg.seed = (0..nodes as u32)
                .map(|i| (lease_key(i).0, lease_value(i, 0)))
                .collect()
        }
        Registry::Kube => cfg.kube_seed = (0..nodes as u32).map(kube_node).collect(),
    }
    Lab::start(cfg).context("starting the lab")
}

pub fn run(
    weft: &Path,
    registry: Registry,
    nodes: usize,
    churn: Duration,
    rate: f64,
) -> anyhow::Result<ControlPlane> {
    let lab = start_lab(weft, registry, nodes)?;
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
        registry,
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

/// Adds, removes and re-keys nodes at `rate` per second for `span` through the lab's
/// registry; returns the latencies in ms per kind.
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
    let writes = churn_writes(lab, nodes, span, rate)?;
    churn::analyse(&log, start_line, &writes)
}

/// The churn's registry writes, as made (see `churn::schedule`).
pub(super) fn churn_writes(
    lab: &Lab,
    nodes: u32,
    span: Duration,
    rate: f64,
) -> anyhow::Result<Vec<churn::Write>> {
    Ok(if let Some(api) = &lab.kube {
        churn::schedule(nodes, span, rate, |op| {
            match op {
                Op::Add(i) => {
                    let (name, cidr, annotations) = kube_node(i);
                    api.add_node_with(&name, &[&cidr], &BTreeMap::new(), &annotations);
                }
                Op::Rekey(i, generation) => {
                    let key = format!("{ANNOTATION}/backend-data");
                    api.annotate(
                        &format!("syn-{i}"),
                        &key,
                        Some(&backend_data(i, generation)),
                    );
                }
                Op::Remove(i) => {
                    api.delete_node(&format!("syn-{i}"));
                }
            }
            Ok(())
        })?
    } else {
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
            let mut client = rt.block_on(etcd_client::Client::connect([endpoint], None))?;
            churn::schedule(nodes, span, rate, |op| {
                rt.block_on(async {
                    match op {
                        Op::Add(i) => client
                            .put(lease_key(i).0, lease_value(i, 0), None)
                            .await
                            .map(drop),
                        Op::Rekey(i, g) => client
                            .put(lease_key(i).0, lease_value(i, g), None)
                            .await
                            .map(drop),
                        Op::Remove(i) => client.delete(lease_key(i).0, None).await.map(drop),
                    }
                })
                .map_err(Into::into)
            })
        });
        writer
            .join()
            .map_err(|_| anyhow::anyhow!("the churn writer panicked"))???
    })
}
