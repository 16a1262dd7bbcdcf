//! Each node's agent as a process: its command line (the lab's registry, the node's
//! address, the implementation it is pinned to, the test's extra arguments and
//! environment), started in the node's namespaces with its output appended to its log,
//! and stopped by a signal.

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use anyhow::Context;

use super::config::{DEFAULT_ETCD_PREFIX, ETCD_IP};
use super::fabric::run;
use super::Lab;
use crate::netns::{script_in, Mounts};

impl Lab {
    /// Starts node `i`'s agent (again) with its private `/run` and `/var/lib/weft`, or
    /// through the node's launcher if the lab has one for it.
    pub fn start_agent(&mut self, i: usize) -> anyhow::Result<()> {
        let node = &self.nodes[i];
        fs::create_dir_all("/var/lib/weft").context("creating the /var/lib/weft mount point")?;
        let mut command = match self.cfg.launchers.get(&i) {
            Some(launch) => launch(node)?,
            None => self.agent_command(i),
        };
        let log = fs::File::options()
            .create(true)
            .append(true)
            .open(node.agent_log())?;
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting an agent")?;
        self.nodes[i].agent = Some(child);
        Ok(())
    }

    /// The lab's own `weft agent` for node `i`, in the node's namespaces.
    fn agent_command(&self, i: usize) -> Command {
        let node = &self.nodes[i];
        let registry = if self.kube.is_some() {
            let dir = self.dir.path();
            format!(
                "--kube-subnet-mgr --kubeconfig-file={} --net-config-path={}",
                dir.join("kubeconfig").display(),
                dir.join("net-conf.json").display()
            )
        } else if self.cfg.etcd_prefix == DEFAULT_ETCD_PREFIX {
            format!("--etcd-endpoints=http://{ETCD_IP}:2379")
        } else {
            format!(
                "--etcd-endpoints=http://{ETCD_IP}:2379 --etcd-prefix={}",
                self.cfg.etcd_prefix
            )
        };
        let placed = self
            .cfg
            .sites
            .as_ref()
            .and_then(|s| s.agent_args(i, node.ip));
        let address = match (placed, self.cfg.own_address.contains(&i)) {
            (Some(args), _) => args,
            (None, true) => "--iface=eth0".to_string(),
            (None, false) => format!("--public-ip={}", node.ip),
        };
        // The node's own weft-cni data and plugins, for the agent's release of leaked pod
        // addresses (never the host's).
        let cni = format!(
            "--cni-data-dir={} --cni-bin-dir={}:{} --leaked-address-period={}",
            node.dir.join("cni/flannel").display(),
            self.cni_bin.display(),
            super::cni::DEBIAN_PLUGINS,
            self.cfg.leaked_address_period
        );
        let script = format!(
            "exec {weft} agent {registry} {address} {cni} {extra}",
            weft = self.cfg.weft.display(),
            extra = self.cfg.extra_args.join(" "),
        );
        let script = match self
            .cfg
            .implementations
            .get(i % self.cfg.implementations.len().max(1))
        {
            Some(which) => format!("{script} --wireguard-implementation={which}"),
            None => script,
        };
        let mut command = self.node_shell(i, &script);
        // WEFT_LAB_RUST_LOG replaces the agents' log filter (the userspace device's
        // handshake messages with `info,weft_backends::userspace::wg=debug`). The post-quantum exchange's own debug lines (each
        // pair made and who leads it, each datagram or message refused: a few a round) are
        // on, so a lab that waits in vain for a pair's PSK says why.
        command
            .env(
                "RUST_LOG",
                std::env::var("WEFT_LAB_RUST_LOG")
                    .unwrap_or_else(|_| "info,boringtun=error,weft::pq=debug".into()),
            )
            .env("NODE_NAME", format!("n{}", node.index));
        for (_, name, value) in self.cfg.agent_env.iter().filter(|(n, _, _)| *n == i) {
            command.env(name, value);
        }
        command
    }

    /// The pid of node `i`'s agent, while it runs.
    pub fn agent_pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].agent.as_ref().map(Child::id)
    }

    /// Stops node `i`'s agent with `signal` (`TERM`, `KILL`) and waits for it.
    pub fn stop_agent(&mut self, i: usize, signal: &str) -> anyhow::Result<()> {
        if let Some(mut child) = self.nodes[i].agent.take() {
            run(Command::new("kill").args([&format!("-{signal}"), &child.id().to_string()]))?;
            child.wait()?;
        }
        Ok(())
    }

    /// `sh -c script` as node `i`: in its network namespace, with its private `/run` and
    /// `/var/lib/weft` bound in a mount namespace of its own.
    pub(crate) fn node_shell(&self, i: usize, script: &str) -> Command {
        node_shell(&self.nodes[i], script)
    }
}

/// `script` in `node`'s namespaces, with its own `/run` and `/var/lib/weft` (the host's
/// network namespaces still visible under its `/run/netns`, as a node's are to its agent:
/// the containers' namespaces, which the release of leaked pod addresses looks at).
fn node_shell(node: &super::Node, script: &str) -> Command {
    let netns = node.dir.join("run/netns");
    let _ = std::fs::create_dir_all(&netns);
    let mounts = Mounts::private()
        .bind(Path::new("/run/netns"), &netns)
        .rbind(&node.dir.join("run"), Path::new("/run"))
        .bind(&node.dir.join("lib"), Path::new("/var/lib/weft"));
    script_in(&node.ns, &mounts, script)
}

/// A launcher running flannel's own agent (`flanneld`, a binary the operator built) on a
/// node of an etcd lab instead of weft, as a node of a flannel cluster does: the lab's
/// etcd and `prefix`, the node's address, flannel's subnet file under the node's `/run`.
/// A rollout (`Lab::roll_out`) restarts such a node with the lab's weft. The nodes start
/// a second apart, as a cluster's do: flanneld v0.20.2 can miss a lease made while it
/// starts (two of them started 25 ms apart never meshed, and flanneld does not list
/// again), which is flannel's, not what the lab tests.
pub fn flanneld_launcher(flanneld: std::path::PathBuf, prefix: String) -> super::AgentLauncher {
    Box::new(move |node: &super::Node| {
        let script = format!(
            "sleep {}; exec {} --etcd-endpoints=http://{ETCD_IP}:2379 --etcd-prefix={prefix} --public-ip={} --iface=eth0 --healthz-port=0",
            node.index.saturating_sub(1),
            flanneld.display(),
            node.ip
        );
        Ok(node_shell(node, &script))
    })
}
