//! The lab: N weft nodes on this machine, each a network namespace with its own mount
//! namespace (private `/run`, hence `/var/run/wireguard`, and `/var/lib/weft`), so every
//! agent runs with its default paths. The underlay is a bridge in a fabric namespace
//! (198.51.100.0/24); etcd runs in its own namespace on it; an "ext" namespace stands for
//! the world outside the pod network and is every node's default route, so a packet that
//! escaped the tunnel would have somewhere to go, and be seen. Pods are attached as a
//! container runtime would: through the CNI conflist weft ships (`weft-cni` delegating to
//! the real bridge and host-local plugins), which creates each node's `cni0`.
//!
//! The registry is etcd, or with `LabConfig::kube` the lab's Kubernetes API server
//! (`crate::kube_api`) in the same namespace.
//!
//! Every namespace is named `wl<pid>x<n>-…`; dropping the lab removes them, and a new lab
//! first removes those of processes that no longer exist (a crashed earlier run). Test
//! traffic never leaves the namespaces the lab made.

mod agent_log;
mod agents;
pub mod capture;
pub mod clear_watch;
pub mod cni;
mod config;
mod fabric;
pub mod forge;
pub mod narrow;
pub mod nat;
mod operator;
pub use agents::flanneld_launcher;
pub use operator::SwitchWatch;
mod pods;
mod reach;
pub mod read;
pub mod rollout;
mod secrets;
pub mod settle;
pub mod sites;
mod turn;
pub mod xfrm_record;

use std::collections::BTreeMap;
use std::fs;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{bail, Context};
use ipnet::{Ipv4Net, Ipv6Net};

pub use config::{
    AgentLauncher, LabConfig, DEFAULT_ETCD_PREFIX, ETCD_IP, EXT_IP, IMPLEMENTATION_ENV,
    KUBE_API_PORT, NAT_INSIDE_IP, NAT_IP, ROUTER_IP, ROUTER_IP2,
};
pub use fabric::{clean_stale, devices_created, in_ns, in_ns_private_mounts, run};

use crate::kube_api::KubeApi;
use crate::Etcd;
use fabric::{attach, attach_to, Namespaces};

pub struct Pod {
    pub ns: String,
    /// Its IPv4 address; 0.0.0.0 in an IPv6-only lab.
    pub ip: Ipv4Addr,
    /// Its IPv6 address, in a dual-stack lab.
    pub ip6: Option<Ipv6Addr>,
    /// The CNI attachment and its ADD result (for CHECK and DEL).
    pub attachment: cni::Attachment,
    pub result: serde_json::Value,
}

pub struct Node {
    pub index: usize,
    pub ns: String,
    pub ip: Ipv4Addr,
    pub dir: PathBuf,
    pub subnet: Option<Ipv4Net>,
    /// Its IPv6 pod subnet, in a dual-stack lab.
    pub subnet_v6: Option<Ipv6Net>,
    pub pods: Vec<Pod>,
    agent: Option<Child>,
}

impl Node {
    pub fn subnet_env(&self) -> PathBuf {
        self.dir.join("run/flannel/subnet.env")
    }
    pub fn agent_log(&self) -> PathBuf {
        self.dir.join("agent.log")
    }
}

pub struct Lab {
    pub tag: String,
    dir: tempfile::TempDir,
    etcd: Option<Etcd>,
    /// The API server of a kube lab.
    pub kube: Option<KubeApi>,
    pub nodes: Vec<Node>,
    cni_bin: PathBuf,
    cfg: LabConfig,
    /// The watch `LabConfig::watch_start` began.
    start_watch: Option<clear_watch::ClearWatch>,
    /// The record `LabConfig::xfrm_record` began.
    xfrm_record: Option<xfrm_record::XfrmRecord>,
    /// Dropped last (after `Lab::drop` stops the processes): removes every namespace.
    namespaces: Namespaces,
    /// Released after everything else: the next lab of this process may start.
    _turn: turn::Turn,
}

static LABS: AtomicUsize = AtomicUsize::new(0);

/// Every pair of a lab is post-quantum protected within this of its agents' start (the
/// target is 5 s; emulation in the VM is slower).
const SETTLE_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);
/// The same with nodes behind a NAT: a pair across it has a tunnel only once the natted
/// node has sent (a handshake, at the latest its keepalive), so its first round's message
/// may be lost and its retries (1 s, doubling) come 1, 3, 7 and 15 s after it. In the VM a
/// cross-NAT pair once had no PSK after 10 s while every other pair had one.
const SETTLE_WITHIN_NAT: std::time::Duration = std::time::Duration::from_secs(20);

impl Lab {
    /// Builds the fabric, etcd and the nodes, starts every agent and wires the pods once
    /// each node has its subnet.
    pub fn start(mut cfg: LabConfig) -> anyhow::Result<Lab> {
        let turn = turn::Turn::take();
        let timeline = Timeline::start();
        clean_stale();
        if !cfg.weft.exists() {
            bail!(
                "the weft binary {} does not exist; build it first",
                cfg.weft.display()
            );
        }
        let tag = format!(
            "wl{}x{}",
            std::process::id(),
            LABS.fetch_add(1, Ordering::SeqCst)
        );
        let fabric = format!("{tag}-fab");
        let mut namespaces = Namespaces::default();
        namespaces.add(&fabric)?;
        in_ns(&fabric, "ip link add br0 type bridge && ip link set br0 up")?;
        for (name, ip) in [("ext", EXT_IP), ("etcd", ETCD_IP)] {
            let ns = format!("{tag}-{name}");
            namespaces.add(&ns)?;
            attach(&fabric, &ns, name, ip)?;
        }
        in_ns(&format!("{tag}-ext"), "sysctl -qw net.ipv4.ip_forward=1")?;
        if !cfg.routed.is_empty() {
            narrow::build(&tag, &fabric, &mut namespaces, cfg.narrow, cfg.ipv6)?;
        }
        if !cfg.natted.is_empty() {
            nat::build(&tag, &fabric, &mut namespaces)?;
        }
        if cfg.sites.is_some() {
            sites::build(&tag, &fabric, &mut namespaces)?;
        }
        timeline.mark("fabric built");
        let dir = tempfile::Builder::new().prefix("weft-lab-").tempdir()?;
        let cni_bin = cni::plugin_dir(dir.path(), &cfg.weft)?;
        let (etcd, kube) = start_registry(&mut cfg, &tag, dir.path())?;
        timeline.mark("registry up");
        let count = cfg.nodes;
        let mut lab = Lab {
            tag,
            dir,
            etcd,
            kube,
            nodes: Vec::new(),
            cni_bin,
            cfg,
            start_watch: None,
            xfrm_record: None,
            namespaces,
            _turn: turn,
        };
        for _ in 0..count {
            lab.create_node()?;
        }
        timeline.mark("nodes created");
        if lab.cfg.xfrm_record {
            let namespaces: Vec<(usize, String)> =
                lab.nodes.iter().map(|n| (n.index, n.ns.clone())).collect();
            lab.xfrm_record = Some(xfrm_record::XfrmRecord::start(lab.dir(), &namespaces)?);
        }
        let capture = match lab.cfg.watch_start {
            true => Some(capture::UnderlayCapture::start(&lab)?),
            false => None,
        };
        for i in 0..count {
            lab.start_agent(i)?;
        }
        timeline.mark("agents started");
        let all: Vec<usize> = (0..count).collect();
        lab.wire_pods(&all, &timeline)?;
        if let Some(capture) = capture {
            lab.start_watch = Some(clear_watch::ClearWatch::with_capture(&lab, capture)?);
        }
        for i in 0..count {
            lab.check_implementation(i)?;
        }
        if lab.cfg.settle {
            let within = match lab.cfg.natted.is_empty() && lab.cfg.sites.is_none() {
                true => SETTLE_WITHIN,
                false => SETTLE_WITHIN_NAT,
            };
            lab.settle_post_quantum(within)?;
            timeline.mark("post-quantum settled");
        }
        Ok(lab)
    }

    /// The clear-traffic watch running since before the agents started
    /// (`LabConfig::watch_start`).
    pub fn take_start_watch(&mut self) -> Option<clear_watch::ClearWatch> {
        self.start_watch.take()
    }

    /// The namespace and underlay address of a new node; no agent yet.
    fn create_node(&mut self) -> anyhow::Result<usize> {
        let i = self.nodes.len() + 1;
        let ns = format!("{}-n{i}", self.tag);
        self.namespaces.add(&ns)?;
        let routed = self.cfg.routed.contains(&(i - 1));
        let natted = self.cfg.natted.contains(&(i - 1));
        let site = self.cfg.sites.as_ref().and_then(|s| s.node(i - 1, i));
        let (ip, bridge, routes) = if let Some(placed) = site {
            placed
        } else if natted {
            (
                Ipv4Addr::new(192, 0, 2, i as u8),
                "br2",
                format!("ip route add default via {NAT_INSIDE_IP}"),
            )
        } else if routed {
            (
                Ipv4Addr::new(203, 0, 113, i as u8),
                "br1",
                format!("ip route add default via {ROUTER_IP2}"),
            )
        } else if self.cfg.routed.is_empty() {
            (
                Ipv4Addr::new(198, 51, 100, i as u8),
                "br0",
                format!("ip route add default via {EXT_IP}"),
            )
        } else {
            (
                Ipv4Addr::new(198, 51, 100, i as u8),
                "br0",
                format!("ip route add default via {EXT_IP} && ip route add 203.0.113.0/24 via {ROUTER_IP}"),
            )
        };
        attach_to(
            &self.fabric(),
            bridge,
            &ns,
            &format!("n{i}"),
            "eth0",
            &ip.to_string(),
        )?;
        in_ns(
            &ns,
            &format!("sysctl -qw net.ipv4.ip_forward=1 && {routes}"),
        )?;
        if let Some(sites) = &self.cfg.sites {
            if let (Some(site), Some(public)) = (sites.site(i - 1), sites.public_of(i - 1)) {
                sites::map(&self.tag, site, public, ip)?;
            }
        }
        if let Some((_, mtu)) = self.cfg.link_mtu.iter().find(|(n, _)| *n == i - 1) {
            in_ns(&ns, &format!("ip link set eth0 mtu {mtu}"))?;
            in_ns(&self.fabric(), &format!("ip link set n{i} mtu {mtu}"))?;
        }
        if self.cfg.ipv6 {
            // On the second segment: its own prefix, routed by the router(s).
            let (address, route) = if routed {
                (
                    narrow::routed_ipv6(i),
                    format!(" && ip -6 route add default via {}", narrow::ROUTER_IP6_2),
                )
            } else if !self.cfg.routed.is_empty() {
                (
                    ipv6_underlay(i),
                    format!(
                        " && ip -6 route add {} via {}",
                        narrow::SECOND_SEGMENT_V6,
                        narrow::ROUTER_IP6
                    ),
                )
            } else {
                (ipv6_underlay(i), String::new())
            };
            in_ns(
                &ns,
                &format!(
                    "sysctl -qw net.ipv6.conf.all.forwarding=1 && ip -6 addr add {address} dev eth0 nodad{route}"
                ),
            )?;
        }
        if let Some(api) = &self.kube {
            let mut labels = BTreeMap::new();
            if let Some(Some(zone)) = self.cfg.zones.get(i - 1) {
                labels.insert("topology.kubernetes.io/zone".to_string(), zone.clone());
            }
            let mut annotations = BTreeMap::new();
            if natted {
                annotations.insert(
                    "flannel.alpha.coreos.com/public-ip-overwrite".to_string(),
                    NAT_IP.to_string(),
                );
            }
            let mut cidrs = Vec::new();
            if self.cfg.ipv4 {
                cidrs.push(format!("10.244.{i}.0/24"));
            }
            if self.cfg.ipv6 {
                cidrs.push(format!("fd00:10:244:{i:x}::/64"));
            }
            let cidrs: Vec<&str> = cidrs.iter().map(String::as_str).collect();
            api.add_node_with(&format!("n{i}"), &cidrs, &labels, &annotations);
        }
        let dir = self.dir.path().join(format!("n{i}"));
        for sub in ["run", "lib", "cni"] {
            fs::create_dir_all(dir.join(sub))?;
        }
        self.nodes.push(Node {
            index: i,
            ns,
            ip,
            dir,
            subnet: None,
            subnet_v6: None,
            pods: Vec::new(),
            agent: None,
        });
        Ok(i - 1)
    }

    /// A node joining later: created, its agent started, its pods wired. Returns its index.
    pub fn add_node(&mut self) -> anyhow::Result<usize> {
        let i = self.create_node()?;
        self.start_agent(i)?;
        self.wire_pods(&[i], &Timeline::start())?;
        self.check_implementation(i)?;
        Ok(i)
    }

    /// Runs `script` as node `i` sees the world: its network namespace and its private
    /// `/run` and `/var/lib/weft` (e.g. `wg show flannel-wg`, which needs the node's UAPI
    /// socket).
    pub fn on_node(&self, i: usize, script: &str) -> anyhow::Result<String> {
        let out = run(&mut self.node_shell(i, script))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Node `i`'s `weft status` (pairs' liveness included), or why there is none.
    pub fn status(&self, i: usize) -> String {
        let weft = self.cfg.weft.display();
        self.on_node(i, &format!("{weft} status"))
            .unwrap_or_else(|e| format!("(weft status failed: {e:#})"))
    }

    /// Starts `script` as `on_node` runs it, without waiting for it: the caller kills the
    /// child (its output goes nowhere).
    pub fn spawn_on_node(&self, i: usize, script: &str) -> anyhow::Result<Child> {
        self.node_shell(i, script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting on node {i}: {script}"))
    }

    pub fn fabric(&self) -> String {
        format!("{}-fab", self.tag)
    }

    pub fn ext(&self) -> String {
        format!("{}-ext", self.tag)
    }

    /// The agent logs of every node, for failure messages.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                format!(
                    "--- node {} ---\n{}",
                    n.index,
                    fs::read_to_string(n.agent_log()).unwrap_or_default()
                )
            })
            .collect()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The lab's etcd; panics in a kube lab, which has none.
    pub fn etcd(&self) -> &Etcd {
        match &self.etcd {
            Some(etcd) => etcd,
            None => panic!("this lab runs the Kubernetes registry; it has no etcd"),
        }
    }

    /// The lab's etcd, to stop, restart or restore it.
    pub fn etcd_mut(&mut self) -> &mut Etcd {
        match &mut self.etcd {
            Some(etcd) => etcd,
            None => panic!("this lab runs the Kubernetes registry; it has no etcd"),
        }
    }
}

/// The lab's registry in its namespace: etcd with the net-conf and the seed, or (a kube
/// lab) the API server with its kubeconfig and seeded Nodes.
fn start_registry(
    cfg: &mut LabConfig,
    tag: &str,
    dir: &Path,
) -> anyhow::Result<(Option<Etcd>, Option<KubeApi>)> {
    if cfg.kube {
        let api = KubeApi::start(
            Some(&format!("{tag}-etcd")),
            ETCD_IP.parse()?,
            KUBE_API_PORT,
        )?;
        api.write_kubeconfig(&dir.join("kubeconfig"))?;
        for (name, cidr, annotations) in std::mem::take(&mut cfg.kube_seed) {
            api.add_node_with(&name, &[&cidr], &BTreeMap::new(), &annotations);
        }
        fs::write(dir.join("net-conf.json"), &cfg.net_conf)?;
        Ok((None, Some(api)))
    } else {
        let mut etcd = Etcd::reserve_in(&format!("{tag}-etcd"), ETCD_IP)?;
        etcd.launch()?;
        etcd.etcdctl(&["put", &format!("{}/config", cfg.etcd_prefix), &cfg.net_conf])?;
        if !cfg.seed.is_empty() {
            etcd.put_many(std::mem::take(&mut cfg.seed))
                .context("seeding etcd")?;
        }
        Ok((Some(etcd), None))
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let timeline = Timeline::start();
        for i in 0..self.nodes.len() {
            let _ = self.stop_agent(i, "KILL");
        }
        if let Some(etcd) = self.etcd.as_mut() {
            etcd.stop();
        }
        timeline.mark("agents and etcd stopped");
    }
}

/// `WEFT_LAB_TIMELINE=1`: when each phase of a lab's start and stop ended, on stderr (where
/// a lab's time goes, under emulation in particular).
pub(crate) struct Timeline(Option<std::time::Instant>);

impl Timeline {
    fn start() -> Timeline {
        let on = std::env::var_os("WEFT_LAB_TIMELINE").is_some_and(|v| v == "1");
        Timeline(on.then(std::time::Instant::now))
    }

    pub(crate) fn mark(&self, phase: &str) {
        if let Some(t0) = self.0 {
            eprintln!("lab timeline: {phase} after {:.2?}", t0.elapsed());
        }
    }
}

/// Node `i`'s (1-based) IPv6 underlay address, with its prefix, in a dual-stack lab.
pub fn ipv6_underlay(i: usize) -> String {
    format!("fd77::{i:x}/64")
}
