//! `weft keys rotate`: this node's key through the local agent's control socket, or with
//! `--all` / `--node` other nodes' through the registry (`rotate_cluster`).

use std::io::Write;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use weft_backends::model::NextKey;

use crate::cli::RotateArgs;
use crate::observe::control_socket::{fetch, request, socket_path};

/// What a rotation changes: the published key, and for ipsec the published epoch (an ipsec
/// rotation keeps the key); empty while an ipsec rotation is announced but not done.
fn published_key(snapshot: &crate::observe::snapshot::Snapshot) -> String {
    let key = snapshot
        .published_key()
        .map(|k| k.to_string())
        .unwrap_or_default();
    if snapshot.backend != "ipsec" {
        return key;
    }
    match weft_backends::plan::ipsec::IpsecData::decode(snapshot.published.as_ref()) {
        Ok(d) => d
            .in_force(SystemTime::now())
            .map(|e| format!("{key} epoch {}", e.number))
            .unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// This node: asks the local agent, then waits until it publishes the new key.
fn rotate_local(args: &RotateArgs, out: &mut dyn Write) -> anyhow::Result<i32> {
    let path = socket_path();
    let before = published_key(&fetch(&path)?);
    let started = Instant::now();
    let body = request(&path, "POST", "/rotate")?;
    let mut next: NextKey = serde_json::from_str(&body).context("the agent's answer to /rotate")?;
    if before.contains(" epoch ") {
        // ipsec: the agent answers with its key and the next epoch's number.
        next.public_key = format!("{} epoch {}", next.public_key, next.generation);
    }
    let in_ms = next
        .switch_at()
        .duration_since(SystemTime::now())
        .map_or(0, |d| d.as_millis());
    writeln!(
        out,
        "announced key generation {}: {} (was {before}); every node switches in {in_ms} ms",
        next.generation, next.public_key
    )?;
    let deadline = started + Duration::from_secs(args.timeout);
    loop {
        let snapshot = fetch(&path)?;
        if snapshot.rotating.is_none() && published_key(&snapshot) == next.public_key {
            writeln!(
                out,
                "switched to {} (generation {}) {:.1} s after the request",
                next.public_key,
                snapshot.key_generation,
                started.elapsed().as_secs_f64()
            )?;
            return Ok(0);
        }
        if Instant::now() > deadline {
            bail!(
                "the agent has not switched to {} within {} s; `weft status` and its log say why",
                next.public_key,
                args.timeout
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn run(args: &RotateArgs, out: &mut dyn Write) -> anyhow::Result<i32> {
    if args.all || !args.node.is_empty() {
        return super::rotate_cluster::run(args, out);
    }
    rotate_local(args, out)
}
