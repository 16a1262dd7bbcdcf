//! The userspace WireGuard device run as its own process (`weft userspace-device <dev>`,
//! see `userspace::run_device`), driven over its UAPI socket like `wg` drives it. Being a
//! process of its own, the device outlives the agent as a kernel device would: an agent
//! that crashes or is restarted leaves every session and every packet in flight alone,
//! and the next agent finds the device configured and writes nothing.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weft_crypto::PrivateKey;

use super::diff::DeviceChange;
use super::uapi::{self, encode_set};
use super::uapi_socket::{socket_path, UapiClient};
use super::{WgDevice, WgDevices};
use crate::apply::{ApplyError, Netlink, ObservedLink, RtNetlink};

/// The link type of a TUN device, which a userspace device is.
pub const KIND: &str = "tun";

/// How long a freshly started device process may take to answer on its socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);

pub struct UserspaceProcess {
    /// The program, and the arguments before the device name, that run a device.
    command: Vec<String>,
    /// Device processes started by this agent, reaped once they exit.
    children: Vec<Child>,
    writes: u64,
}

fn err(op: String) -> impl FnOnce(std::io::Error) -> ApplyError {
    move |source| ApplyError::Io { op, source }
}

/// Kills the process serving `device`'s UAPI socket, if one answers and it is a WireGuard
/// device process for `device` (`is_device_process`), and removes the socket file. Any
/// other program holding the socket is left alone, socket included, and named in the
/// error. Blocking: runs before a device is replaced.
pub fn stop_server(device: &str) -> Result<(), ApplyError> {
    let path = socket_path(device);
    if let Ok(stream) = std::os::unix::net::UnixStream::connect(&path) {
        if let Some(pid) = peer_pid(&stream) {
            if pid != std::process::id() as i32 && pid > 1 {
                kill_device_process(pid, device)?;
            }
        }
    }
    let _ = std::fs::remove_file(path);
    Ok(())
}

/// Whether `cmdline` (as `/proc/<pid>/cmdline`: arguments separated by NUL) runs a
/// WireGuard device named `device`: weft's `userspace-device`, wireguard-go or boringtun
/// (a device another tool left behind).
pub fn is_device_process(cmdline: &[u8], device: &str) -> bool {
    let args: Vec<&[u8]> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .collect();
    let Some(program) = args.first() else {
        return false;
    };
    let program = program.rsplit(|b| *b == b'/').next().unwrap_or(program);
    let names_device = args.contains(&device.as_bytes());
    let weft = args.contains(&&b"userspace-device"[..]);
    let other = [&b"wireguard-go"[..], b"boringtun", b"boringtun-cli"].contains(&program);
    names_device && (weft || other)
}

/// SIGKILLs `pid` if it runs a device process for `device`; any other program is an
/// error naming it. Through a pidfd: the process whose command line was read is the one
/// signalled, even if `pid` is reused meanwhile.
fn kill_device_process(pid: i32, device: &str) -> Result<(), ApplyError> {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let Some(fd) = i32::try_from(fd).ok().filter(|fd| *fd >= 0) else {
        return Ok(()); // gone already
    };
    // SAFETY: `fd` was just returned by pidfd_open and is owned here alone.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    if !is_device_process(&cmdline, device) {
        let command = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        return Err(ApplyError::Io {
            op: format!(
                "taking over WireGuard device {device}: its UAPI socket {} is held by pid \
                 {pid} ({:?}), which is not a WireGuard device process; stop it or free the name",
                socket_path(device).display(),
                command.trim()
            ),
            source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
        });
    }
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal(2) on a live pidfd, no siginfo, no flags.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    // Until it is gone: its sockets (the tunnel's port among them) close before its pidfd
    // turns readable, so the device that replaces it can bind the port.
    let mut poll = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, for at most EXIT_WAIT.
    let ready = unsafe { libc::poll(&mut poll, 1, EXIT_WAIT.as_millis() as libc::c_int) };
    if ready == 0 {
        tracing::warn!(
            pid,
            device,
            "the old device process has not exited after SIGKILL"
        );
    }
    Ok(())
}

/// How long `kill_device_process` waits for the killed process to be gone.
const EXIT_WAIT: Duration = Duration::from_secs(2);

/// Removes a WireGuard device of either kind: the userspace process serving its socket, if
/// one does, and the link.
pub async fn remove_device(nl: &mut RtNetlink, link: &ObservedLink) -> Result<(), ApplyError> {
    stop_server(&link.name)?;
    nl.del_link(link).await
}

pub(crate) fn peer_pid(stream: &std::os::unix::net::UnixStream) -> Option<i32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a `ucred` of the length given; both outlive the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid)
}

impl UserspaceProcess {
    /// `command`: the program and leading arguments that run one device, e.g.
    /// `["/usr/local/bin/weft", "userspace-device"]`; the device name is appended.
    pub fn new(command: Vec<String>) -> Self {
        UserspaceProcess {
            command,
            children: Vec::new(),
            writes: 0,
        }
    }

    /// A handle on the same devices that started none of them.
    pub fn another(&self) -> Self {
        UserspaceProcess::new(self.command.clone())
    }

    async fn client(&self, device: &str) -> Result<UapiClient, ApplyError> {
        UapiClient::connect(device).await.map_err(err(format!(
            "connecting to userspace WireGuard device {device} at {}",
            socket_path(device).display()
        )))
    }

    /// Whether a device process serves `device` and its TUN link exists.
    async fn alive(&self, nl: &mut RtNetlink, device: &str) -> Result<bool, ApplyError> {
        let link = nl.link(device).await?;
        if link.and_then(|l| l.kind).as_deref() != Some(KIND) {
            return Ok(false);
        }
        // A listening socket is the process (a `get` here would dump every peer, and the
        // pass reads the device right after anyway).
        Ok(UapiClient::connect(device).await.is_ok())
    }
}

impl WgDevices for UserspaceProcess {
    type Nl = RtNetlink;

    fn name(&self) -> &'static str {
        "userspace"
    }

    async fn remove(nl: &mut RtNetlink, link: &ObservedLink) -> Result<(), ApplyError> {
        remove_device(nl, link).await
    }

    /// Starts a device process for `device` unless one runs; whatever else holds the name
    /// (a kernel device, a TUN without its process, a process whose link was deleted) is
    /// removed first. Returns whether a process was started.
    async fn ensure(&mut self, nl: &mut RtNetlink, device: &str) -> Result<bool, ApplyError> {
        self.children
            .retain_mut(|c| matches!(c.try_wait(), Ok(None)));
        if self.alive(nl, device).await? {
            return Ok(false);
        }
        stop_server(device)?;
        if let Some(link) = nl.link(device).await? {
            nl.del_link(&link).await?;
        }
        let op = format!("starting userspace WireGuard device {device}");
        let Some((program, args)) = self.command.split_first() else {
            return Err(err(op)(std::io::Error::other(
                "no device command configured",
            )));
        };
        let mut cmd = Command::new(program);
        cmd.args(args)
            .arg(device)
            .stdin(Stdio::null())
            // Its own process group: a Ctrl-C meant for the agent leaves the device alone.
            .process_group(0);
        let mut child = cmd.spawn().map_err(err(format!("{op}: {program}")))?;
        self.writes += 1;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(err(op)(std::io::Error::other(format!(
                    "the device process exited ({status}) before it answered"
                ))));
            }
            if self.alive(nl, device).await? {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(err(op)(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no answer on {} in {START_TIMEOUT:?}",
                        socket_path(device).display()
                    ),
                )));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.children.push(child);
        Ok(true)
    }

    async fn get(&mut self, device: &str) -> Result<WgDevice, ApplyError> {
        let mut client = self.client(device).await?;
        let answer = client
            .exchange("get=1\n")
            .await
            .map_err(err(format!("reading userspace WireGuard device {device}")))?;
        uapi::parse_get(&answer)
            .map_err(|e| err(format!("reading userspace WireGuard device {device}"))(e.into()))
    }

    /// Sends `change` as one `set=1` request: peers added, changed in place, removed.
    async fn apply(
        &mut self,
        device: &str,
        change: &DeviceChange,
        key: &PrivateKey,
    ) -> Result<(), ApplyError> {
        let mut client = self.client(device).await?;
        let op = format!("configuring userspace WireGuard device {device}");
        // The device keeps its sockets when the new port cannot be bound, but the error
        // that says who holds the port is made here, before the device is asked.
        if let Some(port) = change.listen_port {
            port_free(port).await.map_err(err(op.clone()))?;
        }
        for request in encode_set(change, key) {
            self.writes += 1;
            let answer = client.exchange(&request).await.map_err(err(op.clone()))?;
            uapi::parse_get(&answer).map_err(|e| err(op.clone())(e.into()))?;
        }
        Ok(())
    }

    fn writes(&self) -> u64 {
        self.writes
    }
}

impl Default for UserspaceProcess {
    /// Runs devices with this very program (`weft userspace-device <dev>`).
    fn default() -> Self {
        let exe = std::env::current_exe()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "weft".into());
        UserspaceProcess::new(vec![exe, "userspace-device".into()])
    }
}

/// Whether UDP `port` can be bound on IPv4 and IPv6 as the userspace device binds it
/// (without `SO_REUSEADDR`); a family this host lacks does not count. A port being released
/// (a device process in the middle of exiting) is waited for, up to `RELEASE_WAIT`.
/// `AddrInUse` if someone else holds it.
async fn port_free(port: u16) -> std::io::Result<()> {
    let deadline = Instant::now() + RELEASE_WAIT;
    loop {
        match port_free_now(port) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            other => return other,
        }
    }
}

/// How long `port_free` waits for a port being released.
const RELEASE_WAIT: Duration = Duration::from_secs(1);

fn port_free_now(port: u16) -> std::io::Result<()> {
    use socket2::{Domain, Protocol, Socket, Type};
    let addrs: [std::net::SocketAddr; 2] = [
        (std::net::Ipv4Addr::UNSPECIFIED, port).into(),
        (std::net::Ipv6Addr::UNSPECIFIED, port).into(),
    ];
    for addr in addrs {
        let socket = match Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        {
            Ok(s) => s,
            Err(_) if addr.is_ipv6() => continue,
            Err(e) => return Err(e),
        };
        if addr.is_ipv6() {
            socket.set_only_v6(true)?;
        }
        match socket.bind(&addr.into()) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => return Err(e),
            _ => {}
        }
    }
    Ok(())
}
