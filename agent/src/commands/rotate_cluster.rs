//! `weft keys rotate --all | --node NAME…`: asks nodes through the registry to rotate
//! (kube: the `weft.dev/rotate-request` annotation on each Node; etcd:
//! `<prefix>/weft/rotate/<node>`), a batch at a time, and waits for each node of a batch
//! to publish its new key (ipsec: its new epoch) with no rotation pending, printing
//! progress. Nodes that did not
//! finish within the timeout are named, and the exit status is 1.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::json;
use weft_backends::model::Lease;

use crate::cli::RotateArgs;
use crate::registry::kube::SlimNode;
use crate::registry::ROTATE_REQUEST;

enum Target {
    Kube {
        api: Box<Api<SlimNode>>,
        /// The agents' `--kube-annotation-prefix`.
        prefix: String,
    },
    Etcd(Box<crate::registry::EtcdRegistry>),
}

/// A node as the registry shows it: its published key, and whether a rotation is pending.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    key: String,
    pending: bool,
}

fn seen(lease: &Lease) -> Option<Seen> {
    if lease.backend_type == "ipsec" {
        // An ipsec rotation is a new epoch under the same key.
        let data =
            weft_backends::plan::ipsec::IpsecData::decode(lease.backend_data.as_ref()).ok()?;
        let in_force = data.in_force(std::time::SystemTime::now());
        return Some(Seen {
            key: format!(
                "{} epoch {}",
                data.public_key,
                in_force.map_or(data.epoch.number, |e| e.number)
            ),
            pending: in_force.is_none(),
        });
    }
    if lease.backend_type != "wireguard" {
        return None;
    }
    let key = weft_backends::plan::WireguardData::decode(lease.backend_data.as_ref())
        .ok()?
        .public_key
        .to_string();
    Some(Seen {
        key,
        pending: lease.next_key.is_some(),
    })
}

impl Target {
    async fn connect(args: &RotateArgs) -> anyhow::Result<Target> {
        if args.kube_subnet_mgr {
            let client = crate::registry::kube::client(&args.kubeconfig_file, "").await?;
            return Ok(Target::Kube {
                api: Box::new(Api::all(client)),
                prefix: args.kube_annotation_prefix.clone(),
            });
        }
        // The agents' etcd client: the same auth and TLS, the same refusal to send the
        // password in clear, the same paginated listing.
        let cfg =
            crate::registry::EtcdConfig::new(args.etcd_endpoints.clone(), args.etcd_prefix.clone())
                .with_access(args.etcd.access());
        let registry = crate::registry::EtcdRegistry::connect(cfg).await?;
        Ok(Target::Etcd(Box::new(registry)))
    }

    async fn nodes(&mut self) -> anyhow::Result<BTreeMap<String, Seen>> {
        let mut out = BTreeMap::new();
        match self {
            Target::Kube { api, prefix } => {
                let list = api
                    .list(&Default::default())
                    .await
                    .context("listing nodes")?;
                for node in list.items {
                    if let Ok(Some(lease)) = node.lease(prefix) {
                        if let Some(s) = seen(&lease) {
                            out.insert(lease.node.clone(), s);
                        }
                    }
                }
            }
            Target::Etcd(registry) => {
                for stored in registry.list().await?.leases {
                    if let Some(s) = seen(&stored.lease) {
                        out.insert(stored.lease.node.clone(), s);
                    }
                }
            }
        }
        Ok(out)
    }

    async fn request(&mut self, node: &str, id: &str) -> anyhow::Result<()> {
        match self {
            Target::Kube { api, .. } => {
                let patch = json!({"metadata": {"annotations": {ROTATE_REQUEST: id}}});
                api.patch(node, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .with_context(|| format!("annotating node {node}"))?;
            }
            Target::Etcd(registry) => registry.request_rotation(node, id).await?,
        }
        Ok(())
    }
}

pub fn run(args: &RotateArgs, out: &mut dyn Write) -> anyhow::Result<i32> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(rotate(args, out))
}

async fn rotate(args: &RotateArgs, out: &mut dyn Write) -> anyhow::Result<i32> {
    let mut target = Target::connect(args).await?;
    let all = target.nodes().await?;
    let chosen: Vec<String> = if args.all {
        all.keys().cloned().collect()
    } else {
        for n in &args.node {
            if !all.contains_key(n) {
                bail!(
                    "no WireGuard node {n:?} in the registry; nodes: {}",
                    all.keys().cloned().collect::<Vec<_>>().join(", ")
                );
            }
        }
        args.node.clone()
    };
    let id = format!(
        "rotate-{}",
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    );
    let total = chosen.len();
    writeln!(
        out,
        "rotating {total} node(s), {} at a time (request {id})",
        args.batch.max(1)
    )?;
    let started = Instant::now();
    let (mut done, mut failed) = (0usize, Vec::new());
    for batch in chosen.chunks(args.batch.max(1)) {
        let before = target.nodes().await?;
        for node in batch {
            target.request(node, &id).await?;
        }
        let t0 = Instant::now();
        let mut waiting: Vec<&String> = batch.iter().collect();
        while !waiting.is_empty() {
            let now = target.nodes().await?;
            let mut still = Vec::new();
            for node in waiting {
                let (old, new) = (before.get(node), now.get(node));
                match (old, new) {
                    (Some(o), Some(n)) if n.key != o.key && !n.pending => {
                        done += 1;
                        writeln!(
                            out,
                            "[{done}/{total}] {node}: {} -> {} in {:.1} s",
                            o.key,
                            n.key,
                            t0.elapsed().as_secs_f64()
                        )?;
                    }
                    _ => still.push(node),
                }
            }
            waiting = still;
            if t0.elapsed() > Duration::from_secs(args.timeout) {
                for node in &waiting {
                    writeln!(out, "{node}: did not switch within {} s", args.timeout)?;
                    failed.push((*node).clone());
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    if failed.is_empty() {
        writeln!(
            out,
            "all {total} node(s) use their new keys ({:.1} s)",
            started.elapsed().as_secs_f64()
        )?;
        Ok(0)
    } else {
        writeln!(
            out,
            "{} node(s) did not rotate: {}",
            failed.len(),
            failed.join(", ")
        )?;
        Ok(1)
    }
}
