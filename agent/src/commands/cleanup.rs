//! `weft cleanup`: removes what weft created on this node, after an uninstall or a
//! `kubeadm reset`, and prints each thing it removed:
//! - the WireGuard devices `flannel-wg` / `flannel-wg-v6` (and the userspace process
//!   serving one), the vxlan devices `flannel.<VNI>` / `flannel-v6.<VNI>` with their
//!   neighbour and FDB entries, the ipip device `flannel.ipip`, and the XFRM interface
//!   `flannel-ipsec` with every XFRM state and policy bound to weft's interface id;
//! - every route weft installed (protocol 87: per-peer, covering and blackhole routes);
//! - the nftables tables `ip flannel-ipv4`, `ip6 flannel-ipv6`, `ip`/`ip6 weft-guard` and
//!   the older `ip weft-ipsec`;
//! - subnet.env, and UAPI sockets left by a userspace device that is gone.
//!
//! `weft cleanup --leaked-addresses` does none of that: it frees the pod addresses held
//! for containers that are gone (see `cni::leaks`), and runs beside the agent.
//!
//! It works by reconciling the data plane to an empty plan, with the same code and the
//! same notion of "weft's" as the agent: objects are weft's by name (the device and table
//! names of docs/architecture.md) or by route protocol, so anything else (a `wg0`, a route of another
//! protocol in the pod range, another nftables table) is left alone. Running it again
//! finds nothing. It refuses while an agent runs in this network namespace, which would
//! put everything back.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use weft_backends::apply::wireguard::process::{stop_server, UserspaceProcess};
use weft_backends::apply::wireguard::uapi_socket::socket_path;
use weft_backends::apply::xfrm::{EspBook, XfrmSocket};
use weft_backends::apply::{Dataplane, IpsecPlane};
use weft_backends::model::DesiredState;
use weft_backends::plan::{WG_DEVICE, WG_DEVICE_V6};
use weft_crypto::esp::{Epoch, Loaded};
use weft_crypto::PrivateKey;

#[derive(Debug, Clone, clap::Args)]
pub struct CleanupArgs {
    /// The subnet file to remove.
    #[arg(long, default_value = "/run/flannel/subnet.env")]
    pub subnet_file: PathBuf,
    /// Clean up even if a `weft agent` seems to run in this network namespace.
    #[arg(long)]
    pub force: bool,
    /// Only free pod addresses held for containers that are gone (an earlier boot's, a
    /// vanished network namespace's, a reservation no attachment holds); the data plane
    /// and the agent are left alone.
    #[arg(long)]
    pub leaked_addresses: bool,
    /// weft-cni's data directory (the conflist's `dataDir`).
    #[arg(long, default_value = crate::cni::conf::DEFAULT_DATA_DIR)]
    pub cni_data_dir: PathBuf,
    /// Where the CNI plugins are (the delegate's DEL frees an attachment).
    #[arg(long, default_value = "/opt/cni/bin")]
    pub cni_bin_dir: String,
}

/// `--leaked-addresses`: frees each leak and prints it.
fn free_leaked(args: &CleanupArgs, out: &mut dyn Write) -> anyhow::Result<i32> {
    let (freed, failed) = crate::cni::leaks::free(&args.cni_data_dir, &args.cni_bin_dir);
    for leak in &freed {
        writeln!(out, "freed {leak}")?;
    }
    if freed.is_empty() && failed.is_empty() {
        writeln!(
            out,
            "no leaked pod addresses in {}",
            args.cni_data_dir.display()
        )?;
    }
    for e in &failed {
        writeln!(out, "error: {}", e.msg)?;
    }
    Ok(i32::from(!failed.is_empty()))
}

/// Pids of `weft agent` processes in our network namespace (other than ourselves).
fn running_agents() -> Vec<u32> {
    let Ok(ours) = std::fs::read_link("/proc/self/ns/net") else {
        return Vec::new();
    };
    let me = std::process::id();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
            let is_agent = args.first().is_some_and(|a| {
                Path::new(&*String::from_utf8_lossy(a))
                    .file_name()
                    .is_some_and(|n| n == "weft" || n == "flanneld")
            }) && args.get(1) == Some(&&b"agent"[..]);
            is_agent && std::fs::read_link(format!("/proc/{pid}/ns/net")).is_ok_and(|ns| ns == ours)
        })
        .collect()
}

pub fn run(args: &CleanupArgs, out: &mut dyn Write) -> anyhow::Result<i32> {
    if args.leaked_addresses {
        return free_leaked(args, out);
    }
    let agents = running_agents();
    if !agents.is_empty() && !args.force {
        bail!(
            "a weft agent runs in this network namespace (pid {}); it would recreate everything: stop it first (or pass --force)",
            agents
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = runtime.block_on(async {
        let (mut dataplane, _) = Dataplane::connect(None, UserspaceProcess::default())
            .await
            .context("opening netlink")?;
        // weft's XFRM states and policies, where the kernel has XFRM at all.
        if let Ok(xfrm) = XfrmSocket::open() {
            let nothing = Loaded {
                epoch: Epoch {
                    number: 0,
                    nonce: [0; 16],
                },
                installed: Default::default(),
                bumped: None,
            };
            let book = EspBook::new(None, nothing);
            dataplane = dataplane.with_ipsec(IpsecPlane::new(xfrm, book, None));
        }
        // An empty plan: no device, route or table is wanted. The key is never used.
        let key = PrivateKey::from_bytes([1; 32]);
        dataplane
            .reconcile(&DesiredState::default(), &key, &Default::default())
            .await
            .context("removing weft's devices, routes and tables")
    })?;
    let mut removed: Vec<String> = report
        .changes
        .iter()
        .map(|c| c.trim_end_matches(": not in the plan").to_string())
        .collect();
    for device in [WG_DEVICE, WG_DEVICE_V6] {
        let socket = socket_path(device);
        if socket.exists() {
            match stop_server(device) {
                Ok(()) => removed.push(format!("removed UAPI socket {}", socket.display())),
                Err(e) => removed.push(format!("left {}: {e}", socket.display())),
            }
        }
    }
    match std::fs::remove_file(&args.subnet_file) {
        Ok(()) => removed.push(format!("removed {}", args.subnet_file.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(e).with_context(|| format!("removing {}", args.subnet_file.display()))
        }
    }
    for line in &removed {
        writeln!(out, "{line}")?;
    }
    if removed.is_empty() {
        writeln!(
            out,
            "nothing to remove: no weft devices, routes, nftables tables, subnet file or sockets"
        )?;
    }
    if !report.errors.is_empty() {
        for e in &report.errors {
            writeln!(out, "error: {e}")?;
        }
        return Ok(1);
    }
    Ok(0)
}
