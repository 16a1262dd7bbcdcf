//! What a lab is made of: node count, pods, the net-conf, the agents' flags, per-node
//! WireGuard implementation, which nodes sit behind the router, and etcd seed data.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use super::Node;

/// Starts a node's agent some other way than the lab's own `weft agent` in the node's
/// namespaces (the image test runs one from the container image): given the node, the
/// command to spawn, run in the host's namespaces, its output going to the node's agent
/// log.
pub type AgentLauncher = Box<dyn Fn(&Node) -> anyhow::Result<Command> + Send + Sync>;

/// etcd's address, or the Kubernetes API server's (port 6443) in a kube lab.
pub const ETCD_IP: &str = "198.51.100.250";
pub const KUBE_API_PORT: u16 = 6443;
pub const EXT_IP: &str = "198.51.100.200";
/// The pod network's IPv6 half in a dual-stack lab.
pub const IPV6_NETWORK: &str = "fd00:10:244::/56";
/// flannel's etcd prefix, the agents' default.
pub const DEFAULT_ETCD_PREFIX: &str = "/coreos.com/network";

pub struct LabConfig {
    pub nodes: usize,
    pub pods_per_node: usize,
    /// net-conf.json put into etcd.
    pub net_conf: String,
    /// The `weft` binary the agents run.
    pub weft: PathBuf,
    pub extra_args: Vec<String>,
    /// Per node (cycled), its `--wireguard-implementation`; empty: the config's.
    pub implementations: Vec<String>,
    /// Nodes (by index) on the second segment, 203.0.113.0/24, behind the router.
    pub routed: Vec<usize>,
    /// etcd keys and values put before any agent starts (synthetic leases, say).
    pub seed: Vec<(String, String)>,
    /// Run the agents with the Kubernetes registry against the lab's API server instead
    /// of etcd; the lab registers each node with pod CIDR `10.244.<n>.0/24`, as the
    /// controller manager would.
    pub kube: bool,
    /// Nodes registered in a kube lab's API server before any agent starts: (name, pod
    /// CIDR, annotations), each with a kubelet's full status.
    pub kube_seed: Vec<(String, String, BTreeMap<String, String>)>,
    /// Nodes (by index) on a private segment, 192.0.2.0/24, behind a masquerading NAT
    /// whose outside address is `NAT_IP`; in a kube lab their Nodes carry
    /// `public-ip-overwrite: NAT_IP`, the only way in.
    pub natted: Vec<usize>,
    /// Two sites behind NATs (`sites::Sites`): nodes placed there get their site's
    /// private address, `--zone` and, with a 1:1 public address, `--public-ip` of it.
    pub sites: Option<super::sites::Sites>,
    /// Per node (by index), its zone (`topology.kubernetes.io/zone`, kube labs).
    pub zones: Vec<Option<String>>,
    /// Per node (by index), how its agent starts instead of the lab's own way.
    pub launchers: BTreeMap<usize, AgentLauncher>,
    /// The etcd prefix of an etcd lab; agents get `--etcd-prefix` when it is not flannel's.
    pub etcd_prefix: String,
    /// Capture the underlay from before the first agent starts, and start the clear-traffic
    /// watch's pod streams as soon as the pods exist (`Lab::take_start_watch`).
    pub watch_start: bool,
    /// Record every XFRM state installed on the nodes, from before the first agent starts
    /// (`Lab::xfrm_installed`).
    pub xfrm_record: bool,
    /// Nodes (by index) whose agent gets `--iface=eth0` instead of `--public-ip`: it finds
    /// its address itself, and follows it when it changes.
    pub own_address: Vec<usize>,
    /// Environment variables for one node's agent: (node index, name, value).
    pub agent_env: Vec<(usize, String, String)>,
    /// A dual-stack lab (`LabConfig::dual_stack`): every node has an IPv6 underlay address
    /// (`fd77::<n>/64`) beside its IPv4 one, and every pod an address of each family.
    pub ipv6: bool,
    /// IPv4 pod subnets (all but an IPv6-only lab, `LabConfig::ipv6_only`).
    pub ipv4: bool,
    /// The routed nodes sit behind two routers joined by a narrower link
    /// (`narrow::Narrow`), not behind one router.
    pub narrow: Option<super::narrow::Narrow>,
    /// Nodes (by index) whose own link to the fabric has this MTU (both ends of it), below
    /// everyone else's 1500: a node whose own link is the narrow one.
    pub link_mtu: Vec<(usize, u32)>,
    /// Seconds between each agent's releases of leaked pod addresses (its node's weft-cni
    /// data); 0: never.
    pub leaked_address_period: u64,
    /// `Lab::start` returns once every pair's first post-quantum round is in force and
    /// applied (`Lab::settle_post_quantum`); off for a test that watches the start itself.
    pub settle: bool,
}

/// Chooses the WireGuard implementation of the lab's nodes: `userspace` (the default),
/// `kernel`, `auto` (the agent's own choice), or `mixed` (kernel on odd-numbered nodes,
/// userspace on the others). The VM runner sets it to run the same scenarios on kernel
/// WireGuard. The lab checks that each node runs the implementation asked for, so a host
/// whose kernel gains WireGuard does not silently move the host lab onto it.
pub const IMPLEMENTATION_ENV: &str = "WEFT_LAB_IMPLEMENTATION";

impl LabConfig {
    pub fn wireguard(nodes: usize, weft: impl Into<PathBuf>) -> Self {
        let chosen = std::env::var(IMPLEMENTATION_ENV).unwrap_or_default();
        let implementations = match chosen.as_str() {
            "mixed" => vec!["kernel".into(), "userspace".into()],
            "" => vec!["userspace".into()],
            "auto" => vec![],
            one => vec![one.to_string()],
        };
        LabConfig {
            nodes,
            pods_per_node: 2,
            // Nodes lease below 10.244.200.0: tests write entries of their own above it
            // (a lease at a fixed name could otherwise overwrite a node's own).
            net_conf: r#"{"Network": "10.244.0.0/16", "SubnetMax": "10.244.199.0", "Backend": {"Type": "wireguard"}}"#.into(),
            weft: weft.into(),
            extra_args: vec!["--ip-masq".into()],
            implementations,
            routed: Vec::new(),
            seed: Vec::new(),
            kube: false,
            kube_seed: Vec::new(),
            natted: Vec::new(),
            sites: None,
            leaked_address_period: 60,
            zones: Vec::new(),
            launchers: BTreeMap::new(),
            etcd_prefix: DEFAULT_ETCD_PREFIX.into(),
            watch_start: false,
            xfrm_record: false,
            own_address: Vec::new(),
            agent_env: Vec::new(),
            ipv6: false,
            ipv4: true,
            narrow: None,
            link_mtu: Vec::new(),
            settle: true,
        }
    }

    /// A WireGuard lab on the Kubernetes registry.
    pub fn kube(nodes: usize, weft: impl Into<PathBuf>) -> Self {
        LabConfig {
            kube: true,
            ..LabConfig::wireguard(nodes, weft)
        }
    }

    /// This lab made dual-stack: `EnableIPv6` with pod network `fd00:10:244::/56` (a /64 per
    /// node) added to the net-conf, IPv6 underlay addresses on every node.
    pub fn dual_stack(mut self) -> Self {
        if let Ok(serde_json::Value::Object(mut conf)) =
            serde_json::from_str::<serde_json::Value>(&self.net_conf)
        {
            conf.insert("EnableIPv6".into(), true.into());
            conf.insert("IPv6Network".into(), IPV6_NETWORK.into());
            conf.insert("IPv6SubnetLen".into(), 64.into());
            self.net_conf = serde_json::Value::Object(conf).to_string();
        }
        self.ipv6 = true;
        self
    }

    /// This lab made IPv6-only (`EnableIPv4: false`): as `dual_stack`, with no IPv4 pod
    /// network; pods have IPv6 addresses only (`Pod::ip` is 0.0.0.0). The underlay keeps
    /// its IPv4 addresses too.
    pub fn ipv6_only(self) -> Self {
        let mut lab = self.dual_stack();
        if let Ok(serde_json::Value::Object(mut conf)) =
            serde_json::from_str::<serde_json::Value>(&lab.net_conf)
        {
            for key in ["Network", "SubnetMax"] {
                conf.remove(key);
            }
            conf.insert("EnableIPv4".into(), false.into());
            lab.net_conf = serde_json::Value::Object(conf).to_string();
        }
        lab.ipv4 = false;
        lab
    }

    /// This lab with WireGuard's `Mode` set (`auto`, `ipv6`, …).
    pub fn wireguard_mode(self, mode: &str) -> Self {
        self.backend_key("Mode", mode.into())
    }

    /// The config with `key` set to `value` in its `Backend`.
    pub fn backend_key(mut self, key: &str, value: serde_json::Value) -> Self {
        if let Ok(serde_json::Value::Object(mut conf)) =
            serde_json::from_str::<serde_json::Value>(&self.net_conf)
        {
            if let Some(serde_json::Value::Object(backend)) = conf.get_mut("Backend") {
                backend.insert(key.into(), value);
            }
            self.net_conf = serde_json::Value::Object(conf).to_string();
        }
        self
    }

    /// A lab on another backend: `vxlan` (with `DirectRouting` if `direct`) or `host-gw`.
    pub fn backend(nodes: usize, weft: impl Into<PathBuf>, backend: &str, direct: bool) -> Self {
        let extra = if direct {
            r#", "DirectRouting": true"#
        } else {
            ""
        };
        LabConfig {
            net_conf: format!(
                r#"{{"Network": "10.244.0.0/16", "SubnetMax": "10.244.199.0", "Backend": {{"Type": "{backend}"{extra}}}}}"#
            ),
            implementations: Vec::new(),
            ..LabConfig::wireguard(nodes, weft)
        }
    }
}

/// The router between the two segments: its address on each.
pub const ROUTER_IP: &str = "198.51.100.254";
pub const ROUTER_IP2: &str = "203.0.113.254";
/// The NAT in front of the natted nodes: outside (on the first segment) and inside.
pub const NAT_IP: &str = "198.51.100.253";
pub const NAT_INSIDE_IP: &str = "192.0.2.254";
