//! `weft keys rotate`'s flags: this node through its agent, or others through the registry.

#[derive(Debug, Clone, clap::Args)]
pub struct RotateArgs {
    /// Rotate every node's key, through the registry.
    #[arg(long)]
    pub all: bool,
    /// Rotate these nodes' keys (names as the registry has them), through the registry.
    #[arg(long)]
    pub node: Vec<String>,
    /// Nodes rotating at once.
    #[arg(long, default_value = "1")]
    pub batch: usize,
    /// Seconds to wait for each node to use its new key.
    #[arg(long, default_value = "60")]
    pub timeout: u64,
    /// Use the Kubernetes API (Node annotations) instead of etcd.
    #[arg(long)]
    pub kube_subnet_mgr: bool,
    /// kubeconfig file (default: in-cluster config or ~/.kube/config).
    #[arg(long, default_value = "")]
    pub kubeconfig_file: String,
    /// Prefix of the Node annotations, as the agents' --kube-annotation-prefix.
    #[arg(long, default_value = weft_backends::model::annotations::DEFAULT_PREFIX)]
    pub kube_annotation_prefix: String,
    /// etcd endpoints, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    pub etcd_endpoints: Vec<String>,
    /// etcd key prefix.
    #[arg(long, default_value = "/coreos.com/network")]
    pub etcd_prefix: String,
    /// Auth and TLS to etcd, as the agents'.
    #[command(flatten)]
    pub etcd: super::EtcdAccessArgs,
}
