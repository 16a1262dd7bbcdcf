//! The VM runner: a Debian kernel under qemu, with this machine's root file system mounted
//! read-only over 9p, so lab scenarios run against a kernel that has WireGuard (this
//! machine's has none).
//!
//! `Vm::prepare` fetches the kernel package of Debian's `linux-image-amd64` with
//! `apt-get download`, unpacks it with `dpkg -x` and indexes its modules with `depmod`,
//! once: it is cached under `/var/cache/weft-vm` (`WEFT_VM_CACHE`). `Vm::run` builds a
//! small initramfs around a static busybox (the 9p and virtio modules, an `/init`, the
//! scenario), boots it, and returns what the scenario printed and its exit status. Inside,
//! the host root is `/`, with fresh tmpfs on `/tmp`, `/run`, `/var/tmp`, `/var/lib/weft`,
//! `/var/lib/cni` and `/root`. Modules load on demand from the cached package, through a
//! `modprobe -d` wrapper: the VM never needs the host to have a `/lib/modules`.
//!
//! qemu runs in software emulation (TCG): KVM on this kind of host faults on Debian's
//! kernels. The VM has no network card; everything happens in its own namespaces.

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::lab::run;

pub const CACHE_ENV: &str = "WEFT_VM_CACHE";
const DEFAULT_CACHE: &str = "/var/cache/weft-vm";
/// The line `/init` prints with the scenario's exit status.
const EXIT_MARK: &str = "WEFT-VM-EXIT=";
/// The guest kernel's command line. A CPU that runs kernel code for 60 s without
/// scheduling (a soft lockup: twice `watchdog_thresh`) panics the guest, which prints the
/// stuck CPU's stack even at `loglevel=3` and, with `panic=-1` and qemu's `-no-reboot`,
/// ends the VM at once: a kernel livelock fails the run within a minute, with its trace,
/// instead of at the timeout with none. Emulation alone does not starve a CPU that long.
const KERNEL_ARGS: &str =
    "console=ttyS0 panic=-1 quiet loglevel=3 watchdog_thresh=30 softlockup_panic=1";

/// The modules the initramfs loads before it can mount the host root; everything else
/// loads on demand from the cached package once it is mounted.
const BOOT_MODULES: [&str; 3] = [
    "kernel/drivers/virtio/virtio_pci.ko",
    "kernel/net/9p/9pnet_virtio.ko",
    "kernel/fs/9p/9p.ko",
];

/// A kernel ready to boot: its image and its unpacked package (modules indexed).
pub struct Vm {
    pub package: String,
    pub release: String,
    root: PathBuf,
    pub memory_mib: u32,
    pub cpus: u32,
    /// qemu's `-accel`: `tcg,thread=multi` unless a probe shows KVM works.
    pub accel: String,
    /// qemu's `-cpu`: `qemu64` under emulation, `max` with KVM.
    pub cpu: String,
    /// Host directories that must stay visible at their own path even where the VM mounts
    /// a tmpfs (a workspace under `/tmp`, say), each shared read-only on its own.
    pub keep: Vec<PathBuf>,
    /// Extra kernel command-line words (`WG_DEBUG_ARG`, say).
    pub kernel_args: Vec<String>,
}

/// The kernel command-line word that turns on WireGuard's own debug messages (each
/// handshake sent, received, invalid or retried, per device and peer) from the moment the
/// module loads; `WG_DEBUG_DUMP` prints them at the end of a scenario. For a flaky
/// kernel step: `WEFT_VM_WG_DEBUG=1` in `kernel_vm` sets both.
pub const WG_DEBUG_ARG: &str = "wireguard.dyndbg=+p";
/// A scenario's last lines: WireGuard's debug messages, with wall-clock times (the
/// kernel's clock, which runs apart from the agents' by up to a second under emulation),
/// keepalives left out.
pub const WG_DEBUG_DUMP: &str = "dmesg --time-format iso | grep 'wireguard:' | grep -v 'keepalive' | sed 's/^/wg-debug: /' | tail -5000\n";

/// What a scenario left: everything the VM printed, and the scenario's exit status
/// (`None` if the VM stopped without reporting one).
pub struct VmRun {
    pub status: Option<i32>,
    pub log: String,
    pub elapsed: Duration,
}

fn cache_dir() -> PathBuf {
    std::env::var_os(CACHE_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CACHE))
}

/// The kernel package `linux-image-amd64` currently depends on, e.g.
/// `linux-image-6.1.0-56-amd64`.
fn kernel_package() -> anyhow::Result<String> {
    if let Ok(p) = std::env::var("WEFT_VM_KERNEL_PACKAGE") {
        return Ok(p);
    }
    let out = run(Command::new("apt-cache").args(["depends", "linux-image-amd64"]))?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: "))
        .map(|p| p.trim().to_string())
        .context("apt-cache names no kernel package for linux-image-amd64")
}

/// The modules in `modules.dep` order: each module after the ones it needs.
fn load_order(modules_dep: &str, wanted: &[&str]) -> anyhow::Result<Vec<String>> {
    let deps: std::collections::HashMap<&str, Vec<&str>> = modules_dep
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(m, d)| (m, d.split_whitespace().collect()))
        .collect();
    fn visit<'a>(
        m: &'a str,
        deps: &std::collections::HashMap<&'a str, Vec<&'a str>>,
        order: &mut Vec<String>,
        depth: usize,
    ) -> anyhow::Result<()> {
        if order.iter().any(|o| o == m) {
            return Ok(());
        }
        if depth > 64 {
            bail!("module dependencies loop at {m}");
        }
        let Some(needs) = deps.get(m) else {
            bail!("{m} is not in modules.dep");
        };
        // modules.dep lists the deepest dependency last.
        for d in needs.iter().rev() {
            visit(d, deps, order, depth + 1)?;
        }
        order.push(m.to_string());
        Ok(())
    }
    let mut order = Vec::new();
    for m in wanted {
        visit(m, &deps, &mut order, 0)?;
    }
    Ok(order)
}

/// Whether the ELF executable at `path` needs no dynamic loader (no `PT_INTERP` header).
fn is_static(path: &Path) -> bool {
    let Ok(elf) = fs::read(path) else {
        return false;
    };
    let u16_at = |o: usize| elf.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u64_at = |o: usize| {
        elf.get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    if elf.get(..5) != Some(b"\x7fELF\x02") {
        return false;
    }
    let (Some(phoff), Some(size), Some(count)) = (u64_at(32), u16_at(54), u16_at(56)) else {
        return false;
    };
    const PT_INTERP: u16 = 3;
    (0..usize::from(count)).all(|i| {
        let at = phoff as usize + i * usize::from(size);
        u16_at(at).is_some_and(|t| t != PT_INTERP)
    })
}

impl Vm {
    /// Fetches and unpacks the kernel unless it is cached; checks qemu and busybox.
    pub fn prepare() -> anyhow::Result<Vm> {
        for (tool, package) in [
            ("qemu-system-x86_64", "qemu-system-x86"),
            ("busybox", "busybox-static"),
            ("cpio", "cpio"),
            ("depmod", "kmod"),
        ] {
            if which(tool).is_none() {
                bail!("{tool} is missing: apt-get install {package} (scripts/install-deps does)");
            }
        }
        // The mount points of the VM's fresh tmpfs must exist in the (read-only) host root.
        for dir in ["/var/lib/weft", "/var/lib/cni"] {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {dir}"))?;
        }
        let package = kernel_package()?;
        let cache = cache_dir();
        let root = cache.join(&package);
        if !root.join("ready").exists() {
            fetch(&package, &cache, &root)?;
        }
        let release = fs::read_dir(root.join("lib/modules"))
            .context("the unpacked kernel has no lib/modules")?
            .flatten()
            .find(|e| e.path().join("modules.dep").exists())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .context("the unpacked kernel has no indexed modules")?;
        let accel = std::env::var("WEFT_VM_ACCEL").unwrap_or_else(|_| "tcg,thread=multi".into());
        Ok(Vm {
            package,
            release,
            root,
            memory_mib: 3072,
            cpus: 2,
            accel: accel.clone(),
            // Under emulation the plain 64-bit CPU: with `max` the guest's kernel and
            // programs take SIMD paths that emulate slower than scalar code (the same VM
            // steps took 13-15% longer on 2026-11-28: heal 161.6 s against 137.9 s).
            cpu: std::env::var("WEFT_VM_CPU").unwrap_or_else(|_| {
                if accel.starts_with("kvm") {
                    "max"
                } else {
                    "qemu64"
                }
                .into()
            }),
            keep: Vec::new(),
            kernel_args: Vec::new(),
        })
    }

    fn kernel_image(&self) -> PathBuf {
        self.root.join(format!("boot/vmlinuz-{}", self.release))
    }

    fn modules(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.release)
    }

    /// Builds the initramfs for `scenario` in `dir`; returns its path.
    fn initramfs(&self, dir: &Path, scenario: &str) -> anyhow::Result<PathBuf> {
        let tree = dir.join("tree");
        for d in ["bin", "lib/modules", "proc", "sys", "dev", "root"] {
            fs::create_dir_all(tree.join(d))?;
        }
        let busybox = which("busybox").context("busybox")?;
        if !is_static(&busybox) {
            bail!(
                "{} is not statically linked: apt-get install busybox-static",
                busybox.display()
            );
        }
        fs::copy(&busybox, tree.join("bin/busybox")).context("copying busybox")?;
        let dep = fs::read_to_string(self.modules().join("modules.dep"))?;
        let order = load_order(&dep, &BOOT_MODULES)?;
        let mut names = Vec::new();
        for m in &order {
            let name = Path::new(m)
                .file_name()
                .context("a module path without a name")?
                .to_string_lossy()
                .into_owned();
            fs::copy(self.modules().join(m), tree.join("lib/modules").join(&name))
                .with_context(|| format!("copying module {m}"))?;
            names.push(name);
        }
        fs::write(tree.join("modules"), names.join("\n") + "\n")?;
        fs::write(tree.join("scenario.sh"), scenario)?;
        let init = tree.join("init");
        fs::write(&init, init_script(&self.root, &self.keep))?;
        run(Command::new("chmod").arg("0755").arg(&init))?;
        let image = dir.join("initramfs.cpio");
        let cpio = format!(
            "cd '{}' && find . | cpio -o -H newc --quiet > '{}'",
            tree.display(),
            image.display()
        );
        run(Command::new("sh").args(["-c", &cpio]))?;
        Ok(image)
    }

    /// Boots the VM, runs `scenario` (a `sh` script) as root inside, and returns its
    /// output and status. Fails if qemu cannot start; a VM that outlives `timeout` is
    /// killed and reported with what it printed.
    pub fn run(&self, scenario: &str, timeout: Duration) -> anyhow::Result<VmRun> {
        let dir = tempfile::tempdir()?;
        let initramfs = self.initramfs(dir.path(), scenario)?;
        let started = Instant::now();
        let mut qemu = Command::new("qemu-system-x86_64")
            .args(["-accel", &self.accel, "-cpu", &self.cpu])
            .args(["-smp", &self.cpus.to_string()])
            .args(["-m", &self.memory_mib.to_string()])
            .args(["-nographic", "-no-reboot", "-nic", "none"])
            .arg("-kernel")
            .arg(self.kernel_image())
            .arg("-initrd")
            .arg(&initramfs)
            .arg("-append")
            .arg(
                [KERNEL_ARGS]
                    .into_iter()
                    .chain(self.kernel_args.iter().map(String::as_str))
                    .collect::<Vec<_>>()
                    .join(" "),
            )
            .args([
                "-virtfs",
                "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            ])
            .args(self.keep.iter().enumerate().flat_map(|(i, dir)| {
                [
                    "-virtfs".to_string(),
                    format!(
                        "local,path={},mount_tag=keep{i},security_model=none,readonly=on,multidevs=remap",
                        dir.display()
                    ),
                ]
            }))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting qemu-system-x86_64")?;
        let (tx, lines) = mpsc::channel::<String>();
        let stdout = qemu.stdout.take().context("qemu's stdout")?;
        let stderr = qemu.stderr.take().context("qemu's stderr")?;
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx2.send(format!("qemu: {line}"));
            }
        });
        let mut log = String::new();
        let mut status = None;
        loop {
            let left = timeout.saturating_sub(started.elapsed());
            match lines.recv_timeout(left.min(Duration::from_secs(1))) {
                Ok(line) => {
                    let clean = strip_control(&line);
                    if clean.starts_with("=== ") {
                        // Progress, visible live with --nocapture.
                        eprintln!("vm: {clean}");
                    }
                    if let Some(code) = clean.trim().strip_prefix(EXIT_MARK) {
                        status = code.trim().parse().ok();
                    }
                    log.push_str(&clean);
                    log.push('\n');
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if started.elapsed() >= timeout {
                        let _ = qemu.kill();
                        log.push_str(&format!("weft-vm: killed after {timeout:?}\n"));
                        break;
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let exit = qemu.wait().context("waiting for qemu")?;
        if status.is_none() && !exit.success() {
            log.push_str(&format!("weft-vm: qemu exited {exit}\n"));
        }
        if status.is_none() && log.contains("Kernel panic") {
            log.push_str("weft-vm: the guest kernel panicked; its trace is above\n");
        }
        Ok(VmRun {
            status,
            log,
            elapsed: started.elapsed(),
        })
    }
}

/// Removes terminal escape sequences and carriage returns the firmware and console print.
fn strip_control(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                if chars.peek() == Some(&'[') {
                    chars.next();
                    for c in chars.by_ref() {
                        if c.is_ascii_alphabetic() {
                            break;
                        }
                    }
                } else {
                    chars.next();
                }
            }
            '\r' => {}
            c => out.push(c),
        }
    }
    out
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .chain(["/usr/sbin", "/sbin"])
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.is_file())
}

/// Downloads and unpacks `package` into `root`, atomically (a half-done fetch is redone).
fn fetch(package: &str, cache: &Path, root: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(cache).with_context(|| format!("creating {}", cache.display()))?;
    let work = cache.join(format!("{package}.partial"));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(work.join("deb"))?;
    run(Command::new("apt-get")
        .args(["download", "-q", package])
        .current_dir(work.join("deb")))
    .with_context(|| format!("downloading {package}"))?;
    let deb = fs::read_dir(work.join("deb"))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .context("apt-get download left no .deb")?;
    let tree = work.join("tree");
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(&tree))?;
    let release = fs::read_dir(tree.join("lib/modules"))?
        .flatten()
        .next()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .context("the kernel package has no lib/modules")?;
    run(Command::new("depmod").arg("-b").arg(&tree).arg(&release))?;
    fs::write(tree.join("ready"), format!("{package}\n"))?;
    let _ = fs::remove_dir_all(root);
    fs::rename(&tree, root)?;
    let _ = fs::remove_dir_all(&work);
    Ok(())
}

/// The initramfs's `/init`: load the boot modules, mount the host root, give the
/// scenario writable places, then `switch_root` into the host root, run the scenario,
/// report its status and power off.
///
/// The kernel's modules stay where the unpacked package has them (`kernel_root`, inside
/// the read-only host root): the kernel's own module loading goes through a wrapper on
/// the VM's tmpfs that runs `/sbin/modprobe -d kernel_root`. Nothing depends on what the
/// host root has under `/lib/modules`, or whether it has that directory at all.
fn init_script(kernel_root: &Path, keep: &[PathBuf]) -> String {
    let keep: String = keep
        .iter()
        .enumerate()
        .map(|(i, dir)| {
            format!(
                "mkdir -p /root{d} && mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 keep{i} /root{d}\n",
                d = dir.display()
            )
        })
        .collect();
    format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules); do insmod /lib/modules/$m || echo "weft-vm: insmod $m failed"; done
if ! mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /root; then
  echo "weft-vm: mounting the host root over 9p failed"
  echo "{EXIT_MARK}125"
  poweroff -f
fi
for d in tmp run var/tmp var/lib/weft var/lib/cni root; do mount -t tmpfs -o mode=0755 tmpfs /root/$d; done
chmod 1777 /root/tmp
mount -t proc proc /root/proc
mount -t sysfs sys /root/sys
mount -t devtmpfs dev /root/dev
mkdir -p /root/dev/pts /root/dev/shm
mount -t devpts devpts /root/dev/pts
mount -t cgroup2 cgroup2 /root/sys/fs/cgroup 2>/dev/null
{keep}ln -s /proc/self/fd /root/dev/fd
ln -s /proc/self/fd/0 /root/dev/stdin
ln -s /proc/self/fd/1 /root/dev/stdout
ln -s /proc/self/fd/2 /root/dev/stderr
mkdir -p /root/run/weft-vm
cp /bin/busybox /scenario.sh /root/run/weft-vm/
cat > /root/run/weft-vm/modprobe <<'MODPROBE'
#!/run/weft-vm/busybox sh
exec /sbin/modprobe -d {kernel_root} "$@"
MODPROBE
chmod 0755 /root/run/weft-vm/modprobe
cat > /root/run/weft-vm/stage2.sh <<'STAGE2'
echo /run/weft-vm/modprobe > /proc/sys/kernel/modprobe
# Device nodes that exist only once their module is loaded.
/run/weft-vm/modprobe tun || echo "weft-vm: modprobe tun failed"
/usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root /bin/sh /run/weft-vm/scenario.sh
echo "{EXIT_MARK}$?"
/run/weft-vm/busybox poweroff -f
STAGE2
umount /proc /sys /dev
exec switch_root /root /run/weft-vm/busybox sh /run/weft-vm/stage2.sh
"#,
        kernel_root = kernel_root.display()
    )
}

#[cfg(test)]
#[path = "vm_tests.rs"]
mod tests;
