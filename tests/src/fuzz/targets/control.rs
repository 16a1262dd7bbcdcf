//! The control socket as a local client could drive it: any bytes as a request, on the
//! agent's own server (`weft::observe::control_socket::serve`, `SO_PEERCRED` check and
//! all) run in a thread of its own. The answer's status line is the verdict; a server that
//! stops accepting is a finding.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use weft::observe::control_socket::{serve, ControlState};

use super::{big, Target};
use crate::fuzz::Verdict;

fn start_server(path: PathBuf) {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("the control socket's runtime: {e}"));
        runtime.block_on(async move {
            let (rotate, mut requests) = tokio::sync::mpsc::channel(4);
            // No control loop: each rotation request is dropped (answered 503).
            tokio::spawn(async move { while requests.recv().await.is_some() {} });
            let state = ControlState {
                snapshot: Default::default(),
                health: weft::observe::http::Health::new(std::time::Duration::from_secs(30)),
                rotate,
            };
            let served = serve(&path, state).await.map_err(|e| format!("{e:#}"));
            let _ = ready_tx.send(served);
            std::future::pending::<()>().await
        });
    });
    match ready_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("serving the fuzzed control socket: {e}"),
        Err(_) => panic!("the control socket's thread ended"),
    }
}

/// Sends `input`, closes the writing half, reads the answer (at most 64 KiB).
fn exchange(path: &PathBuf, input: &[u8]) -> Verdict {
    let mut stream = UnixStream::connect(path)
        .unwrap_or_else(|e| panic!("the control socket stopped accepting: {e}"));
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    // The server may answer and close before reading everything: not an error here.
    let _ = stream.write_all(input);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut answer = Vec::new();
    let _ = stream.take(64 << 10).read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    let status = text.lines().next().unwrap_or_default();
    match status.split_whitespace().nth(1) {
        Some(code) if code.starts_with('2') => Verdict::Accepted,
        Some(_) => Verdict::Refused(status.chars().take(200).collect()),
        None => Verdict::Refused("the control socket closed the connection unanswered".into()),
    }
}

pub fn target() -> Target {
    let dir = super::files::scratch("weft-fuzz-control-");
    let path = dir.path().join("weft.sock");
    start_server(path.clone());
    Target {
        name: "control-socket",
        words: &["HTTP/1.", "closed the connection"],
        tokens: &[
            "GET",
            "POST",
            "/status",
            "/rotate",
            " HTTP/1.1\r\n",
            " HTTP/1.0\r\n",
            "\r\n\r\n",
            "Content-Length: ",
            "Transfer-Encoding: chunked\r\n",
            "Host: x\r\n",
            "Connection: keep-alive\r\n",
            "Expect: 100-continue\r\n",
            "0\r\n\r\n",
        ],
        seeds: || {
            vec![
                b"GET /status HTTP/1.1\r\nHost: weft\r\n\r\n".to_vec(),
                b"GET /status HTTP/1.0\r\n\r\n".to_vec(),
                b"POST /rotate HTTP/1.1\r\nHost: weft\r\nContent-Length: 0\r\n\r\n".to_vec(),
                b"GET /status HTTP/1.1\r\nHost: weft\r\n\r\nGET /status HTTP/1.1\r\nHost: weft\r\n\r\n".to_vec(),
            ]
        },
        oversized: || {
            big(
                "GET /status HTTP/1.1\r\nHost: weft\r\nContent-Length: 1048576\r\n\r\n",
                b'a',
                "",
            )
        },
        parse: Box::new(move |input| {
            let _keep = &dir;
            exchange(&path, input)
        }),
    }
}
