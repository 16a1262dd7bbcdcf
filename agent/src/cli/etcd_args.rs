//! How to reach etcd safely, flanneld's flags: auth, TLS, and the explicit consent to send
//! secrets in clear. Shared by the agent and `weft keys rotate --all`.

use clap::{ArgAction, Args};

use crate::registry::EtcdAccess;

#[derive(Debug, Clone, Args)]
pub struct EtcdAccessArgs {
    /// etcd user name (with --etcd-password).
    #[arg(long, default_value = "")]
    pub etcd_username: String,

    /// etcd password.
    #[arg(long, default_value = "", hide_default_value = true)]
    pub etcd_password: String,

    /// The CA that signed etcd's certificate (PEM), for https:// endpoints.
    #[arg(long, default_value = "")]
    pub etcd_cafile: String,

    /// This node's client certificate (PEM), for an etcd that requires one.
    #[arg(long, default_value = "")]
    pub etcd_certfile: String,

    /// The key of --etcd-certfile (PEM).
    #[arg(long, default_value = "")]
    pub etcd_keyfile: String,

    /// Accept sending secrets (the etcd password, the cluster PSK) to etcd endpoints that
    /// are not https://, where anyone on the path can read them. Without it the agent
    /// refuses to start in that case.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = clap::value_parser!(bool))]
    pub etcd_insecure: bool,
}

impl EtcdAccessArgs {
    pub fn access(&self) -> EtcdAccess<'_> {
        EtcdAccess {
            username: &self.etcd_username,
            password: &self.etcd_password,
            insecure: self.etcd_insecure,
            cafile: &self.etcd_cafile,
            certfile: &self.etcd_certfile,
            keyfile: &self.etcd_keyfile,
        }
    }
}
