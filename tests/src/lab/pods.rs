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

/// A node's subnets as its subnet.env gives them (gateway addresses, with prefix).
type Gateways = (Option<ipnet::Ipv4Net>, Option<ipnet::Ipv6Net>);

impl Lab {
    /// The pods of `nodes`: each node waits for its subnet.env and creates its pods
    /// through CNI on a thread of its own, the nodes side by side (each plugin call is a
    /// process; under emulation a pod took 2-5 s, a 3-node lab's six 15-20 s one after
    /// another).
    pub(super) fn wire_pods(
        &mut self,
        nodes: &[usize],
        timeline: &super::Timeline,
    ) -> anyhow::Result<()> {
        let names: Vec<(usize, Vec<String>)> = nodes
            .iter()
            .map(|&i| {
                let pods = (1..=self.cfg.pods_per_node).map(|p| self.pod_ns(i, p));
                (i, pods.collect())
            })
            .collect();
        for (_, pods) in &names {
            for ns in pods {
                self.namespaces.add(ns)?;
            }
        }
        let lab = &*self;
        let wired: Vec<anyhow::Result<(Gateways, Vec<Pod>)>> = std::thread::scope(|s| {
            let threads: Vec<_> = names
                .iter()
                .map(|(i, pods)| {
                    let i = *i;
                    s.spawn(move || -> anyhow::Result<(Gateways, Vec<Pod>)> {
                        let gateways = lab.subnet_env(i)?;
                        timeline.mark(&format!("node {} wrote subnet.env", i + 1));
                        let pods = pods
                            .iter()
                            .map(|ns| lab.attach_pod(i, ns, gateways.1, cni::conflist()))
                            .collect::<anyhow::Result<Vec<Pod>>>()?;
                        timeline.mark(&format!("node {} has its pods", i + 1));
                        Ok((gateways, pods))
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
        for (&i, node) in nodes.iter().zip(wired) {
            let ((v4, v6), pods) = node?;
            self.nodes[i].subnet = v4.map(|g| g.trunc());
            self.nodes[i].subnet_v6 = v6.map(|g| g.trunc());
            self.nodes[i].pods = pods;
        }
        Ok(())
    }

    /// Node `i`'s subnets, once its agent has written each enabled family's to subnet.env.
    fn subnet_env(&self, i: usize) -> anyhow::Result<Gateways> {
        let env_path = self.nodes[i].subnet_env();
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
        match written {
            Some(gateways) => gateways,
            None => bail!(
                "node {} wrote no subnet.env in 30 s; agent log:\n{}",
                i + 1,
                fs::read_to_string(self.nodes[i].agent_log()).unwrap_or_default()
            ),
        }
    }

    /// The namespace of node `i`'s pod `p` (both from 0 and 1).
    fn pod_ns(&self, i: usize, p: usize) -> String {
        format!("{}-n{}p{p}", self.tag, i + 1)
    }

    /// A new pod on node `i`, attached through CNI with `conflist`; returns its index in
    /// the node's pods.
    pub fn add_pod(&mut self, i: usize, conflist: serde_json::Value) -> anyhow::Result<usize> {
        let p = self.nodes[i].pods.len() + 1;
        let pod_ns = self.pod_ns(i, p);
        self.namespaces.add(&pod_ns)?;
        let v6 = self.nodes[i].subnet_v6;
        match self.attach_pod(i, &pod_ns, v6, conflist) {
            Ok(pod) => {
                self.nodes[i].pods.push(pod);
                Ok(p - 1)
            }
            Err(e) => {
                // No pod: its namespace goes too (the next pod takes its name).
                let _ = self.namespaces.remove(&pod_ns);
                Err(e)
            }
        }
    }

    /// Attaches the pod namespace `pod_ns` on node `i` through CNI with `conflist`; in a
    /// dual-stack lab waits until the gateway of the node's IPv6 subnet `v6` answers.
    fn attach_pod(
        &self,
        i: usize,
        pod_ns: &str,
        v6: Option<ipnet::Ipv6Net>,
        conflist: serde_json::Value,
    ) -> anyhow::Result<Pod> {
        let context = || format!("adding pod {pod_ns} on node {}", i + 1);
        if self.cfg.ipv6 {
            // See `create_node`: the pod's eth0 usable at once.
            super::in_ns(pod_ns, "sysctl -qw net.ipv6.conf.default.accept_dad=0")
                .with_context(context)?;
        }
        let attachment = cni::Attachment {
            container_id: format!("{pod_ns}-c"),
            netns: format!("/var/run/netns/{pod_ns}"),
            ifname: "eth0".into(),
        };
        let result = cni::Runtime {
            conflist,
            ..self.cni_runtime(i)
        }
        .add(&attachment)
        .with_context(context)?;
        // An IPv6-only pod has no IPv4 address: 0.0.0.0 stands for none.
        let ip = match self.cfg.ipv4 {
            true => cni::result_ipv4(&result)?.addr(),
            false => std::net::Ipv4Addr::UNSPECIFIED,
        };
        let ip6 = cni::result_ipv6(&result);
        if self.cfg.ipv6 {
            let Some(v6) = v6 else {
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
                super::in_ns(pod_ns, &ping).is_ok()
            }) {
                bail!("pod {pod_ns}: its IPv6 gateway {gateway} did not answer in 10 s");
            }
        }
        Ok(Pod {
            ns: pod_ns.to_string(),
            ip,
            ip6,
            attachment,
            result,
        })
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
