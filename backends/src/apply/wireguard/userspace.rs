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
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use boringtun::device::{DeviceConfig, DeviceHandle};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use super::uapi::{self, UapiError};
use super::WgDevice;
use crate::apply::ApplyError;

pub const SOCKET_DIR: &str = "/var/run/wireguard";

pub fn socket_path(device: &str) -> PathBuf {
    PathBuf::from(SOCKET_DIR).join(format!("{device}.sock"))
}

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
    move |source| ApplyError::Netlink { op, source }
}

/// Reads one UAPI answer: lines up to `errno=N`, plus the blank line that ends it.
async fn read_answer<R: AsyncRead + Unpin>(reader: &mut BufReader<R>) -> std::io::Result<String> {
    let mut answer = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the device closed its control socket",
            ));
        }
        let done = line.starts_with("errno=");
        answer.push_str(&line);
        if done {
            let mut blank = String::new();
            reader.read_line(&mut blank).await?;
            answer.push('\n');
            return Ok(answer);
        }
    }
}

/// Reads one UAPI request from a client: `get=1` (one line) or `set=1` up to its blank line.
async fn read_request<R: AsyncRead + Unpin>(
    reader: &mut BufReader<R>,
) -> std::io::Result<Option<String>> {
    let mut first = String::new();
    if reader.read_line(&mut first).await? == 0 {
        return Ok(None);
    }
    let mut request = first.clone();
    if first.trim_end() == "set=1" {
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await? == 0 || line.trim_end().is_empty() {
                break;
            }
            request.push_str(&line);
        }
        request.push('\n');
    } else {
        // `get=1` is followed by a blank line from `wg`; boringtun must not see it.
        let mut blank = String::new();
        reader.read_line(&mut blank).await?;
    }
    Ok(Some(request))
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
            use_connected_socket: true,
            use_multi_queue: false,
            uapi_fd: theirs.into_raw_fd(),
        };
        let name = device.to_string();
        let handle = std::thread::Builder::new()
            .name(format!("wg-start-{device}"))
            .spawn(move || DeviceHandle::new(&name, config).map_err(|e| e.to_string()))
            .map_err(err(op.clone()))?
            .join()
            .map_err(|_| ApplyError::Netlink {
                op: op.clone(),
                source: std::io::Error::other("the starting thread panicked"),
            })?
            .map_err(|e| ApplyError::Netlink {
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
        let server = tokio::spawn(serve(listener, control.clone()));
        self.writes += 1;
        self.devices.insert(
            device.to_string(),
            Running {
                _handle: handle,
                control,
                server,
            },
        );
        Ok(true)
    }

    /// Stops `device`: its interface and its UAPI socket disappear.
    pub fn stop(&mut self, device: &str) {
        if self.devices.remove(device).is_some() {
            let _ = std::fs::remove_file(socket_path(device));
        }
    }

    async fn exchange(&self, device: &str, request: &str) -> Result<String, ApplyError> {
        let op = format!("talking to userspace WireGuard device {device}");
        let running = self
            .devices
            .get(device)
            .ok_or_else(|| ApplyError::Netlink {
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
        for name in self.devices.keys() {
            let _ = std::fs::remove_file(socket_path(name));
        }
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
