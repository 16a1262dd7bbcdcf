//! The operator's tools run on a lab node, as an operator would run them there.

use anyhow::Context;

use super::Lab;

impl Lab {
    /// `weft doctor` on node `i`, waiting `handshake_wait` seconds for handshakes: its exit
    /// code (-1 if it could not be read) and its report.
    pub fn doctor(&self, i: usize, handshake_wait: u32) -> (i32, String) {
        let script = format!(
            "{} doctor --handshake-wait={handshake_wait}; echo \"exit=$?\"",
            self.cfg.weft.display()
        );
        let out = self
            .on_node(i, &script)
            .unwrap_or_else(|e| format!("{e:#}"));
        let code = out
            .lines()
            .last()
            .and_then(|l| l.strip_prefix("exit="))
            .and_then(|c| c.parse().ok())
            .unwrap_or(-1);
        (code, out)
    }

    /// Whether node `i`'s `weft doctor` has a line with all of `words`; returns the report.
    pub fn doctor_says(&self, i: usize, words: &[&str]) -> (bool, String) {
        let (_, out) = self.doctor(i, 1);
        let found = out.lines().any(|l| words.iter().all(|w| l.contains(w)));
        (found, out)
    }

    /// SIGKILLs node `i`'s agent and starts it again; returns once it answers
    /// `weft status`.
    pub fn kill_and_restart(&mut self, i: usize) -> anyhow::Result<()> {
        self.stop_agent(i, "KILL")?;
        self.start_agent(i)?;
        let status = format!("{} status", self.cfg.weft.display());
        crate::wait::until(
            &format!("node {}'s agent ready again", i + 1),
            std::time::Duration::from_secs(10),
            || self.on_node(i, &status).is_ok(),
        );
        Ok(())
    }

    /// What each thread of node `i`'s agent is doing (name, kernel wait channel, syscall),
    /// for failure messages about a wedged agent.
    pub fn agent_threads(&self, i: usize) -> String {
        let Some(pid) = self.agent_pid(i) else {
            return format!("node {}'s agent is not running", i + 1);
        };
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return format!("node {}'s agent (pid {pid}) is gone", i + 1);
        };
        let read = |dir: &std::path::Path, f: &str| {
            std::fs::read_to_string(dir.join(f))
                .map_or_else(|e| e.to_string(), |s| s.trim().to_string())
        };
        tasks
            .flatten()
            .map(|t| {
                let dir = t.path();
                format!(
                    "{:?} {} wchan={} syscall={}\n",
                    t.file_name(),
                    read(&dir, "comm"),
                    read(&dir, "wchan"),
                    read(&dir, "syscall")
                )
            })
            .collect()
    }

    /// Every XFRM state installed on the nodes since before the agents started
    /// (`LabConfig::xfrm_record`; empty without it).
    pub fn xfrm_installed(&self) -> Vec<super::xfrm_record::Installed> {
        self.xfrm_record
            .as_ref()
            .map(super::xfrm_record::XfrmRecord::installed)
            .unwrap_or_default()
    }

    /// Switches every node to `backend` as an operator would: the agents stopped (TERM), the
    /// config in etcd rewritten (the lab's network, `Backend.Type` only), the agents
    /// started. Onto wireguard, a clear-traffic watch runs from before the agents start;
    /// it returns once every agent has sealed the pod network, with each node's seal.
    pub fn switch_backend(&mut self, backend: &str) -> anyhow::Result<Option<SwitchWatch>> {
        self.switch_backend_to(serde_json::json!({ "Type": backend }))
    }

    /// `switch_backend` to the `Backend` object `backend` (its other keys too).
    pub fn switch_backend_to(
        &mut self,
        backend: serde_json::Value,
    ) -> anyhow::Result<Option<SwitchWatch>> {
        let count = self.nodes.len();
        for i in 0..count {
            self.stop_agent(i, "TERM")?;
        }
        let conf = serde_json::json!({
            "Network": "10.244.0.0/16",
            "SubnetMax": "10.244.199.0",
            "Backend": backend,
        })
        .to_string();
        let key = format!("{}/config", self.cfg.etcd_prefix);
        self.etcd().etcdctl(&["put", &key, &conf])?;
        let watch = match backend["Type"].as_str().unwrap_or_default() {
            "wireguard" => Some(super::clear_watch::ClearWatch::start(self)?),
            _ => None,
        };
        for i in 0..count {
            self.start_agent(i)?;
        }
        let Some(watch) = watch else {
            return Ok(None);
        };
        const SEALED: &str = "pod networks sealed";
        let mut seals = Vec::new();
        for node in &self.nodes {
            crate::wait::until(
                "the agent sealing the pod network",
                std::time::Duration::from_secs(10),
                || node.logged_at(SEALED).is_some_and(|t| t >= watch.started()),
            );
            let at = node.logged_at(SEALED).context("the seal's log line")?;
            let subnet = node.subnet.context("the node's subnet")?;
            // A clear packet shows a pod's address, or (in an unencrypted tunnel such
            // as ipip's) the node's own underlay address outside.
            seals.push((ipnet::IpNet::V4(subnet), at));
            seals.push((ipnet::IpNet::from(std::net::IpAddr::from(node.ip)), at));
        }
        Ok(Some(SwitchWatch { watch, seals }))
    }
}

/// The clear-traffic watch over a switch onto an encrypting backend, and when each node
/// sealed its pod network (`Lab::switch_backend`).
pub struct SwitchWatch {
    watch: super::clear_watch::ClearWatch,
    seals: Vec<(ipnet::IpNet, std::time::SystemTime)>,
}

impl SwitchWatch {
    /// Ends the watch: a node's pod packet in clear after its seal fails it.
    pub fn finish(self) -> anyhow::Result<super::clear_watch::Watched> {
        self.watch.finish_from_seals(&self.seals)
    }
}
