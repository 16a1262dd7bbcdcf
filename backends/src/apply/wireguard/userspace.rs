//! The userspace WireGuard device: boringtun's device, in this process, under the same
//! name the kernel device would have, configured and read through its UAPI socket
//! (`/var/run/wireguard/<dev>.sock`, so `wg show <dev>` works on it).
//!
//! Two properties of boringtun 0.7's device shape this module. It blocks SIGINT/SIGTERM in
//! the thread that creates it (and in its workers) to read them itself, so devices are
//! created from a dedicated thread and the agent keeps its own signal handling. And it
//! cannot modify an existing peer (it panics), so updates go out as remove + add.

use std::collections::HashMap;
use std::path::PathBuf;

use boringtun::device::{DeviceConfig, DeviceHandle};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use super::uapi::{self, UapiError};
use super::WgDevice;
use crate::apply::ApplyError;

pub const SOCKET_DIR: &str = "/var/run/wireguard";

pub fn socket_path(device: &str) -> PathBuf {
    PathBuf::from(SOCKET_DIR).join(format!("{device}.sock"))
}

/// The userspace devices this process runs, by name.
#[derive(Default)]
pub struct Userspace {
    devices: HashMap<String, DeviceHandle>,
    writes: u64,
}

fn err(op: String) -> impl FnOnce(std::io::Error) -> ApplyError {
    move |source| ApplyError::Netlink { op, source }
}

impl Userspace {
    /// Whether this process runs `device` and the kernel still has its interface.
    pub fn running(&self, device: &str) -> bool {
        self.devices.contains_key(device) && interface_exists(device)
    }

    /// Starts `device` unless it is already running; a device whose interface was deleted
    /// is started again. Returns whether it was (re)started.
    pub fn ensure(&mut self, device: &str) -> Result<bool, ApplyError> {
        if self.running(device) {
            return Ok(false);
        }
        self.devices.remove(device);
        let name = device.to_string();
        let config = DeviceConfig {
            n_threads: 2,
            use_connected_socket: true,
            use_multi_queue: false,
            uapi_fd: -1,
        };
        let started = std::thread::Builder::new()
            .name(format!("wg-start-{device}"))
            .spawn(move || DeviceHandle::new(&name, config).map_err(|e| e.to_string()))
            .map_err(err(format!("starting userspace WireGuard device {device}")))?
            .join()
            .map_err(|_| ApplyError::Netlink {
                op: format!("starting userspace WireGuard device {device}"),
                source: std::io::Error::other("the starting thread panicked"),
            })?;
        let handle = started.map_err(|e| ApplyError::Netlink {
            op: format!("starting userspace WireGuard device {device}"),
            source: std::io::Error::other(e),
        })?;
        self.writes += 1;
        self.devices.insert(device.to_string(), handle);
        Ok(true)
    }

    /// Stops `device` (its interface disappears with it).
    pub fn stop(&mut self, device: &str) {
        self.devices.remove(device);
    }

    async fn exchange(device: &str, request: &str) -> Result<String, ApplyError> {
        let path = socket_path(device);
        let op = format!("talking to {} ({})", device, path.display());
        let mut stream = UnixStream::connect(&path).await.map_err(err(op.clone()))?;
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(err(op.clone()))?;
        let mut reader = BufReader::new(stream);
        let mut answer = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await.map_err(err(op.clone()))? == 0 {
                break;
            }
            let done = line.starts_with("errno=");
            answer.push_str(&line);
            if done {
                break;
            }
        }
        Ok(answer)
    }

    /// The device's configuration and peer statistics.
    pub async fn get(&self, device: &str) -> Result<WgDevice, ApplyError> {
        let answer = Self::exchange(device, "get=1\n\n").await?;
        uapi::parse_get(&answer).map_err(|e| uapi_err(device, "reading", e))
    }

    /// Sends the `set=1` requests from `uapi::encode_set`, in order; stops at the first
    /// the device refuses.
    pub async fn set(&mut self, device: &str, requests: &[String]) -> Result<(), ApplyError> {
        for request in requests {
            self.writes += 1;
            let answer = Self::exchange(device, request).await?;
            uapi::parse_get(&answer).map_err(|e| uapi_err(device, "configuring", e))?;
        }
        Ok(())
    }

    pub fn writes(&self) -> u64 {
        self.writes
    }
}

/// Asks the kernel, in the caller's network namespace (sysfs may show another one).
fn interface_exists(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    unsafe { libc::if_nametoindex(c.as_ptr()) != 0 }
}

fn uapi_err(device: &str, what: &str, e: UapiError) -> ApplyError {
    ApplyError::Netlink {
        op: format!("{what} WireGuard device {device}"),
        source: std::io::Error::other(e.to_string()),
    }
}
