//! The userspace WireGuard device: boringtun's device, in this process, under the same
//! name the kernel device would have.
//!
//! boringtun is driven through a private socketpair (its `uapi_fd` mode), and weft serves
//! the UAPI socket `/var/run/wireguard/<dev>.sock` itself, relaying each request, so
//! `wg show <dev>` works. Not using boringtun's own socket mode matters: that mode blocks
//! SIGINT/SIGTERM and reads them through a signalfd that competes with the agent for the
//! process's signals (a SIGTERM could stop the device and never reach the agent), and it
//! stops the device when the socket file is removed. boringtun 0.7 also cannot modify an
//! existing peer (it panics), so updates go out as remove + add (see `uapi::encode_set`).

use std::collections::HashMap;
use std::os::fd::IntoRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use boringtun::device::{DeviceConfig, DeviceHandle};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use super::uapi::{self, UapiError};
use super::uapi_socket::{read_answer, read_request};
pub use super::uapi_socket::{socket_path, SOCKET_DIR};
use super::WgDevice;
use crate::apply::ApplyError;

/// The TUN clone device boringtun opens.
const TUN: &str = "/dev/net/tun";

/// weft's end of the socketpair to one boringtun device; one request at a time.
type Control = Arc<Mutex<Channel>>;

struct Channel {
    stream: BufReader<UnixStream>,
    /// The `private_key=` line weft last set. boringtun answers `get` with a non-standard
    /// `own_public_key=`; the standard answer (which `wg show` reads) carries the private key.
    private_key: Option<String>,
}

struct Running {
    /// Dropping it stops the device (its interface disappears).
    _handle: DeviceHandle,
    control: Control,
    server: JoinHandle<()>,
    /// The inode of the socket file this device bound: removed on stop only if the path
    /// still names it (a successor may have bound the path since).
    socket_inode: Option<u64>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.server.abort();
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

async fn exchange_on(control: &Control, request: &str) -> std::io::Result<String> {
    let mut channel = control.lock().await;
    if let Some(line) = request.lines().find(|l| l.starts_with("private_key=")) {
        channel.private_key = Some(line.to_string());
    }
    channel
        .stream
        .get_mut()
        .write_all(request.as_bytes())
        .await?;
    let answer = read_answer(&mut channel.stream).await?;
    let answer = match &channel.private_key {
        Some(key) => answer
            .lines()
            .map(|l| {
                if l.starts_with("own_public_key=") {
                    key.as_str()
                } else {
                    l
                }
            })
            .fold(String::new(), |mut out, l| {
                out.push_str(l);
                out.push('\n');
                out
            }),
        None => answer,
    };
    Ok(handshake_times_since_epoch(&answer, SystemTime::now()))
}

/// boringtun reports `last_handshake_time_sec`/`_nsec` as the time *since* the handshake;
/// the protocol (and `wg show`) mean the time since the Unix epoch. Rewritten here, once,
/// for weft's own reads and for every client of the socket.
fn handshake_times_since_epoch(answer: &str, now: SystemTime) -> String {
    let mut out = String::with_capacity(answer.len());
    let mut secs: Option<u64> = None;
    for line in answer.split_inclusive('\n') {
        if let Some(v) = line.trim_end().strip_prefix("last_handshake_time_sec=") {
            secs = v.parse().ok();
            continue;
        }
        if let Some(v) = line.trim_end().strip_prefix("last_handshake_time_nsec=") {
            let ago = Duration::new(secs.take().unwrap_or(0), v.parse().unwrap_or(0));
            let at = now
                .checked_sub(ago)
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .unwrap_or_default();
            out.push_str(&format!(
                "last_handshake_time_sec={}\nlast_handshake_time_nsec={}\n",
                at.as_secs(),
                at.subsec_nanos()
            ));
            continue;
        }
        out.push_str(line);
    }
    out
}

/// Serves `wg` and other UAPI clients on the device's socket, relaying to boringtun.
async fn serve(listener: UnixListener, control: Control) {
    while let Ok((client, _)) = listener.accept().await {
        let control = control.clone();
        tokio::spawn(async move {
            let (read, mut write) = client.into_split();
            let mut reader = BufReader::new(read);
            while let Ok(Some(request)) = read_request(&mut reader).await {
                let Ok(answer) = exchange_on(&control, &request).await else {
                    return;
                };
                if write.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
    }
}

impl Userspace {
    /// Whether this process runs `device` and the kernel still has its interface.
    pub fn running(&self, device: &str) -> bool {
        self.devices.contains_key(device) && interface_exists(device)
    }

    /// Starts `device` unless it is already running; a device whose interface was deleted
    /// is started again. Returns whether it was (re)started. Must run inside a tokio runtime.
    pub fn ensure(&mut self, device: &str) -> Result<bool, ApplyError> {
        if self.running(device) {
            return Ok(false);
        }
        self.stop(device);
        let op = format!("starting userspace WireGuard device {device}");
        if !std::path::Path::new(TUN).exists() {
            return Err(err(op)(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "{TUN} is missing: load the tun module (modprobe tun), or in a container \
                     mount the host's {TUN}"
                ),
            )));
        }
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(err(op.clone()))?;
        ours.set_nonblocking(true).map_err(err(op.clone()))?;
        let stream = BufReader::new(UnixStream::from_std(ours).map_err(err(op.clone()))?);
        let control: Control = Arc::new(Mutex::new(Channel {
            stream,
            private_key: None,
        }));
        // boringtun takes ownership of its end of the pair.
        let config = DeviceConfig {
            n_threads: 2,
            // Off: boringtun would connect a socket per peer, and a rotating node's two
            // entries (its current and its staged next key) share one endpoint, so the
            // kernel would hand the next key's handshake to the current key's socket,
            // which drops it. One listening socket dispatches by key and index instead.
            use_connected_socket: false,
            use_multi_queue: false,
            uapi_fd: theirs.into_raw_fd(),
        };
        let name = device.to_string();
        let handle = std::thread::Builder::new()
            .name(format!("wg-start-{device}"))
            .spawn(move || DeviceHandle::new(&name, config).map_err(|e| e.to_string()))
            .map_err(err(op.clone()))?
            .join()
            .map_err(|_| ApplyError::Io {
                op: op.clone(),
                source: std::io::Error::other("the starting thread panicked"),
            })?
            .map_err(|e| ApplyError::Io {
                op: op.clone(),
                source: std::io::Error::other(e),
            })?;
        let path = socket_path(device);
        std::fs::create_dir_all(SOCKET_DIR).map_err(err(format!("creating {SOCKET_DIR}")))?;
        let _ = std::fs::remove_file(&path);
        let listener =
            UnixListener::bind(&path).map_err(err(format!("listening on {}", path.display())))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(err(format!("restricting {}", path.display())))?;
        let socket_inode = std::fs::metadata(&path).ok().map(|m| m.ino());
        let server = tokio::spawn(serve(listener, control.clone()));
        self.writes += 1;
        self.devices.insert(
            device.to_string(),
            Running {
                _handle: handle,
                control,
                server,
                socket_inode,
            },
        );
        Ok(true)
    }

    /// Stops `device`: its interface and its UAPI socket disappear.
    pub fn stop(&mut self, device: &str) {
        if let Some(running) = self.devices.remove(device) {
            remove_socket(device, running.socket_inode);
        }
    }

    async fn exchange(&self, device: &str, request: &str) -> Result<String, ApplyError> {
        let op = format!("talking to userspace WireGuard device {device}");
        let running = self.devices.get(device).ok_or_else(|| ApplyError::Io {
            op: op.clone(),
            source: std::io::Error::other("not running"),
        })?;
        exchange_on(&running.control, request)
            .await
            .map_err(err(op))
    }

    /// The device's configuration and peer statistics.
    pub async fn get(&self, device: &str) -> Result<WgDevice, ApplyError> {
        let answer = self.exchange(device, "get=1\n").await?;
        uapi::parse_get(&answer).map_err(|e| uapi_err(device, "reading", e))
    }

    /// Sends the `set=1` requests from `uapi::encode_set`, in order; stops at the first
    /// the device refuses.
    pub async fn set(&mut self, device: &str, requests: &[String]) -> Result<(), ApplyError> {
        for request in requests {
            self.writes += 1;
            let answer = self.exchange(device, request).await?;
            uapi::parse_get(&answer).map_err(|e| uapi_err(device, "configuring", e))?;
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
            remove_socket(name, running.socket_inode);
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

/// Runs `device` in this process until its interface is deleted, or SIGTERM or SIGINT
/// arrives: the userspace device process (`weft userspace-device <dev>`) the agent starts,
/// so the device outlives an agent restart as a kernel device does. Must run inside a
/// tokio runtime. Returns why it stopped.
pub async fn run_device(device: &str) -> Result<&'static str, ApplyError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(err("handling SIGTERM".into()))?;
    let mut int = signal(SignalKind::interrupt()).map_err(err("handling SIGINT".into()))?;
    let mut us = Userspace::default();
    us.ensure(device)?;
    let mut check = tokio::time::interval(INTERFACE_CHECK);
    let why = loop {
        tokio::select! {
            _ = term.recv() => break "SIGTERM",
            _ = int.recv() => break "SIGINT",
            _ = check.tick() => if !interface_exists(device) {
                break "its interface was deleted";
            },
        }
    };
    us.stop(device);
    Ok(why)
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
    ApplyError::Io {
        op: format!("{what} WireGuard device {device}"),
        source: e.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_ages_become_epoch_times() {
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let answer = "public_key=ab\nlast_handshake_time_sec=5\nlast_handshake_time_nsec=0\nrx_bytes=1\nerrno=0\n\n";
        assert_eq!(
            handshake_times_since_epoch(answer, now),
            "public_key=ab\nlast_handshake_time_sec=1799999995\nlast_handshake_time_nsec=0\nrx_bytes=1\nerrno=0\n\n"
        );
        let none = "public_key=ab\nrx_bytes=1\nerrno=0\n\n";
        assert_eq!(
            handshake_times_since_epoch(none, now),
            none,
            "no handshake yet: nothing invented"
        );
    }
}
