//! The UAPI socket `/var/run/wireguard/<dev>.sock`: framing of answers, and the client the
//! agent talks to its userspace device process with (the device serves the socket with
//! `crate::userspace::uapi`).

use std::path::PathBuf;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

pub const SOCKET_DIR: &str = "/var/run/wireguard";

pub fn socket_path(device: &str) -> PathBuf {
    PathBuf::from(SOCKET_DIR).join(format!("{device}.sock"))
}

/// Reads one UAPI answer: lines up to `errno=N`, plus the blank line that ends it.
pub async fn read_answer<R: AsyncRead + Unpin>(
    reader: &mut BufReader<R>,
) -> std::io::Result<String> {
    // One line buffer for the whole answer: a get at 10,000 peers is 80,000 lines.
    let (mut answer, mut line) = (String::new(), String::new());
    loop {
        line.clear();
        if reader.read_line(&mut line).await? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the device closed its control socket",
            ));
        }
        let done = line.starts_with("errno=");
        answer.push_str(&line);
        if done {
            line.clear();
            reader.read_line(&mut line).await?;
            answer.push('\n');
            return Ok(answer);
        }
    }
}

/// How long a device may take to answer one request (one with 5000 peers takes well
/// under a second).
pub const UAPI_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A connection to a device's UAPI socket.
pub struct UapiClient {
    stream: BufReader<UnixStream>,
}

impl UapiClient {
    pub async fn connect(device: &str) -> std::io::Result<Self> {
        let stream = UnixStream::connect(socket_path(device)).await?;
        Ok(UapiClient {
            stream: BufReader::new(stream),
        })
    }

    /// The pid of the process serving the socket.
    pub fn server_pid(&self) -> Option<i32> {
        self.stream.get_ref().peer_cred().ok()?.pid()
    }

    /// Sends one request (`get=1\n\n` or a `set=1` block ending in a blank line) and
    /// returns the answer; a device that does not answer within `UAPI_TIMEOUT` is an error
    /// (a wedged device must not wedge the agent or the operator's tools).
    pub async fn exchange(&mut self, request: &str) -> std::io::Result<String> {
        // Written as it is: a set at 10,000 peers is megabytes, not to be copied again.
        let text = if request.trim_end() == "get=1" {
            "get=1\n\n"
        } else {
            request
        };
        let exchange = async {
            self.stream.get_mut().write_all(text.as_bytes()).await?;
            read_answer(&mut self.stream).await
        };
        tokio::time::timeout(UAPI_TIMEOUT, exchange)
            .await
            .map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the device did not answer within {} s",
                        UAPI_TIMEOUT.as_secs()
                    ),
                )
            })?
    }
}
