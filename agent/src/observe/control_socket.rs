//! The agent's control socket: a Unix socket owned by root, mode 0600, in a 0700
//! directory, serving the agent's snapshot as JSON (`GET /status`) to `weft status` and
//! `weft doctor` on the same node, and whether pods can be added (`GET /cni/status`, see
//! `pods_ready`) to `weft-cni`'s STATUS. HTTP/1 over the socket, so `curl --unix-socket`
//! works too.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use tracing::{info, warn};

use crate::keys::rotation::RotateRequest;
use crate::observe::snapshot::{Shared, Snapshot};

/// What the control socket answers from.
#[derive(Clone)]
pub struct ControlState {
    pub snapshot: Shared,
    /// What the agent has in place, for `GET /cni/status`.
    pub health: crate::observe::http::Health,
    /// Where `POST /rotate` sends its request (the control loop).
    pub rotate: tokio::sync::mpsc::Sender<RotateRequest>,
}

pub const DEFAULT_SOCKET: &str = "/run/weft/weft.sock";
/// Overrides the socket path (tests, or a second agent on one host).
pub const SOCKET_ENV: &str = "WEFT_CONTROL_SOCKET";

pub fn socket_path() -> PathBuf {
    std::env::var_os(SOCKET_ENV).map_or_else(|| PathBuf::from(DEFAULT_SOCKET), PathBuf::from)
}

/// Binds the socket (replacing a stale one) and serves it on a task of its own.
pub async fn serve(path: &Path, state: ControlState) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing the stale {}", path.display())),
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("binding the control socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {} to root", path.display()))?;
    let app = Router::new()
        .route(
            "/status",
            get(|State(s): State<ControlState>| async move { Json(s.snapshot.get()) }),
        )
        .route(
            "/cni/status",
            get(|State(s): State<ControlState>| async move {
                Json(crate::observe::pods_ready::answer(&s.health, &s.snapshot))
            }),
        )
        .route("/rotate", axum::routing::post(rotate))
        .layer(axum::middleware::from_fn(no_body))
        .with_state(state);
    info!(socket = %path.display(), "serving the control socket");
    // The socket's owner is the agent's effective user.
    let uid = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .uid();
    let listener = RootOnly {
        inner: listener,
        uid,
    };
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            warn!(error = %e, "the control socket stopped");
        }
    });
    Ok(())
}

/// The control socket's listener: a connection whose peer (`SO_PEERCRED`) is neither root
/// nor the agent's own user is closed unanswered and logged, whatever the socket file's
/// mode says (a copied socket, a changed mode, a bind-mount into a container).
struct RootOnly {
    inner: tokio::net::UnixListener,
    uid: u32,
}

impl RootOnly {
    fn allowed(&self, stream: &tokio::net::UnixStream) -> Result<(), String> {
        match stream.peer_cred() {
            Ok(cred) if cred.uid() == 0 || cred.uid() == self.uid => Ok(()),
            Ok(cred) => Err(format!(
                "uid {} (pid {:?}) is not root",
                cred.uid(),
                cred.pid()
            )),
            Err(e) => Err(format!("its credentials cannot be read: {e}")),
        }
    }
}

impl axum::serve::Listener for RootOnly {
    type Io = tokio::net::UnixStream;
    type Addr = tokio::net::unix::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, addr) = axum::serve::Listener::accept(&mut self.inner).await;
            match self.allowed(&stream) {
                Ok(()) => return (stream, addr),
                Err(why) => warn!(peer = %why, "refused a control socket connection"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// No request on the control socket has a body: one that announces a body (any
/// `Content-Length` but 0, or `Transfer-Encoding`) is refused with 413 before it is read.
async fn no_body(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
    use axum::response::IntoResponse;
    let headers = request.headers();
    let length = headers.get(CONTENT_LENGTH).map(|v| v.as_bytes());
    if headers.contains_key(TRANSFER_ENCODING) || length.is_some_and(|l| l != b"0") {
        return (
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            "the control socket's requests have no body\n",
        )
            .into_response();
    }
    next.run(request).await
}

/// Starts a key rotation; answers the announcement (or 409 with why not).
async fn rotate(State(s): State<ControlState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    info!("key rotation requested on the control socket");
    let (reply, answer) = tokio::sync::oneshot::channel();
    let request = RotateRequest {
        reply: Some(reply),
        request: None,
    };
    if s.rotate.send(request).await.is_err() {
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "the agent is stopping\n",
        )
            .into_response();
    }
    match answer.await {
        Ok(Ok(next)) => Json(next).into_response(),
        Ok(Err(why)) => (axum::http::StatusCode::CONFLICT, format!("{why}\n")).into_response(),
        Err(_) => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "the agent is not running its loop yet\n",
        )
            .into_response(),
    }
}

/// One HTTP/1.0 request on the control socket at `path`: the body of a 200 answer.
pub fn request(path: &Path, method: &str, target: &str) -> anyhow::Result<String> {
    let mut stream = std::os::unix::net::UnixStream::connect(path).with_context(|| {
        format!(
            "no agent answers on {}: is `weft agent` running on this node (and are you root)?",
            path.display()
        )
    })?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
    write!(
        stream,
        "{method} {target} HTTP/1.0\r\nHost: weft\r\nContent-Length: 0\r\n\r\n"
    )
    .with_context(|| format!("sending to {}", path.display()))?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .with_context(|| format!("reading from {}", path.display()))?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("the agent's answer is not HTTP")?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        bail!(
            "the agent answered {}: {}",
            head.lines().next().unwrap_or_default(),
            body.trim()
        );
    }
    Ok(body.to_string())
}

/// The snapshot of the agent answering on `path`.
pub fn fetch(path: &Path) -> anyhow::Result<Snapshot> {
    let body = request(path, "GET", "/status")?;
    serde_json::from_str(&body).context("the agent's status is not the JSON this weft reads")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn weft_cnis_status_gets_the_agents_readiness_in_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/weft.sock");
        let (rotate, _requests) = tokio::sync::mpsc::channel(1);
        let health = crate::observe::http::Health::new(std::time::Duration::from_secs(30));
        let snapshot = Shared::default();
        snapshot.update(|s| s.device = Some("lo".into()));
        let state = ControlState {
            snapshot,
            health: health.clone(),
            rotate,
        };
        serve(&path, state).await.unwrap();
        let ask = |p: PathBuf| tokio::task::spawn_blocking(move || crate::cni::status::status(&p));
        let e = ask(path.clone()).await.unwrap().unwrap_err();
        assert_eq!(e.code, 50);
        assert!(
            e.msg
                .contains("waiting for: lease, data plane, subnet file"),
            "{}",
            e.msg
        );
        use crate::observe::http::Readiness::*;
        for r in [LeaseAcquired, DataplaneProgrammed, SubnetFileWritten] {
            health.set(r);
        }
        ask(path.clone()).await.unwrap().unwrap();
        health.unset(DataplaneProgrammed);
        let e = ask(path).await.unwrap().unwrap_err();
        assert!(e.msg.ends_with("waiting for: data plane"), "{}", e.msg);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_is_not_root_gets_no_answer_even_with_the_socket_open_to_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/weft.sock");
        let (rotate, _requests) = tokio::sync::mpsc::channel(1);
        let state = ControlState {
            snapshot: Shared::default(),
            health: crate::observe::http::Health::new(std::time::Duration::from_secs(30)),
            rotate,
        };
        serve(&path, state).await.unwrap();
        // Someone opened the socket to everyone: only its credentials stop a user now.
        for (p, mode) in [
            (dir.path(), 0o755),
            (path.parent().unwrap(), 0o755),
            (path.as_path(), 0o666),
        ] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        let as_root = path.clone();
        let answer = tokio::task::spawn_blocking(move || request(&as_root, "GET", "/status"))
            .await
            .unwrap();
        assert!(answer.is_ok(), "{answer:?}");

        let refused = std::thread::spawn(move || {
            // SAFETY: the raw syscall changes the credentials of this thread only (the libc
            // wrapper would change every thread's); the thread ends after the request.
            let rc = unsafe { libc::syscall(libc::SYS_setresuid, 65534, 65534, 65534) };
            assert_eq!(rc, 0, "dropping to uid 65534");
            request(&path, "GET", "/status")
        })
        .join()
        .unwrap();
        // It connected (the socket is open to all), and the agent closed the connection
        // unanswered: before the request was sent, or before an answer.
        let err = format!("{:#}", refused.unwrap_err());
        assert!(
            ["not HTTP", "reading from", "sending to"]
                .iter()
                .any(|m| err.contains(m)),
            "{err}"
        );
    }
}
