//! A fresh network namespace per test: a dedicated thread calls `unshare(CLONE_NEWNET)`,
//! brings `lo` up, and drives the test's future on a current-thread runtime, so every
//! netlink socket and every child process it opens lives in that namespace. The namespace
//! disappears with the thread. The host namespace is never touched.

use std::ffi::CString;
use std::future::Future;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

/// Runs `f` in a new network namespace and returns its output; a panic inside is re-raised.
/// Fails (does not skip) without root, saying so.
pub fn in_new_netns<F, Fut, T>(f: F) -> T
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T>,
    T: Send + 'static,
{
    let thread = std::thread::spawn(move || {
        // SAFETY: unshare(2) changes only the calling thread's namespaces; no memory is shared.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert!(
            rc == 0,
            "unshare(CLONE_NEWNET) failed: {} — network-namespace tests must run as root",
            io::Error::last_os_error()
        );
        sh("ip link set lo up");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("building a runtime: {e}"));
        runtime.block_on(f())
    });
    match thread.join() {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Runs a shell command in the current thread's namespace; panics with its stderr if it
/// fails. Returns stdout.
pub fn sh(cmd: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .output()
        .unwrap_or_else(|e| panic!("running `{cmd}`: {e}"));
    assert!(
        out.status.success(),
        "`{cmd}` failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `sh` on the blocking pool, for commands that talk back to services running on this
/// thread's runtime (e.g. `wg show` against weft's own UAPI socket). The pool's threads are
/// started from this thread, so they are in the same network namespace.
pub async fn sh_async(cmd: &str) -> String {
    let cmd = cmd.to_string();
    match tokio::task::spawn_blocking(move || sh(&cmd)).await {
        Ok(out) => out,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// What a child gets in a private mount namespace of its own, made between fork and exec:
/// directories created (where missing), then bind mounts in order.
#[derive(Default, Clone)]
pub struct Mounts {
    private: bool,
    dirs: Vec<CString>,
    binds: Vec<(CString, CString, libc::c_ulong)>,
}

impl Mounts {
    /// A private mount namespace (as `unshare --mount --propagation private`).
    pub fn private() -> Mounts {
        Mounts {
            private: true,
            ..Mounts::default()
        }
    }

    /// `mkdir target` (an existing one is fine; its parent must exist).
    pub fn dir(mut self, target: &Path) -> Mounts {
        self.dirs.push(c_path(target));
        self
    }

    /// `mount --bind source target`.
    pub fn bind(mut self, source: &Path, target: &Path) -> Mounts {
        let flags = libc::MS_BIND;
        self.binds.push((c_path(source), c_path(target), flags));
        self
    }

    /// `mount --rbind source target`.
    pub fn rbind(mut self, source: &Path, target: &Path) -> Mounts {
        let flags = libc::MS_BIND | libc::MS_REC;
        self.binds.push((c_path(source), c_path(target), flags));
        self
    }

    /// In the child, after fork: only async-signal-safe calls on what was allocated before.
    fn apply(&self) -> io::Result<()> {
        if !self.private {
            return Ok(());
        }
        let check = |rc: libc::c_int| match rc {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        };
        // SAFETY: unshare(2), mount(2) and mkdir(2) with NUL-terminated paths that outlive
        // the calls; they change only the child's own namespaces and the named paths.
        unsafe {
            check(libc::unshare(libc::CLONE_NEWNS))?;
            let root = c"/".as_ptr();
            let private = libc::MS_REC | libc::MS_PRIVATE;
            check(libc::mount(
                std::ptr::null(),
                root,
                std::ptr::null(),
                private,
                std::ptr::null(),
            ))?;
            for dir in &self.dirs {
                if libc::mkdir(dir.as_ptr(), 0o755) != 0 {
                    let error = io::Error::last_os_error();
                    if error.kind() != io::ErrorKind::AlreadyExists {
                        return Err(error);
                    }
                }
            }
            for (source, target, flags) in &self.binds {
                let (source, target) = (source.as_ptr(), target.as_ptr());
                check(libc::mount(
                    source,
                    target,
                    std::ptr::null(),
                    *flags,
                    std::ptr::null(),
                ))?;
            }
        }
        Ok(())
    }
}

/// A path as mount(2) takes it; a path with a NUL byte (none of the lab's) becomes one
/// that does not exist, so the spawn fails.
fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).unwrap_or_else(|_| c"/nonexistent".into())
}

/// `program`, to be run inside the named network namespace (`/run/netns/<name>`) and, if
/// `mounts` asks for one, a private mount namespace prepared as it says (a lab node's own
/// `/run` and `/var/lib/weft`, say). The child does it between fork and exec: one process,
/// where `ip netns exec`, `unshare`, `mkdir` and `mount` would each be one more (under the
/// VM's emulation about 0.1 s apiece). Unlike `ip netns exec`, the child keeps the
/// caller's `/sys`: read a device's attributes with `ip`. A namespace that does not exist
/// fails the spawn.
pub fn command_with_mounts(name: &str, program: &str, mounts: &Mounts) -> Command {
    let mut command = Command::new(program);
    let path = c_path(Path::new(&format!("/run/netns/{name}")));
    let mounts = mounts.clone();
    // SAFETY: between fork and exec the closure calls only open(2), setns(2), close(2) and
    // what `Mounts::apply` calls, all async-signal-safe, on memory allocated before the fork.
    unsafe {
        command.pre_exec(move || {
            let fd = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let rc = libc::setns(fd, libc::CLONE_NEWNET);
            let error = io::Error::last_os_error();
            libc::close(fd);
            if rc != 0 {
                return Err(error);
            }
            mounts.apply()
        });
    }
    command
}

/// `script` inside the named network namespace with `mounts`: run directly when it is one
/// simple command (`exec` before it dropped), by `sh -c` otherwise. Under the VM's
/// emulation a shell costs about 0.05 s to start, and the lab runs many one-command
/// scripts (`wg show …`, `ip …`).
pub fn script_in(name: &str, mounts: &Mounts, script: &str) -> Command {
    let special = |c: char| "|&;<>()$`\\\"'\t\n*?[]#~%{}!".contains(c);
    let words: Vec<&str> = script.split(' ').filter(|w| !w.is_empty()).collect();
    let words = match words.first() {
        Some(&"exec") => &words[1..],
        _ => &words[..],
    };
    match words.split_first() {
        // `=` only in the first word (an assignment) needs the shell.
        Some((program, args)) if !script.contains(special) && !program.contains('=') => {
            let mut command = command_with_mounts(name, program, mounts);
            command.args(args);
            command
        }
        _ => {
            let mut command = command_with_mounts(name, "sh", mounts);
            command.args(["-c", script]);
            command
        }
    }
}

/// The processes in the named network namespace (as `ip netns pids`: those whose
/// `/proc/<pid>/ns/net` is the namespace's file), read from `/proc` without a process.
pub fn pids_in(name: &str) -> Vec<i32> {
    use std::os::unix::fs::MetadataExt;
    let Ok(ns) = std::fs::metadata(format!("/run/netns/{name}")) else {
        return Vec::new();
    };
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::metadata(format!("/proc/{pid}/ns/net"))
                .is_ok_and(|m| m.dev() == ns.dev() && m.ino() == ns.ino())
        })
        .collect()
}

/// Deletes the named network namespace as `ip netns del` does: its bind mount under
/// `/run/netns` detached and the file removed (the namespace ends with its last user).
pub fn delete(name: &str) -> io::Result<()> {
    let path = format!("/run/netns/{name}");
    let c_path = c_path(Path::new(&path));
    // SAFETY: umount2(2) on a NUL-terminated path that outlives the call.
    if unsafe { libc::umount2(c_path.as_ptr(), libc::MNT_DETACH) } != 0 {
        let error = io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EINVAL) || !Path::new(&path).exists() {
            return Err(error);
        }
    }
    std::fs::remove_file(&path)
}

/// `ip netns add name` without the two `ip` processes (each costs about 0.1 s of CPU under
/// the VM's emulation): a thread of our own unshares its network namespace, brings `lo` up
/// and bind-mounts the namespace on `/run/netns/<name>`, which is made a shared mount point
/// first, as `ip` makes it, so the namespace shows in mount namespaces made after it.
pub fn add(name: &str) -> io::Result<()> {
    static SHARED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    SHARED
        .get_or_init(|| share_run_netns().map_err(|e| format!("making /run/netns shared: {e}")))
        .clone()
        .map_err(io::Error::other)?;
    let path = format!("/run/netns/{name}");
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o000)
        .open(&path)?;
    let target = c_path(Path::new(&path));
    let made = std::thread::spawn(move || -> io::Result<()> {
        // SAFETY: unshare(2) changes only this thread's network namespace; mount(2) with
        // NUL-terminated paths that outlive the call.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNET) != 0 {
                return Err(io::Error::last_os_error());
            }
            lo_up()?;
            let own = c"/proc/thread-self/ns/net".as_ptr();
            let flags = libc::MS_BIND;
            if libc::mount(
                own,
                target.as_ptr(),
                std::ptr::null(),
                flags,
                std::ptr::null(),
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    })
    .join()
    .unwrap_or_else(|_| Err(io::Error::other("the namespace's thread panicked")));
    if made.is_err() {
        let _ = std::fs::remove_file(&path);
    }
    made
}

/// `/run/netns` as a shared mount point (bound onto itself first if it is none), as `ip`
/// leaves it.
fn share_run_netns() -> io::Result<()> {
    std::fs::create_dir_all("/run/netns")?;
    let dir = c"/run/netns".as_ptr();
    let share = || {
        // SAFETY: mount(2) changing the propagation of a NUL-terminated static path.
        let flags = libc::MS_SHARED | libc::MS_REC;
        unsafe {
            libc::mount(
                c"none".as_ptr(),
                dir,
                std::ptr::null(),
                flags,
                std::ptr::null(),
            )
        }
    };
    if share() == 0 {
        return Ok(());
    }
    let error = io::Error::last_os_error();
    if error.raw_os_error() != Some(libc::EINVAL) {
        return Err(error);
    }
    // SAFETY: as above, binding the directory onto itself.
    let flags = libc::MS_BIND | libc::MS_REC;
    if unsafe { libc::mount(dir, dir, std::ptr::null(), flags, std::ptr::null()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    match share() {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Sets `lo` up in the calling thread's network namespace.
fn lo_up() -> io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: socket(2) and two ioctl(2)s on a zeroed ifreq naming `lo`; the descriptor is
    // owned (closed on return).
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let socket = OwnedFd::from_raw_fd(fd);
        let mut request: libc::ifreq = std::mem::zeroed();
        request.ifr_name[0] = b'l' as libc::c_char;
        request.ifr_name[1] = b'o' as libc::c_char;
        if libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut request) != 0 {
            return Err(io::Error::last_os_error());
        }
        request.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &request) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Runs `f` on a new thread inside the named network namespace (`/run/netns/<name>`, as
/// made by `ip netns add`), e.g. one end of a TCP transfer inside a lab pod.
pub fn in_named_netns<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<io::Result<T>> {
    let path = format!("/run/netns/{name}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path)?;
        // SAFETY: setns(2) on a namespace file we hold open; affects only this thread.
        let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(f())
    })
}

/// `GET path` on `addr` from inside namespace `ns`: (status code, body).
pub fn http_get(ns: &str, addr: &str, path: &str) -> (u16, String) {
    let (addr, path) = (addr.to_string(), path.to_string());
    let result = in_named_netns(ns, move || -> io::Result<String> {
        let mut s = std::net::TcpStream::connect(&addr)?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    })
    .join();
    let text = match result {
        Ok(Ok(Ok(text))) => text,
        Ok(other) => return (0, format!("{other:?}")),
        Err(_) => return (0, "the HTTP thread panicked".into()),
    };
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    (code, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_one_command_script_runs_without_a_shell_and_any_other_with_one() {
        let program = |script: &str| {
            let command = script_in("ns", &Mounts::default(), script);
            let args: Vec<String> = command
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            (command.get_program().to_string_lossy().into_owned(), args)
        };
        assert_eq!(
            program("wg show  flannel-wg peers"),
            (
                "wg".into(),
                vec!["show".into(), "flannel-wg".into(), "peers".into()]
            )
        );
        assert_eq!(program("exec /bin/weft agent --x=1").1, ["agent", "--x=1"]);
        for script in [
            "a | b", "a && b", "a > f", "a $X", "a 'b c'", "A=1 a", "a; b", "a\nb",
        ] {
            assert_eq!(
                program(script),
                ("sh".into(), vec!["-c".into(), script.into()]),
                "{script}"
            );
        }
    }

    #[test]
    fn an_added_namespace_has_lo_up_runs_commands_and_is_deleted() {
        let name = format!("wtadd{}", std::process::id());
        add(&name).unwrap();
        let lo = Command::new("ip")
            .args(["-n", &name, "-o", "link", "show", "lo"])
            .output()
            .unwrap();
        let lo = String::from_utf8_lossy(&lo.stdout).into_owned();
        let entered = script_in(&name, &Mounts::default(), "ip -o link show")
            .output()
            .unwrap();
        let links = String::from_utf8_lossy(&entered.stdout).into_owned();
        let taken = add(&name).is_err();
        delete(&name).unwrap();
        assert!(lo.contains("LOOPBACK,UP"), "{lo}");
        // Only lo: a namespace of its own, not the host's.
        assert_eq!(links.lines().count(), 1, "{links}");
        assert!(taken, "a second namespace of the same name was made");
        assert!(!Path::new(&format!("/run/netns/{name}")).exists());
    }
}
