//! Data-plane benchmark: two nodes, one pod each, one TCP flow pod to pod (SHA-256 at both
//! ends, and iperf3 with the machine's CPU per Gbit/s), four flows at once (iperf3 `-P 4`),
//! the RTT (median of 20 pings) and the pod MTU, for weft's three backends in the lab and
//! for references configured by hand on namespaces of the same shape: a raw veth pair
//! between the two pods, kernel vxlan, wireguard-go and boringtun-cli. Runs are interleaved
//! (every setup once per round), each setup fresh; the table gives medians and ratios.
//! `--baseline <weft binary>` adds an earlier build's userspace WireGuard beside this one
//! (a change's effect, side by side), `--wireguard-go <binary>` another wireguard-go beside
//! Debian's (today's, built by hand: then the ratios are to it), and `--only-wireguard`
//! leaves out every setup but raw veth, wireguard-go and weft's userspace WireGuard.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};

use super::iperf::{self, Flow};
use super::median;
use crate::lab::{in_ns, in_ns_private_mounts, run as run_cmd, Lab, LabConfig};
use crate::live_demo::{median_rtt_ms, transfer};

/// One setup of the table.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Setup {
    RawVeth,
    KernelVxlan,
    WeftHostGw,
    WeftVxlan,
    /// Debian's (on `PATH`).
    WireguardGo,
    /// `--wireguard-go`'s (today's, built by hand): the reference when given.
    WireguardGoGiven,
    BoringtunCli,
    WeftWireguard,
    /// `--baseline`'s build of weft, userspace WireGuard.
    Baseline,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::RawVeth => "raw veth (pod to pod, no hop)",
            Setup::KernelVxlan => "kernel vxlan (by hand)",
            Setup::WeftHostGw => "weft host-gw",
            Setup::WeftVxlan => "weft vxlan",
            Setup::WireguardGo => "wireguard-go, Debian's (by hand)",
            Setup::WireguardGoGiven => "wireguard-go, --wireguard-go's (by hand)",
            Setup::BoringtunCli => "boringtun-cli (by hand)",
            Setup::WeftWireguard => "weft wireguard (userspace)",
            Setup::Baseline => "weft wireguard (userspace), baseline build",
        }
    }

    fn measure(self, opts: &Options, weft: &Path) -> anyhow::Result<Sample> {
        let load = Load {
            bytes: opts.bytes,
            four_flows: true,
        };
        match self {
            Setup::RawVeth => raw_veth(load),
            Setup::KernelVxlan => by_hand(load, &kernel_vxlan),
            Setup::WeftHostGw => weft_setup(weft, "host-gw", load),
            Setup::WeftVxlan => weft_setup(weft, "vxlan", load),
            Setup::WireguardGo => by_hand(load, &userspace_wg("wireguard-go wg0".into())),
            Setup::WireguardGoGiven => match &opts.wireguard_go {
                Some(go) => by_hand(load, &userspace_wg(format!("{} wg0", go.display()))),
                None => bail!("no --wireguard-go binary"),
            },
            Setup::BoringtunCli => by_hand(
                load,
                &userspace_wg("boringtun-cli wg0 --disable-drop-privileges".into()),
            ),
            Setup::WeftWireguard => weft_setup(weft, "wireguard", load),
            Setup::Baseline => match &opts.baseline {
                Some(old) => weft_setup(old, "wireguard", load),
                None => bail!("no --baseline build"),
            },
        }
    }
}

/// What `scripts/bench data-plane` was asked for.
pub struct Options {
    pub runs: usize,
    pub bytes: u64,
    /// An earlier build of weft, measured beside this one.
    pub baseline: Option<PathBuf>,
    /// Raw veth, wireguard-go and weft's userspace WireGuard only.
    pub only_wireguard: bool,
    /// The wireguard-go to run (else the one on `PATH`).
    pub wireguard_go: Option<PathBuf>,
}

impl Options {
    fn setups(&self) -> Vec<Setup> {
        let mut setups = vec![Setup::RawVeth];
        if !self.only_wireguard {
            setups.extend([Setup::KernelVxlan, Setup::WeftHostGw, Setup::WeftVxlan]);
        }
        setups.push(Setup::WireguardGo);
        if self.wireguard_go.is_some() {
            setups.push(Setup::WireguardGoGiven);
        }
        if !self.only_wireguard {
            setups.push(Setup::BoringtunCli);
        }
        if self.baseline.is_some() {
            setups.push(Setup::Baseline);
        }
        setups.push(Setup::WeftWireguard);
        setups
    }
}

/// What a setup is measured with: the SHA-256 transfer's size, and whether four iperf3
/// flows at once are run too (the kernel table has no column for them).
#[derive(Clone, Copy)]
struct Load {
    bytes: u64,
    four_flows: bool,
}

struct Sample {
    mib_s: f64,
    rtt_ms: f64,
    flow: Flow,
    /// Four flows at once: their sum (when asked for).
    flows4: Option<Flow>,
    mtu: u32,
}

fn measure(from: &str, to_ns: &str, to: std::net::Ipv4Addr, load: Load) -> anyhow::Result<Sample> {
    // 20 pings to warm up (ARP, handshakes), then the 20 that count.
    in_ns(
        from,
        &format!("ping -c 20 -i 0.05 -W 1 -q {to} >/dev/null; true"),
    )?;
    let rtt_ms = median_rtt_ms(from, to, 20, "0.05").context("no ping replies")?;
    let (mib_s, intact) = transfer(from, to_ns, to, load.bytes)?;
    if !intact {
        bail!("the transfer arrived damaged");
    }
    Ok(Sample {
        mib_s,
        rtt_ms,
        flow: iperf::flow(from, to_ns, to, 1)?,
        flows4: match load.four_flows {
            true => Some(iperf::flow(from, to_ns, to, 4)?),
            false => None,
        },
        mtu: iperf::pod_mtu(from)?,
    })
}

fn weft_setup(weft: &Path, backend: &str, load: Load) -> anyhow::Result<Sample> {
    let cfg = if backend == "wireguard" {
        LabConfig::wireguard(2, weft)
    } else {
        LabConfig::backend(2, weft, backend, false)
    };
    weft_lab(cfg, backend, load)
}

/// The ipsec backend with ESP proposal `proposal`.
fn weft_ipsec(weft: &Path, proposal: &str, load: Load) -> anyhow::Result<Sample> {
    let mut cfg = LabConfig::backend(2, weft, "ipsec", false);
    cfg.net_conf = cfg.net_conf.replace(
        r#""Type": "ipsec""#,
        &format!(r#""Type": "ipsec", "ESPProposal": "{proposal}""#),
    );
    weft_lab(cfg, "ipsec", load)
}

fn weft_lab(mut cfg: LabConfig, backend: &str, load: Load) -> anyhow::Result<Sample> {
    cfg.pods_per_node = 1;
    cfg.extra_args.clear();
    let lab = Lab::start(cfg)?;
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    if !lab.ping(&a.ns, b.ip, Duration::from_secs(10)) {
        bail!("{backend}: pods cannot reach each other\n{}", lab.logs());
    }
    measure(&a.ns, &b.ns, b.ip, load)
}

/// Namespaces made by hand, removed on drop.
pub(super) struct Hand {
    names: Vec<String>,
    pub(super) dir: tempfile::TempDir,
}

impl Hand {
    pub(super) fn new(tag: &str, names: &[&str]) -> anyhow::Result<Hand> {
        let mut hand = Hand {
            names: Vec::new(),
            dir: tempfile::tempdir()?,
        };
        for n in names {
            let name = format!("{tag}-{n}");
            run_cmd(Command::new("ip").args(["netns", "add", &name]))?;
            hand.names.push(name.clone());
            in_ns(&name, "ip link set lo up")?;
        }
        Ok(hand)
    }
    pub(super) fn ns(&self, i: usize) -> &str {
        &self.names[i]
    }
}

impl Drop for Hand {
    fn drop(&mut self) {
        for name in &self.names {
            if let Ok(out) = Command::new("ip").args(["netns", "pids", name]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-9", pid]).status();
                }
            }
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

pub(super) fn tag() -> String {
    format!("wb{}", std::process::id())
}

/// Two pods joined by one veth pair: the ceiling for everything else.
fn raw_veth(load: Load) -> anyhow::Result<Sample> {
    let h = Hand::new(&tag(), &["p1", "p2"])?;
    in_ns(
        h.ns(0),
        &format!("ip link add eth0 type veth peer name eth0 netns {} && ip addr add 10.99.0.1/24 dev eth0 && ip link set eth0 up", h.ns(1)),
    )?;
    in_ns(
        h.ns(1),
        "ip addr add 10.99.0.2/24 dev eth0 && ip link set eth0 up",
    )?;
    measure(h.ns(0), h.ns(1), "10.99.0.2".parse()?, load)
}

/// Underlay (fabric bridge, two nodes) and a pod behind each node, joined by `tunnel`
/// (see `topology`), measured under `load`.
fn by_hand(
    load: Load,
    tunnel: &dyn Fn(&Hand, usize, &str, &str) -> anyhow::Result<String>,
) -> anyhow::Result<Sample> {
    let h = topology(&[], tunnel)?;
    measure(h.ns(3), h.ns(4), "10.244.2.2".parse()?, load)
}

/// Underlay (fabric bridge `br0` in namespace 0, nodes 198.51.100.1 and .2 in namespaces
/// 1 and 2) and a pod behind each node (namespaces 3 and 4, 10.244.N.2); `extra`
/// namespaces follow them, unconnected. `tunnel` joins the nodes (`node` index, own and
/// peer underlay address) and returns each node's device (`dev` or `dev via GATEWAY`).
pub(super) fn topology(
    extra: &[&str],
    tunnel: &dyn Fn(&Hand, usize, &str, &str) -> anyhow::Result<String>,
) -> anyhow::Result<Hand> {
    let mut names = vec!["fab", "n1", "n2", "p1", "p2"];
    names.extend(extra);
    let h = Hand::new(&tag(), &names)?;
    in_ns(h.ns(0), "ip link add br0 type bridge && ip link set br0 up")?;
    for i in 0..2 {
        let (node, pod) = (h.ns(1 + i), h.ns(3 + i));
        let ip = format!("198.51.100.{}", i + 1);
        in_ns(h.ns(0), &format!("ip link add n{i} type veth peer name eth0 netns {node} && ip link set n{i} master br0 up"))?;
        in_ns(node, &format!("ip addr add {ip}/24 dev eth0 && ip link set eth0 up && sysctl -qw net.ipv4.ip_forward=1"))?;
        in_ns(node, &format!("ip link add pod type veth peer name eth0 netns {pod} && ip addr add 10.244.{}.1/24 dev pod && ip link set pod up", i + 1))?;
        in_ns(pod, &format!("ip addr add 10.244.{}.2/24 dev eth0 && ip link set eth0 up && ip route add default via 10.244.{}.1", i + 1, i + 1))?;
    }
    for i in 0..2 {
        let (me, peer) = (
            format!("198.51.100.{}", i + 1),
            format!("198.51.100.{}", 2 - i),
        );
        let dev = tunnel(&h, i, &me, &peer)?;
        in_ns(
            h.ns(1 + i),
            &format!("ip route add 10.244.{}.0/24 dev {dev}", 2 - i),
        )?;
    }
    Ok(h)
}

fn kernel_vxlan(h: &Hand, i: usize, me: &str, peer: &str) -> anyhow::Result<String> {
    in_ns(
        h.ns(1 + i),
        &format!(
            "ip link add vx0 type vxlan id 42 local {me} remote {peer} dstport 4789 dev eth0 && \
                  ip addr add 10.99.9.{}/24 dev vx0 && ip link set vx0 mtu 1450 up",
            i + 1
        ),
    )?;
    // An L2 tunnel: the peer node is the next hop (it answers ARP on vx0).
    Ok(format!("vx0 via 10.99.9.{}", 2 - i))
}

/// A userspace WireGuard implementation run by hand: `daemon` starts a device named wg0
/// in the node's namespace (and backgrounds itself), then `wg set` configures it.
pub(super) fn userspace_wg(
    daemon: String,
) -> impl Fn(&Hand, usize, &str, &str) -> anyhow::Result<String> {
    move |h: &Hand, i: usize, _me: &str, peer: &str| {
        let node = h.ns(1 + i);
        let dir = h.dir.path().join(format!("n{i}"));
        std::fs::create_dir_all(dir.join("run"))?;
        let key = |n: usize| h.dir.path().join(format!("key{n}"));
        for n in 0..2 {
            if !key(n).exists() {
                let out = run_cmd(Command::new("wg").arg("genkey"))?;
                std::fs::write(key(n), &out.stdout)?;
            }
        }
        let public = run_cmd(
            Command::new("sh").args(["-c", &format!("wg pubkey < {}", key(1 - i).display())]),
        )?;
        // Each node's UAPI socket directory is its own: a private mount per node.
        let script = format!(
            "mkdir -p /var/run/wireguard && mount --bind {run} /var/run/wireguard && {daemon} && \
             wg set wg0 private-key {key} listen-port 51820 peer {peer_key} \
             allowed-ips 10.244.{other}.0/24 endpoint {peer}:51820 && ip link set wg0 mtu 1420 up",
            run = dir.join("run").display(),
            key = key(i).display(),
            peer_key = String::from_utf8_lossy(&public.stdout).trim(),
            other = 2 - i,
        );
        run_cmd(&mut in_ns_private_mounts(node, &script))
            .with_context(|| format!("starting {daemon}"))?;
        Ok("wg0".to_string())
    }
}

/// Runs every setup `opts.runs` times, interleaved; returns the table. Ratios are to raw
/// veth, and to `--wireguard-go`'s wireguard-go, else Debian's, else the baseline build.
pub fn run(weft: &Path, opts: &Options) -> anyhow::Result<String> {
    let setups = opts.setups();
    let runs = opts.runs;
    let mut samples: Vec<Vec<Sample>> = setups.iter().map(|_| Vec::new()).collect();
    for round in 0..runs {
        for (i, setup) in setups.iter().enumerate() {
            eprintln!(
                "data plane: round {} of {runs}: {}",
                round + 1,
                setup.name()
            );
            let s = (setup.measure(opts, weft))
                .with_context(|| format!("{}, round {}", setup.name(), round + 1))?;
            samples[i].push(s);
        }
    }
    let med = |v: &[Sample], f: fn(&Sample) -> f64| {
        median(&v.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
    };
    let of = |setup: Setup| {
        setups
            .iter()
            .position(|s| *s == setup)
            .map(|i| &samples[i][..])
    };
    let reference = (of(Setup::WireguardGoGiven).map(|s| ("--wireguard-go's", s)))
        .or_else(|| of(Setup::WireguardGo).map(|s| ("wireguard-go", s)))
        .or_else(|| of(Setup::Baseline).map(|s| ("baseline", s)));
    let base = med(&samples[0], |s| s.mib_s);
    let base_rtt = med(&samples[0], |s| s.rtt_ms);
    let (ref_name, ref_mib, ref_flow) = match reference {
        Some((name, s)) => (name, med(s, |s| s.mib_s), med(s, |s| s.flow.gbit_s)),
        None => ("-", f64::NAN, f64::NAN),
    };
    let mut out = format!(
        "| setup | throughput, median of {runs} (MiB/s) | vs raw veth | vs {ref_name} | RTT, median (ms) | runs (MiB/s) |\n| --- | ---: | ---: | ---: | ---: | --- |\n"
    );
    let mut flows = format!(
        "\n| setup | one TCP flow, iperf3, median of {runs} (Gbit/s) | vs {ref_name} | CPU (cores per Gbit/s) | four flows (Gbit/s) | four / one | RTT added over veth (µs) | pod MTU | runs, one flow (Gbit/s) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n"
    );
    // A ratio, or a dash where its reference was not measured.
    let ratio = |a: f64, b: f64| match (a / b).is_finite() {
        true => format!("{:.2}", a / b),
        false => "-".to_string(),
    };
    let list = |v: &[Sample], f: fn(&Sample) -> f64, digits: usize| {
        v.iter()
            .map(|s| format!("{:.*}", digits, f(s)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (setup, v) in setups.iter().zip(&samples) {
        let name = setup.name();
        let t = med(v, |s| s.mib_s);
        let r = med(v, |s| s.rtt_ms);
        out += &format!(
            "| {name} | {t:.0} | {} | {} | {r:.3} | {} |\n",
            ratio(t, base),
            ratio(t, ref_mib),
            list(v, |s| s.mib_s, 0)
        );
        let g = med(v, |s| s.flow.gbit_s);
        let g4 = med(v, |s| s.flows4.as_ref().map_or(f64::NAN, |f| f.gbit_s));
        let cpu = med(v, |s| s.flow.cores_per_gbit_s);
        let mtu = med(v, |s| f64::from(s.mtu));
        flows += &format!(
            "| {name} | {g:.2} | {} | {cpu:.2} | {g4:.2} | {} | {:.0} | {mtu:.0} | {} |\n",
            ratio(g, ref_flow),
            ratio(g4, g),
            (r - base_rtt) * 1000.0,
            list(v, |s| s.flow.gbit_s, 2)
        );
    }
    let mut header = String::new();
    let given = opts.wireguard_go.as_deref();
    for go in [Some(Path::new("wireguard-go")), given]
        .into_iter()
        .flatten()
    {
        let version = Command::new(go).arg("--version").output().map_or_else(
            |e| format!("{e}"),
            |o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_string()
            },
        );
        header += &format!("wireguard-go `{}`: {version}\n", go.display());
    }
    Ok(header + "\n" + &out + &flows)
}

/// The setups of a kernel with WireGuard and ESP (the VM runner): weft's encrypting
/// backends in the kernel beside vxlan.
const KERNEL_SETUPS: [&str; 4] = [
    "weft vxlan",
    "weft wireguard (kernel)",
    "weft ipsec (aes128gcm16)",
    "weft ipsec (chacha20poly1305)",
];

/// As `run`, for `KERNEL_SETUPS` (`WEFT_LAB_IMPLEMENTATION=kernel` makes the wireguard row
/// kernel WireGuard); ratios against weft vxlan and kernel WireGuard.
pub fn run_kernel(weft: &Path, runs: usize, bytes: u64) -> anyhow::Result<String> {
    let load = Load {
        bytes,
        four_flows: false,
    };
    let mut samples: Vec<Vec<Sample>> = KERNEL_SETUPS.iter().map(|_| Vec::new()).collect();
    for round in 0..runs {
        for (i, name) in KERNEL_SETUPS.iter().enumerate() {
            eprintln!("data plane: round {} of {runs}: {name}", round + 1);
            let s = match i {
                0 => weft_setup(weft, "vxlan", load),
                1 => weft_setup(weft, "wireguard", load),
                2 => weft_ipsec(weft, "aes128gcm16-sha256-prfsha256-ecp256", load),
                _ => weft_ipsec(weft, "chacha20poly1305-prfsha256-x25519", load),
            }
            .with_context(|| format!("{name}, round {}", round + 1))?;
            samples[i].push(s);
        }
    }
    let med = |v: &[Sample], f: fn(&Sample) -> f64| {
        median(&v.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN)
    };
    let (vxlan, wg) = (med(&samples[0], |s| s.mib_s), med(&samples[1], |s| s.mib_s));
    let mut out = format!(
        "| setup | throughput, median of {runs} (MiB/s) | vs weft vxlan | vs kernel WireGuard | RTT, median (ms) | runs (MiB/s) |\n| --- | ---: | ---: | ---: | ---: | --- |\n"
    );
    for (i, name) in KERNEL_SETUPS.iter().enumerate() {
        let t = med(&samples[i], |s| s.mib_s);
        let r = med(&samples[i], |s| s.rtt_ms);
        let all: Vec<String> = samples[i]
            .iter()
            .map(|s| format!("{:.1}", s.mib_s))
            .collect();
        out += &format!(
            "| {name} | {t:.1} | {:.2} | {:.2} | {r:.3} | {} |\n",
            t / vxlan,
            t / wg,
            all.join(", ")
        );
    }
    Ok(out)
}
