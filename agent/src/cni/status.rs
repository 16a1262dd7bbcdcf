//! STATUS (CNI 1.1): whether this node can take pods now, as its agent says on its
//! control socket (`GET /cni/status`). The agent answers from what it knows (lease,
//! subnet file, the last pass's data plane with its fail-closed rules) and a live look
//! at its tunnel device. An agent that is not there, or does not answer within
//! `ANSWER_WITHIN`, is "not available" (code 50), never a wait.

use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use socket2::{Domain, SockAddr, Socket, Type};

use super::CniError;

/// Where the agent's control socket is unless the config's `agentSocket` says.
pub const DEFAULT_AGENT_SOCKET: &str = "/run/weft/weft.sock";
/// How long STATUS waits for the agent, connecting included.
pub const ANSWER_WITHIN: Duration = Duration::from_millis(50);
/// The longest answer read.
const MAX_ANSWER: u64 = 64 << 10;

/// `Ok` when the agent says the node is ready for pods; else code 50 with why.
pub fn status(socket: &Path) -> Result<(), CniError> {
    let answer = ask(socket, ANSWER_WITHIN).map_err(|why| {
        CniError::not_available(format!(
            "the weft agent did not answer on {} within {} ms: {why}",
            socket.display(),
            ANSWER_WITHIN.as_millis()
        ))
    })?;
    readiness(&answer)
}

/// The agent's answer (the body of `GET /cni/status`) as STATUS's outcome.
fn readiness(body: &Value) -> Result<(), CniError> {
    if body.get("ready").and_then(Value::as_bool) == Some(true) {
        return Ok(());
    }
    let missing: Vec<&str> = body
        .get("missing")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    Err(CniError::not_available(if missing.is_empty() {
        format!(
            "the weft agent says this node is not ready for pods: {}",
            weft_backends::model::clip(&body.to_string())
        )
    } else {
        format!(
            "the weft agent is not ready for pods; waiting for: {}",
            missing.join(", ")
        )
    }))
}

/// One `GET /cni/status` on the control socket, all of it within `within`.
fn ask(socket: &Path, within: Duration) -> Result<Value, String> {
    let deadline = Instant::now() + within;
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| "timed out".to_string())
    };
    let addr = SockAddr::unix(socket).map_err(|e| e.to_string())?;
    let sock = Socket::new(Domain::UNIX, Type::STREAM, None).map_err(|e| e.to_string())?;
    // Non-blocking: a full backlog (an agent that stopped accepting) is an error at once.
    sock.connect_timeout(&addr, left()?)
        .map_err(|e| format!("connecting: {e}"))?;
    sock.set_write_timeout(Some(left()?))
        .map_err(|e| e.to_string())?;
    let mut stream: std::os::unix::net::UnixStream = sock.into();
    stream
        .write_all(b"GET /cni/status HTTP/1.1\r\nHost: weft\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("asking: {e}"))?;
    let mut raw = Vec::new();
    loop {
        stream
            .set_read_timeout(Some(left()?))
            .map_err(|e| e.to_string())?;
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err("timed out".into())
            }
            Err(e) => return Err(format!("reading the answer: {e}")),
        }
        if raw.len() as u64 > MAX_ANSWER {
            return Err(format!("the answer is longer than {MAX_ANSWER} bytes"));
        }
    }
    body(&raw)
}

/// The JSON body of an HTTP/1 answer (200 or 503 both carry one).
fn body(raw: &[u8]) -> Result<Value, String> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| "an answer without a body".to_string())?;
    let status = head.lines().next().unwrap_or_default();
    serde_json::from_str(body.trim()).map_err(|_| {
        format!(
            "not a readiness answer: {}",
            weft_backends::model::clip(status)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_agents_answer_decides_and_names_what_is_missing() {
        assert!(readiness(&json!({"ready": true})).is_ok());
        let e = readiness(
            &json!({"ready": false, "missing": ["subnet file", "device flannel-wg (gone)"]}),
        )
        .unwrap_err();
        assert_eq!(e.code, 50);
        assert!(
            e.msg.contains("subnet file, device flannel-wg (gone)"),
            "{}",
            e.msg
        );
        assert_eq!(readiness(&json!({"nonsense": 1})).unwrap_err().code, 50);
    }

    #[test]
    fn no_agent_or_a_silent_one_is_not_available_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weft.sock");
        let e = status(&path).unwrap_err();
        assert_eq!(e.code, 50);
        assert!(e.msg.contains("connecting"), "{}", e.msg);
        // Listening, never answering: bounded by ANSWER_WITHIN.
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let started = Instant::now();
        let e = status(&path).unwrap_err();
        assert!(e.msg.contains("timed out"), "{}", e.msg);
        assert!(
            started.elapsed() < ANSWER_WITHIN * 3,
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn an_http_answer_gives_its_body() {
        let raw = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\r\n{\"ready\":false,\"missing\":[\"lease\"]}";
        assert_eq!(
            body(raw).unwrap(),
            json!({"ready": false, "missing": ["lease"]})
        );
        assert!(body(b"HTTP/1.1 404 Not Found\r\n\r\n")
            .unwrap_err()
            .contains("404"));
    }
}
