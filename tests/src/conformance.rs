//! A harness for the WireGuard conformance scenarios (the kernel's netns selftest, also run
//! against wireguard-go): three network namespaces, WireGuard devices of either
//! implementation (`WEFT_LAB_IMPLEMENTATION`: `userspace`, the default, or `kernel`) born
//! in one namespace and possibly moved into another, configured with `wg` as an operator
//! would. Each harness has its own tag, so tests run side by side: namespace and device
//! names carry it (a userspace device's UAPI socket is named after its device, in every
//! namespace).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::Context;

use crate::lab::run;

use crate::lab::IMPLEMENTATION_ENV;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// The implementation the scenarios run on: `kernel` in the VM, `userspace` here.
pub fn kernel() -> bool {
    std::env::var(IMPLEMENTATION_ENV).is_ok_and(|v| v == "kernel")
}

/// A device's key pair, as `wg genkey` and `wg pubkey` make them.
pub struct Keys {
    pub file: PathBuf,
    pub public: String,
}

pub struct Net {
    tag: String,
    namespaces: Vec<String>,
    devices: Vec<(String, Option<Child>)>,
    dir: tempfile::TempDir,
    weft: PathBuf,
}

impl Net {
    /// Namespaces 0, 1 and 2, each with its loopback up. `weft` runs userspace devices.
    pub fn new(weft: impl Into<PathBuf>) -> anyhow::Result<Net> {
        let tag = format!(
            "{:x}{}",
            std::process::id() % 0xfff,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut net = Net {
            tag,
            namespaces: Vec::new(),
            devices: Vec::new(),
            dir: tempfile::tempdir()?,
            weft: weft.into(),
        };
        for i in 0..3 {
            let ns = format!("wc{}-{i}", net.tag);
            run(Command::new("ip").args(["netns", "add", &ns]))?;
            net.namespaces.push(ns);
            net.sh(i, "ip link set lo up")?;
        }
        Ok(net)
    }

    pub fn ns(&self, i: usize) -> &str {
        &self.namespaces[i]
    }

    /// The name of this harness's device `n` (at most 15 bytes).
    pub fn dev(&self, n: usize) -> String {
        format!("wc{}d{n}", self.tag)
    }

    /// `sh -c script` in namespace `i`: its output, or an error with its stderr.
    pub fn sh(&self, i: usize, script: &str) -> anyhow::Result<String> {
        crate::lab::in_ns(self.ns(i), script).with_context(|| format!("in namespace {i}"))
    }

    /// Whether `script` succeeds in namespace `i`.
    pub fn ok(&self, i: usize, script: &str) -> bool {
        self.sh(i, script).is_ok()
    }

    /// A fresh key pair, its private key in a file for `wg set … private-key`.
    pub fn keys(&self, name: &str) -> anyhow::Result<Keys> {
        let private = sh_out("wg genkey")?;
        let public = sh_out(&format!("echo {} | wg pubkey", private.trim()))?;
        let file = self.dir.path().join(name);
        std::fs::write(&file, private.trim())?;
        Ok(Keys {
            file,
            public: public.trim().to_string(),
        })
    }

    /// Device `n`, born in namespace `born` (where its UDP sockets live, for good), then
    /// moved to namespace `to` if that is another one. Returns its name.
    pub fn device(&mut self, n: usize, born: usize, to: usize) -> anyhow::Result<String> {
        let name = self.dev(n);
        if kernel() {
            self.sh(born, &format!("ip link add {name} type wireguard"))?;
            self.devices.push((name.clone(), None));
        } else {
            return self.userspace_device(n, born, to);
        }
        self.moved(name, born, to)
    }

    /// Device `n` as weft's userspace device, whatever the implementation under test,
    /// born in namespace `born`, then moved to `to`. Returns its name.
    pub fn userspace_device(&mut self, n: usize, born: usize, to: usize) -> anyhow::Result<String> {
        let name = self.dev(n);
        let weft = self.weft.to_string_lossy().into_owned();
        self.spawn_device(&name, born, &[&weft, "userspace-device"])?;
        self.moved(name, born, to)
    }

    /// Device `n` run by wireguard-go (Debian's package: today's protocol, an independent
    /// implementation), born in namespace `born`, then moved to `to`. Returns its name.
    pub fn wireguard_go(&mut self, n: usize, born: usize, to: usize) -> anyhow::Result<String> {
        let name = self.dev(n);
        self.spawn_device(&name, born, &["wireguard-go", "-f"])?;
        self.moved(name, born, to)
    }

    /// Moves interface `name` from namespace `born` to `to` (if another): its name.
    fn moved(&self, name: String, born: usize, to: usize) -> anyhow::Result<String> {
        if to != born {
            let target = self.ns(to).to_string();
            self.sh(born, &format!("ip link set {name} netns {target}"))?;
        }
        Ok(name)
    }

    /// Starts `program… name` in namespace `born`, its output in the device's log, and
    /// waits for its interface and UAPI socket.
    fn spawn_device(&mut self, name: &str, born: usize, program: &[&str]) -> anyhow::Result<()> {
        let log = std::fs::File::create(self.log_path(name))?;
        let child = Command::new("ip")
            .args(["netns", "exec", self.ns(born)])
            .args(program)
            .arg(name)
            .env("LOG_LEVEL", "verbose")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", program.join(" ")))?;
        self.devices.push((name.to_string(), Some(child)));
        let socket = format!("/var/run/wireguard/{name}.sock");
        crate::wait::until_or(
            &format!("device {name} and its socket"),
            Duration::from_secs(10),
            || {
                std::path::Path::new(&socket).exists()
                    && self.ok(born, &format!("ip link show {name}"))
            },
            || self.diagnose(),
        );
        Ok(())
    }

    /// Joins device `d1` (namespace 1, port 1) and `d2` (namespace 2, port 2), their keys
    /// `k1` and `k2`, as each other's peer: 192.168.241.N/24 inside, the other's /32 as
    /// AllowedIPs, each other's port on namespace 0's loopback as endpoint, and up.
    pub fn join_over_loopback(
        &self,
        (d1, k1): (&str, &Keys),
        (d2, k2): (&str, &Keys),
    ) -> anyhow::Result<()> {
        for (i, dev, me, peer) in [(1, d1, k1, k2), (2, d2, k2, k1)] {
            let other = 3 - i;
            self.sh(
                i,
                &format!(
                    "ip addr add 192.168.241.{i}/24 dev {dev} && \
                     wg set {dev} private-key {} listen-port {i} peer {} \
                     allowed-ips 192.168.241.{other}/32 endpoint 127.0.0.1:{other} && \
                     ip link set {dev} up",
                    me.file.display(),
                    peer.public
                ),
            )?;
        }
        Ok(())
    }

    /// The log of userspace device `name`.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_path(name)).unwrap_or_default()
    }

    /// The process running userspace device `name`, if this harness started one.
    pub fn process(&mut self, name: &str) -> Option<&mut Child> {
        self.devices
            .iter_mut()
            .find(|(n, _)| n == name)
            .and_then(|(_, c)| c.as_mut())
    }

    /// `wg show <dev> <what>` in namespace `i`, as (public key, value) pairs.
    pub fn show(&self, i: usize, dev: &str, what: &str) -> anyhow::Result<Vec<(String, String)>> {
        let out = self.sh(i, &format!("wg show {dev} {what}"))?;
        Ok(out
            .lines()
            .filter_map(|l| {
                let (k, v) = l.split_once('\t')?;
                Some((k.to_string(), v.trim().to_string()))
            })
            .collect())
    }

    /// What a failing test shows: each namespace's devices (`wg show all`), addresses and
    /// routes, and each userspace device's log.
    pub fn diagnose(&self) -> String {
        let mut out = String::new();
        for i in 0..self.namespaces.len() {
            let seen = self
                .sh(i, "wg show all; ip -br addr; ip route; ip -6 route")
                .unwrap_or_else(|e| format!("{e:#}"));
            out += &format!("--- namespace {i}\n{seen}");
        }
        for (name, _) in &self.devices {
            out += &format!("--- {name}'s log\n{}", self.log(name));
        }
        out
    }

    /// The endpoint namespace `i`'s device `dev` holds for the peer with key `peer`.
    pub fn endpoint(&self, i: usize, dev: &str, peer: &str) -> Option<String> {
        self.show(i, dev, "endpoints")
            .ok()?
            .into_iter()
            .find(|(k, _)| k == peer)
            .map(|(_, v)| v)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for (name, child) in &mut self.devices {
            if let Some(child) = child {
                let _ = child.kill();
                let _ = child.wait();
            }
            let _ = std::fs::remove_file(format!("/var/run/wireguard/{name}.sock"));
        }
        for ns in self.namespaces.iter().rev() {
            // Kernel devices and veths go with their namespace.
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

fn sh_out(script: &str) -> anyhow::Result<String> {
    let out = run(Command::new("sh").args(["-c", script]))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
