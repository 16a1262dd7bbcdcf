//! A node's pods: created as a container runtime creates them, through the CNI conflist
//! weft ships (see `cni`), once the node's agent has written subnet.env.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};

use super::{cni, Lab, Pod};
use crate::netns::{script_in, Mounts};
use crate::wait::{first_within, holds_within};

impl Lab {
    /// Waits for node `i`'s subnet.env, then creates its pods through CNI.
    pub(super) fn wire_pods(&mut self, i: usize) -> anyhow::Result<()> {
        let env_path = self.nodes[i].subnet_env();
        type Gateways = (Option<ipnet::Ipv4Net>, Option<ipnet::Ipv6Net>);
        let (ipv4, ipv6) = (self.cfg.ipv4, self.cfg.ipv6);
        let written = first_within(Duration::from_secs(30), || {
            let text = fs::read_to_string(&env_path).unwrap_or_default();
            let value = |key: &str| text.lines().find_map(|l| l.strip_prefix(key));
            let (v4, v6) = (value("FLANNEL_SUBNET="), value("FLANNEL_IPV6_SUBNET="));
            // Each enabled family's subnet is there.
            (v4.is_some() == ipv4 && v6.is_some() == ipv6).then(|| -> anyhow::Result<Gateways> {
                let v4 = v4.map(str::parse).transpose().context("FLANNEL_SUBNET")?;
                let v6 = v6
                    .map(str::parse)
                    .transpose()
                    .context("FLANNEL_IPV6_SUBNET")?;
                Ok((v4, v6))
            })
        });
        let Some(written) = written else {
            bail!(
                "node {} wrote no subnet.env in 30 s; agent log:\n{}",
                i + 1,
                fs::read_to_string(self.nodes[i].agent_log()).unwrap_or_default()
            );
        };
        let (gateway, gateway_v6) = written?;
        self.nodes[i].subnet = gateway.map(|g| g.trunc());
        self.nodes[i].subnet_v6 = gateway_v6.map(|g| g.trunc());
        for _ in 0..self.cfg.pods_per_node {
            self.add_pod(i, cni::conflist())?;
        }
        Ok(())
    }

    /// A new pod on node `i`, attached through CNI with `conflist`; returns its index in
    /// the node's pods.
    pub fn add_pod(&mut self, i: usize, conflist: serde_json::Value) -> anyhow::Result<usize> {
        let p = self.nodes[i].pods.len() + 1;
        let pod_ns = format!("{}-n{}p{p}", self.tag, i + 1);
        self.namespaces.add(&pod_ns)?;
        if self.cfg.ipv6 {
            // See `create_node`: the pod's eth0 usable at once.
            super::in_ns(&pod_ns, "sysctl -qw net.ipv6.conf.default.accept_dad=0")?;
        }
        let attachment = cni::Attachment {
            container_id: format!("{pod_ns}-c"),
            netns: format!("/var/run/netns/{pod_ns}"),
            ifname: "eth0".into(),
        };
        let added = cni::Runtime {
            conflist,
            ..self.cni_runtime(i)
        }
        .add(&attachment);
        let result = match added {
            Ok(r) => r,
            Err(e) => {
                // No pod: its namespace goes too (the next pod takes its name).
                let _ = self.namespaces.remove(&pod_ns);
                return Err(e.context(format!("adding pod {pod_ns} on node {}", i + 1)));
            }
        };
        // An IPv6-only pod has no IPv4 address: 0.0.0.0 stands for none.
        let ip = match self.cfg.ipv4 {
            true => cni::result_ipv4(&result)?.addr(),
            false => std::net::Ipv4Addr::UNSPECIFIED,
        };
        let ip6 = cni::result_ipv6(&result);
        if self.cfg.ipv6 {
            let Some(v6) = self.nodes[i].subnet_v6 else {
                bail!("node {} has no IPv6 subnet in a dual-stack lab", i + 1);
            };
            if ip6.is_none() {
                bail!("pod {pod_ns} has no IPv6 address in a dual-stack lab: {result}");
            }
            // A new bridge answers IPv6 neighbour solicitations only after about 2 s (the
            // first pods of a node wait that long for their gateway): the pod is ready
            // when its gateway answers.
            let gateway = format!("{}1", v6.network());
            let ping = format!("ping -c 1 -W 0.2 -q {gateway}");
            if !holds_within(Duration::from_secs(10), || {
                super::in_ns(&pod_ns, &ping).is_ok()
            }) {
                bail!("pod {pod_ns}: its IPv6 gateway {gateway} did not answer in 10 s");
            }
        }
        self.nodes[i].pods.push(Pod {
            ns: pod_ns,
            ip,
            ip6,
            attachment,
            result,
        });
        Ok(p - 1)
    }

    /// The CNI runtime of node `i`, running the conflist weft ships.
    pub fn cni_runtime(&self, i: usize) -> cni::Runtime<'_> {
        cni::Runtime {
            conflist: cni::conflist(),
            cni_path: format!("{}:{}", self.cni_bin.display(), cni::DEBIAN_PLUGINS),
            wrap: Box::new(move |script: &str| self.cni_shell(i, script)),
        }
    }

    /// As `node_shell`, with the node's `/var/lib/cni` too and the host's `/run/netns`
    /// (where the pods' namespaces are) kept visible under the node's `/run`.
    fn cni_shell(&self, i: usize, script: &str) -> Command {
        let node = &self.nodes[i];
        let run = node.dir.join("run");
        let cni = Path::new("/var/lib/cni");
        let mounts = Mounts::private()
            .dir(&run.join("netns"))
            .dir(cni)
            .rbind(Path::new("/run/netns"), &run.join("netns"))
            .rbind(&run, Path::new("/run"))
            .bind(&node.dir.join("lib"), Path::new("/var/lib/weft"))
            .bind(&node.dir.join("cni"), cni);
        script_in(&node.ns, &mounts, script)
    }
}
