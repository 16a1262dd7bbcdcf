//! The lab's namespaces and wiring: creating and removing network namespaces (also those a
//! crashed run left), commands inside them, and veth links onto the fabric's bridges.

use std::path::Path;
use std::process::{Command, Output};

use anyhow::{bail, Context};

use crate::netns::{command_with_mounts, Mounts};

/// The namespaces a lab made; removed on drop, also when `Lab::start` fails half-way.
#[derive(Default)]
pub(super) struct Namespaces(Vec<String>);

impl Namespaces {
    pub(super) fn add(&mut self, name: &str) -> anyhow::Result<()> {
        run(Command::new("ip").args(["netns", "add", name]))?;
        self.0.push(name.to_string());
        run(Command::new("ip").args(["-n", name, "link", "set", "lo", "up"]))?;
        Ok(())
    }

    /// Deletes `name` (added here) again.
    pub(super) fn remove(&mut self, name: &str) -> anyhow::Result<()> {
        self.0.retain(|n| n != name);
        run(Command::new("ip").args(["netns", "del", name]))?;
        Ok(())
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in self.0.iter().rev() {
            remove_ns(ns);
        }
    }
}

/// How often an agent log says the agent created `flannel-wg` (kernel or userspace).
pub fn devices_created(log: &str) -> usize {
    ["kernel", "userspace"]
        .iter()
        .map(|i| {
            log.matches(&format!("created {i} WireGuard device flannel-wg"))
                .count()
        })
        .sum()
}

/// Runs a command, failing with its stderr.
pub fn run(cmd: &mut Command) -> anyhow::Result<Output> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

/// `sh -c script` inside network namespace `ns`.
pub fn in_ns(ns: &str, script: &str) -> anyhow::Result<String> {
    let out = run(crate::netns::command_in(ns, "sh").args(["-c", script]))
        .with_context(|| format!("in namespace {ns}"))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `sh -c script` inside network namespace `ns` and a private mount namespace of its own,
/// so the script's bind mounts (a node's own `/run`, say) are seen by it and its children
/// only.
pub fn in_ns_private_mounts(ns: &str, script: &str) -> Command {
    let mut command = command_with_mounts(ns, "sh", &Mounts::private());
    command.args(["-c", script]);
    command
}

/// Deletes lab namespaces whose process is gone (what a crashed run left behind).
pub fn clean_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(pid) = name
            .strip_prefix("wl")
            .and_then(|r| r.split('x').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            remove_ns(name);
        }
    }
}

pub(super) fn remove_ns(name: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", name]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-9", pid]).status();
        }
    }
    let _ = Command::new("ip").args(["netns", "del", name]).status();
}

/// Connects namespace `ns` to the fabric bridge: `eth0` there, `name` on the bridge.
pub(super) fn attach(fabric: &str, ns: &str, name: &str, ip: &str) -> anyhow::Result<()> {
    attach_to(fabric, "br0", ns, name, "eth0", ip)
}

/// Connects namespace `ns` to bridge `bridge` of the fabric: `dev` there, `name` on the
/// bridge, `ip`/24 on `dev`.
pub(super) fn attach_to(
    fabric: &str,
    bridge: &str,
    ns: &str,
    name: &str,
    dev: &str,
    ip: &str,
) -> anyhow::Result<()> {
    in_ns(fabric, &format!("ip link add {name} type veth peer name {dev} netns {ns} && ip link set {name} master {bridge} up"))?;
    in_ns(
        ns,
        &format!("ip addr add {ip}/24 dev {dev} && ip link set {dev} up"),
    )?;
    Ok(())
}
