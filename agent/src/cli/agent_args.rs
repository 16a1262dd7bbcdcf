//! The agent's flags. Names are flanneld's where flanneld has one (docs/architecture.md), so an
//! existing DaemonSet's `args:` and `FLANNELD_*` environment keep working.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Args};

pub const DEFAULT_NET_CONFIG_PATH: &str = "/etc/kube-flannel/net-conf.json";

fn parse_seconds(s: &str) -> Result<Duration, String> {
    s.trim_end_matches('s')
        .parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|_| format!("{s:?} is not a number of seconds"))
}

fn parse_minutes(s: &str) -> Result<Duration, String> {
    s.trim_end_matches('m')
        .parse::<u64>()
        .map(|m| Duration::from_secs(m * 60))
        .map_err(|_| format!("{s:?} is not a number of minutes"))
}

/// A boolean flag as Go's `flag` package takes it: `--ip-masq`, `--ip-masq=true`,
/// `--ip-masq=false`.
macro_rules! go_bool {
    () => {
        clap::value_parser!(bool)
    };
}

#[derive(Debug, Clone, Args)]
pub struct AgentArgs {
    /// Use the Kubernetes API (Node objects) as the registry instead of etcd.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = go_bool!())]
    pub kube_subnet_mgr: bool,

    /// Kubernetes API server URL (default: in-cluster config).
    #[arg(long, default_value = "")]
    pub kube_api_url: String,

    /// kubeconfig file (default: in-cluster config).
    #[arg(long, default_value = "")]
    pub kubeconfig_file: String,

    /// Prefix of the Node annotations weft reads and writes.
    #[arg(long, default_value = "flannel.alpha.coreos.com")]
    pub kube_annotation_prefix: String,

    /// Set the node's NetworkUnavailable condition to False once the data plane is up.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = go_bool!())]
    pub set_node_network_unavailable: bool,

    /// etcd endpoints, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    pub etcd_endpoints: Vec<String>,

    /// etcd key prefix holding `config` and `subnets/`.
    #[arg(long, default_value = "/coreos.com/network")]
    pub etcd_prefix: String,

    #[command(flatten)]
    pub etcd: super::EtcdAccessArgs,

    /// Interface (name or address) to use for inter-node traffic; may be repeated.
    #[arg(long, value_delimiter = ',')]
    pub iface: Vec<String>,

    /// Regular expression selecting the interface; may be repeated.
    #[arg(long, value_delimiter = ',')]
    pub iface_regex: Vec<String>,

    /// Use the interface that routes to this address.
    #[arg(long)]
    pub iface_can_reach: Option<IpAddr>,

    /// IPv4 address to advertise to peers (the tunnel endpoint).
    #[arg(long)]
    pub public_ip: Option<Ipv4Addr>,

    /// IPv6 address to advertise to peers.
    #[arg(long)]
    pub public_ipv6: Option<Ipv6Addr>,

    /// Install masquerade rules for traffic leaving the pod network.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = go_bool!())]
    pub ip_masq: bool,

    /// Write the masquerade rules as iptables chains instead of nftables.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = go_bool!())]
    pub iptables: bool,

    /// Where to write the subnet file read by the flannel CNI plugin.
    #[arg(long, default_value = "/run/flannel/subnet.env")]
    pub subnet_file: PathBuf,

    /// net-conf.json (Kubernetes mode; etcd mode reads `<prefix>/config`).
    #[arg(long, default_value = DEFAULT_NET_CONFIG_PATH)]
    pub net_config_path: PathBuf,

    /// Address the health endpoints listen on.
    #[arg(long, default_value = "0.0.0.0")]
    pub healthz_ip: IpAddr,

    /// Address `/metrics` listens on, with --metrics-port.
    #[arg(long, default_value = "0.0.0.0")]
    pub metrics_ip: IpAddr,

    /// Port for `/metrics` alone (0: served beside the health endpoints, on
    /// --healthz-port), so that health can listen on loopback only.
    #[arg(long, default_value = "0")]
    pub metrics_port: u16,

    /// Port of the health endpoints (0 = off).
    #[arg(long, default_value = "0")]
    pub healthz_port: u16,

    /// Renew the etcd lease this many minutes before it expires.
    #[arg(long, default_value = "60", value_parser = parse_minutes)]
    pub subnet_lease_renew_margin: Duration,

    /// UDP port on which this node answers path MTU probes and sends its own, to the same
    /// port of every peer (0 = no path MTU discovery: every peer route keeps the pod MTU).
    /// Not WireGuard's 51820/51821 (`ListenPort`, `ListenPortV6`): the probes go beside
    /// the tunnel, so the port must be open between nodes as the tunnel's is. It listens on
    /// every address; each source gets at most 64 answers at once and 16 a second, and
    /// between nodes with keys (WireGuard, ipsec) an answer counts only with the pair's tag.
    #[arg(long, default_value = "51822")]
    pub path_mtu_port: u16,

    /// UDP port of the post-quantum rounds (`Backend.PostQuantum`). WireGuard: the rounds
    /// go inside the tunnel and are taken on this node's tunnel addresses only; on its
    /// public IPs the port takes one message alone, the `classical` notice that repairs a
    /// pair whose tunnel is broken. ipsec: the rounds go between the public IPs, and the
    /// port listens on every address.
    #[arg(long, default_value = "51823")]
    pub post_quantum_port: u16,

    /// This node takes no part in post-quantum rounds whatever the config says: it publishes
    /// no ML-KEM key, and its pairs stay classical (a node-by-node rollout, as a node of an
    /// older weft would be).
    #[arg(long, env = "WEFT_POST_QUANTUM_OFF", hide = true)]
    pub post_quantum_off: bool,

    /// Seconds between a pair's post-quantum rounds.
    #[arg(long, default_value = "120", value_parser = parse_seconds, hide = true)]
    pub post_quantum_period: Duration,

    /// How often, in seconds, each peer's path is checked for a changed MTU (two
    /// datagrams per peer); a changed path is measured again at once.
    #[arg(long, default_value = "2", value_parser = parse_seconds)]
    pub path_mtu_check: Duration,

    /// Full resync period, in seconds: re-plan and repair even without events.
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    pub resync_period: Duration,

    /// WireGuard implementation on this node (auto, kernel, userspace), overriding the
    /// config's `Backend.Implementation`: e.g. to keep one node on userspace.
    #[arg(long, value_parser = ["auto", "kernel", "userspace"])]
    pub wireguard_implementation: Option<String>,

    /// A directory holding the PSK (a mounted Secret: `psk`, and for a rotation `next-psk`
    /// and `switch-at`); overrides the config's Backend.PSK. In etcd mode the key
    /// `<prefix>/weft/psk` does the same.
    #[arg(long)]
    pub psk_dir: Option<PathBuf>,

    /// weft-cni's data directory (the conflist's `dataDir`): where the agent looks for pod
    /// addresses held for containers that are gone.
    #[arg(long, default_value = crate::cni::conf::DEFAULT_DATA_DIR)]
    pub cni_data_dir: PathBuf,

    /// Where the CNI plugins are: a leaked attachment is freed by its delegate's DEL.
    #[arg(long, default_value = "/opt/cni/bin")]
    pub cni_bin_dir: String,

    /// Seconds between the agent's releases of leaked pod addresses (attachments whose
    /// container's network namespace is gone or that an earlier boot recorded, and
    /// host-local reservations no attachment holds), the first at start; 0: never (then
    /// `weft cleanup --leaked-addresses` frees them).
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    pub leaked_address_period: Duration,

    /// This node's zone (etcd mode; on Kubernetes the Node's `topology.kubernetes.io/zone`
    /// label or `weft.dev/zone` annotation): peers in the same zone reach it on its own
    /// address, the others on the one it publishes (--public-ip).
    #[arg(long)]
    pub zone: Option<String>,

    /// This node may relay for its zone: pairs whose two nodes cannot reach each other go
    /// through a gateway of one of their zones, which forwards their WireGuard datagrams
    /// without holding their keys. It is reached at its published address (--public-ip)
    /// on --relay-port. Kubernetes: also the Node annotation `weft.dev/gateway: "true"`.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = go_bool!())]
    pub gateway: bool,

    /// UDP port of a gateway's relay (--gateway), open to every node of the cluster.
    #[arg(long, default_value = "51824")]
    pub relay_port: u16,

    /// This node's name (Kubernetes mode). Defaults to $NODE_NAME.
    #[arg(long, default_value = "")]
    pub node_name: String,
}
