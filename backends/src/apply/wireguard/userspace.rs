//! The userspace WireGuard device (`crate::userspace`), under the name the kernel device
//! would have, with its UAPI socket `/var/run/wireguard/<dev>.sock` so `wg show` works.
//! `run_device` is the device process (`weft userspace-device <dev>`); `Userspace` runs
//! devices inside this process (the backends' own tests use it).

use std::collections::HashMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::uapi::{self, UapiError};
pub use super::uapi_socket::{socket_path, SOCKET_DIR};
use super::WgDevice;
use crate::apply::ApplyError;
use crate::userspace::uapi as device_uapi;
use crate::userspace::Device;

struct Running {
    device: Arc<Device>,
    /// The inode of the socket file this device bound: removed on stop only if the path
    /// still names it (a successor may have bound the path since).
    socket_inode: Option<u64>,
}

impl Running {
    /// Stops the device: its interface goes, and its socket file if still its own.
    fn stop(&self, name: &str) {
        self.device.stop();
        remove_socket(name, self.socket_inode);
    }
}

/// The userspace devices this process runs, by name.
#[derive(Default)]
pub struct Userspace {
    devices: HashMap<String, Running>,
    writes: u64,
}

fn err(op: String) -> impl FnOnce(std::io::Error) -> ApplyError {
    move |source| ApplyError::Io { op, source }
}

/// Fails if a live process already serves `device`'s UAPI socket: one device name, one
/// process (the socket's path names the device in every network namespace).
fn refuse_if_served(device: &str) -> std::io::Result<()> {
    let path = socket_path(device);
    let Ok(stream) = std::os::unix::net::UnixStream::connect(&path) else {
        return Ok(());
    };
    let who = super::process::peer_pid(&stream)
        .map(|pid| format!("process {pid}"))
        .unwrap_or_else(|| "a live process".into());
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!(
            "{who} already serves {} (a device of this name runs); stop it first",
            path.display()
        ),
    ))
}

/// Starts `device` and serves its UAPI socket from a thread of its own.
fn start(device: &str) -> Result<Running, ApplyError> {
    let op = format!("starting userspace WireGuard device {device}");
    refuse_if_served(device).map_err(err(op.clone()))?;
    // The peers' handshake timestamps outlive this process beside its socket (tmpfs).
    let replay = PathBuf::from(SOCKET_DIR).join(format!("{device}.replay"));
    let dev = Device::start(device, delete_link, Some(replay)).map_err(err(op))?;
    let path = socket_path(device);
    std::fs::create_dir_all(SOCKET_DIR).map_err(err(format!("creating {SOCKET_DIR}")))?;
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).map_err(err(format!("listening on {}", path.display())))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .map_err(err(format!("restricting {}", path.display())))?;
    let socket_inode = std::fs::metadata(&path).ok().map(|m| m.ino());
    let (state, sockets) = (dev.shared_state(), Arc::new(dev.clone()));
    std::thread::Builder::new()
        .name("wg-uapi".into())
        .spawn(move || device_uapi::serve(listener, state, sockets))
        .map_err(err(format!("serving {}", path.display())))?;
    Ok(Running {
        device: dev,
        socket_inode,
    })
}

impl Userspace {
    /// Whether this process runs `device` and the kernel still has the interface it
    /// created (not merely one of that name).
    pub fn running(&self, device: &str) -> bool {
        self.devices
            .get(device)
            .is_some_and(|r| r.device.interface_exists())
    }

    /// Starts `device` unless it is already running; a device whose interface was deleted
    /// is started again. Returns whether it was (re)started.
    pub fn ensure(&mut self, device: &str) -> Result<bool, ApplyError> {
        if self.running(device) {
            return Ok(false);
        }
        self.stop(device);
        let running = start(device)?;
        self.writes += 1;
        self.devices.insert(device.to_string(), running);
        Ok(true)
    }

    /// Stops `device`: its interface and its UAPI socket disappear.
    pub fn stop(&mut self, device: &str) {
        if let Some(running) = self.devices.remove(device) {
            running.stop(device);
        }
    }

    fn running_device(&self, device: &str) -> Result<&Arc<Device>, ApplyError> {
        self.devices
            .get(device)
            .map(|r| &r.device)
            .ok_or_else(|| ApplyError::Io {
                op: format!("talking to userspace WireGuard device {device}"),
                source: std::io::Error::other("not running"),
            })
    }

    /// The device's configuration and peer statistics.
    pub async fn get(&self, device: &str) -> Result<WgDevice, ApplyError> {
        let answer = device_uapi::get(&self.running_device(device)?.state());
        uapi::parse_get(&answer).map_err(|e| uapi_err(device, "reading", e))
    }

    /// Applies the `set=1` requests from `uapi::encode_set`, in order; stops at the first
    /// the device refuses.
    pub async fn set(&mut self, device: &str, requests: &[String]) -> Result<(), ApplyError> {
        let dev = self.running_device(device)?.clone();
        for request in requests {
            self.writes += 1;
            let lines: Vec<String> = request
                .lines()
                .skip(1)
                .filter(|l| !l.is_empty())
                .map(str::to_string)
                .collect();
            let errno = device_uapi::set(&dev.shared_state(), &dev, &lines);
            if errno != 0 {
                return Err(uapi_err(device, "configuring", UapiError::Errno(errno)));
            }
        }
        Ok(())
    }

    pub fn writes(&self) -> u64 {
        self.writes
    }
}

impl Drop for Userspace {
    fn drop(&mut self) {
        for (name, running) in &self.devices {
            running.stop(name);
        }
    }
}

/// Removes `device`'s socket file if it is still the one this process bound.
fn remove_socket(device: &str, inode: Option<u64>) {
    let path = socket_path(device);
    let current = std::fs::metadata(&path).ok().map(|m| m.ino());
    if current.is_some() && current == inode {
        let _ = std::fs::remove_file(path);
    }
}

/// How often the device process checks that its interface still exists.
const INTERFACE_CHECK: Duration = Duration::from_millis(200);

/// Runs `device` in this process until its interface is deleted (moving it to another
/// network namespace is not deleting it), the device cannot go on, or SIGTERM or SIGINT
/// arrives: the userspace device process (`weft userspace-device <dev>`) the agent starts,
/// so the device outlives an agent restart as a kernel device does. The packet path runs
/// on plain threads; the runtime this needs only watches signals and the interface.
/// Returns why it stopped.
pub async fn run_device(device: &str) -> Result<String, ApplyError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(err("handling SIGTERM".into()))?;
    let mut int = signal(SignalKind::interrupt()).map_err(err("handling SIGINT".into()))?;
    let mut us = Userspace::default();
    us.ensure(device)?;
    let dev = us.running_device(device)?.clone();
    let mut check = tokio::time::interval(INTERFACE_CHECK);
    let why = loop {
        tokio::select! {
            _ = term.recv() => break "SIGTERM".to_string(),
            _ = int.recv() => break "SIGINT".to_string(),
            // The sending side found the interface deleted, or a queue or socket that
            // keeps failing: at once.
            why = dev.ended() => break why,
            // Deleted while nothing was sent: by the queue, so an interface moved to
            // another network namespace carries on there (as kernel WireGuard's does).
            _ = check.tick() => if !dev.interface_exists() {
                break "its interface was deleted".to_string();
            },
        }
    };
    us.stop(device);
    Ok(why)
}

fn uapi_err(device: &str, what: &str, e: UapiError) -> ApplyError {
    ApplyError::Io {
        op: format!("{what} WireGuard device {device}"),
        source: e.into(),
    }
}

/// Deletes the interface `name` over rtnetlink if it is still the interface with index
/// `index` (best effort: it may be gone already). A device going away never deletes a
/// successor that took its name.
fn delete_link(name: &str, index: u32) {
    use netlink_packet_route::{link::LinkMessage, RouteNetlinkMessage};
    if crate::userspace::ifindex(name) != Some(index) {
        return;
    }
    let mut link = LinkMessage::default();
    link.header.index = index;
    let protocol = netlink_sys::protocols::NETLINK_ROUTE;
    if let Ok(mut nl) = crate::apply::nl_request::NlSocket::open(protocol) {
        let _ = nl.request(
            RouteNetlinkMessage::DelLink(link),
            netlink_packet_core::NLM_F_ACK,
        );
    }
}
