//! The HTTP/1 server under the agent's health and metrics endpoints, hardened for a port
//! on the host network, where anything that reaches the node can connect: a request's
//! headers must arrive within `header_timeout`, a connection lives at most
//! `connection_timeout`, and at most `max_connections` are open at once (one more is
//! closed as soon as it is accepted). axum's own `serve` has none of these, and half-sent
//! requests held it open without bound.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::warn;

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub connection_timeout: Duration,
}

impl Default for Limits {
    /// Probes and a Prometheus scrape need a handful of connections and milliseconds.
    fn default() -> Self {
        Limits {
            max_connections: 32,
            header_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(30),
        }
    }
}

/// Serves `app` on `listener` until the task is dropped.
pub async fn run(listener: TcpListener, app: Router, limits: Limits) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors and the like: wait rather than spin.
                warn!(error = %e, "accepting a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(limits.connection_timeout, connection).await;
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn get_ok(addr: std::net::SocketAddr) -> bool {
        let Ok(mut s) = TcpStream::connect(addr).await else {
            return false;
        };
        let _ = s
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await;
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer).await;
        answer.starts_with("HTTP/1.1 200")
    }

    /// Whether the server closed `s` (a read returns end of file or an error).
    async fn closed(s: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 64];
        matches!(
            tokio::time::timeout(within, s.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    #[tokio::test]
    async fn half_sent_requests_are_cut_off_and_cannot_exhaust_the_server() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            max_connections: 4,
            header_timeout: Duration::from_millis(300),
            connection_timeout: Duration::from_secs(5),
        };
        let app = Router::new().route("/healthz", get(|| async { "ok\n" }));
        tokio::spawn(run(listener, app, limits));
        assert!(get_ok(addr).await);

        // Four clients that never finish their headers hold every slot...
        let mut slow = Vec::new();
        for _ in 0..4 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                .await
                .unwrap();
            slow.push(s);
        }
        // ...so a fifth is closed at once rather than queued.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut fifth = TcpStream::connect(addr).await.unwrap();
        assert!(closed(&mut fifth, Duration::from_millis(200)).await);
        // The header deadline frees them, and the server answers again.
        for s in &mut slow {
            assert!(
                closed(s, Duration::from_secs(2)).await,
                "a slow client was kept"
            );
        }
        assert!(get_ok(addr).await);
    }
}
