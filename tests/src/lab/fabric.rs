//! The lab's namespaces and wiring: creating and removing network namespaces (also those a
//! crashed run left), commands inside them, and veth links onto the fabric's bridges.

use std::path::Path;
use std::process::{Command, Output};

use anyhow::{bail, Context};

use crate::netns::{script_in, Mounts};

/// The namespaces a lab made; removed on drop, also when `Lab::start` fails half-way.
#[derive(Default)]
pub(super) struct Namespaces(Vec<String>);

impl Namespaces {
    pub(super) fn add(&mut self, name: &str) -> anyhow::Result<()> {
        crate::netns::add(name).with_context(|| format!("adding namespace {name}"))?;
        self.0.push(name.to_string());
        Ok(())
    }

    /// Deletes `name` (added here) again.
    pub(super) fn remove(&mut self, name: &str) -> anyhow::Result<()> {
        self.0.retain(|n| n != name);
        crate::netns::delete(name).with_context(|| format!("deleting namespace {name}"))
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

/// `sh -c script` inside network namespace `ns` (`netns::script_in`).
pub fn in_ns(ns: &str, script: &str) -> anyhow::Result<String> {
    let out = run(&mut script_in(ns, &Mounts::default(), script))
        .with_context(|| format!("in namespace {ns}"))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `sh -c script` inside network namespace `ns` and a private mount namespace of its own,
/// so the script's bind mounts (a node's own `/run`, say) are seen by it and its children
/// only.
pub fn in_ns_private_mounts(ns: &str, script: &str) -> Command {
    script_in(ns, &Mounts::private(), script)
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
    for pid in crate::netns::pids_in(name) {
        // SAFETY: kill(2) on a pid read from /proc; at worst it has exited already.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    if let Err(e) = crate::netns::delete(name) {
        eprintln!("lab: deleting namespace {name}: {e}");
    }
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
    ip_batch(
        fabric,
        &[
            format!("link add {name} type veth peer name {dev} netns {ns}"),
            format!("link set {name} master {bridge} up"),
        ],
    )?;
    ip_batch(
        ns,
        &[
            format!("addr add {ip}/24 dev {dev}"),
            format!("link set {dev} up"),
        ],
    )
}

/// `ip` commands in namespace `ns`, in one `ip -batch` (one process for all of them).
pub fn ip_batch(ns: &str, commands: &[String]) -> anyhow::Result<()> {
    let mut child = Command::new("ip")
        .args(["-n", ns, "-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("starting ip -batch")?;
    if let Some(mut stdin) = child.stdin.take() {
        std::io::Write::write_all(&mut stdin, (commands.join("\n") + "\n").as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "in namespace {ns}, ip -batch {commands:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
