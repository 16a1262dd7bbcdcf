//! The `weft` command line: subcommands, and the agent's flags under flannel's names.
//!
//! Parsed once, at the edge, into typed values. Every agent flag also reads
//! `WEFT_<NAME>` and then `FLANNELD_<NAME>` from the environment (`env.rs`); a flag given on
//! the command line wins over both.

mod agent_args;
mod env;
mod etcd_args;
mod rotate_args;

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

pub use agent_args::{AgentArgs, DEFAULT_NET_CONFIG_PATH};
pub use env::{env_suffix, with_env_fallbacks};
pub use etcd_args::EtcdAccessArgs;
pub use rotate_args::RotateArgs;

#[derive(Debug, Parser)]
#[command(
    name = "weft",
    version,
    about = "weft: an encrypted pod network for Kubernetes and etcd clusters, a drop-in for flanneld"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the node agent (what flanneld does).
    Agent(Box<AgentArgs>),
    /// Work with net-conf.json.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// WireGuard keys, byte-compatible with `wg genkey` / `wg pubkey` / `wg genpsk`.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// This node and its peers: endpoints, handshakes, transfer, state (from the local
    /// agent's control socket and the device).
    Status(crate::commands::status::StatusArgs),
    /// Check this node against the plan and its peers (key, peers, handshakes, UDP
    /// reachability, path MTU, masquerade rules, vxlan entries); one verdict per check
    /// with the fix; exits 1 if any check fails.
    Doctor(crate::commands::doctor::DoctorArgs),
    /// Remove every device, route, nftables table, subnet file and socket weft created on
    /// this node (after an uninstall or `kubeadm reset`); prints what it removed.
    Cleanup(crate::commands::cleanup::CleanupArgs),
    /// Install the CNI plugin and conflist (the DaemonSet's init container).
    InstallCni(crate::commands::install_cni::InstallCniArgs),
    /// Run one userspace WireGuard device (weft's packet loop on its own WireGuard core)
    /// until its interface is deleted or SIGTERM arrives. The agent starts it where the
    /// kernel has no WireGuard; it is a process of its own so the device outlives agent
    /// restarts, as a kernel device does.
    #[command(hide = true)]
    UserspaceDevice {
        /// The interface name, e.g. flannel-wg.
        device: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate net-conf.json and print the effective config with defaults filled in;
    /// exits 1 with one line per problem if it is invalid.
    Check {
        /// The file to check (`-` for standard input).
        #[arg(default_value = DEFAULT_NET_CONFIG_PATH)]
        path: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Print a new private key (as `wg genkey`).
    Generate,
    /// Read a private key on standard input, print its public key (as `wg pubkey`).
    Public,
    /// Print a new pre-shared key (as `wg genpsk`).
    Psk,
    /// Rotate WireGuard keys with bounded disruption: this node's (through the local
    /// agent), or with --all / --node every or some node's, through the registry, a batch
    /// at a time, waiting for each to use its new key. See docs/key-rotation.md.
    Rotate(Box<RotateArgs>),
}

impl Cli {
    /// Parses `args` (with the program name first), reading environment fallbacks through
    /// `env`. A program invoked as `flanneld` is the agent: flannel's manifests call it so.
    pub fn parse_with_env(
        args: impl IntoIterator<Item = OsString>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, clap::Error> {
        let mut args: Vec<OsString> = args.into_iter().collect();
        let invoked_as_flanneld = args
            .first()
            .and_then(|a| PathBuf::from(a).file_name().map(|n| n == "flanneld"))
            .unwrap_or(false);
        if invoked_as_flanneld {
            args.insert(1, "agent".into());
        }
        let command =
            Cli::command().mut_subcommand("agent", |agent| with_env_fallbacks(agent, env));
        let matches = command.try_get_matches_from(args)?;
        Cli::from_arg_matches(&matches)
    }
}

#[cfg(test)]
mod tests;
