//! `/healthz`, `/readyz` and `/metrics` (see `metrics`) on `--healthz-ip`:`--healthz-port`;
//! with `--metrics-port`, `/metrics` on `--metrics-ip`:`--metrics-port` instead, so the
//! health port can stay on loopback.
//!
//! - `/healthz` (liveness): the agent's main task is making progress. Every control-loop
//!   pass and every idle tick (at least every 2 s) beats, and so does every start-up
//!   retry; no beat for `max(2 × resync period, 60 s)` means the loop is wedged (a hung
//!   netlink call, a deadlock) and the kubelet should restart the container.
//! - `/readyz` (readiness): the lease is acquired, the data plane has been programmed,
//!   subnet.env is written, and the registry answers. The body names what is missing;
//!   while the registry is away it says why (the data plane stays as it was).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use tracing::info;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    LeaseAcquired,
    DataplaneProgrammed,
    SubnetFileWritten,
}

#[derive(Clone)]
pub struct Health(Arc<Inner>);

/// Why the registry cannot be followed now (`None`: it answers). The registry sets it,
/// `/readyz` says it.
#[derive(Debug, Clone, Default)]
pub struct RegistryStatus(Arc<std::sync::Mutex<Option<String>>>);

impl RegistryStatus {
    pub fn lost(&self, why: impl std::fmt::Display) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.to_string());
    }

    pub fn back(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    /// Whether the registry is away now (no copy of the reason).
    pub fn is_lost(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    pub fn why(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

struct Inner {
    started: Instant,
    /// Milliseconds after `started` of the last beat.
    last_beat: AtomicU64,
    wedged_after: Duration,
    lease: AtomicBool,
    dataplane: AtomicBool,
    subnet_file: AtomicBool,
    registry: RegistryStatus,
}

impl Health {
    pub fn new(resync_period: Duration) -> Self {
        Health(Arc::new(Inner {
            started: Instant::now(),
            last_beat: AtomicU64::new(0),
            wedged_after: (resync_period * 2).max(Duration::from_secs(60)),
            lease: AtomicBool::new(false),
            dataplane: AtomicBool::new(false),
            subnet_file: AtomicBool::new(false),
            registry: RegistryStatus::default(),
        }))
    }

    /// The registry's status, which readiness includes.
    pub fn registry(&self) -> RegistryStatus {
        self.0.registry.clone()
    }

    pub fn beat(&self) {
        let ms = self.0.started.elapsed().as_millis() as u64;
        self.0.last_beat.store(ms, Ordering::Relaxed);
    }

    fn flag(&self, what: Readiness) -> &AtomicBool {
        match what {
            Readiness::LeaseAcquired => &self.0.lease,
            Readiness::DataplaneProgrammed => &self.0.dataplane,
            Readiness::SubnetFileWritten => &self.0.subnet_file,
        }
    }

    pub fn set(&self, what: Readiness) {
        self.flag(what).store(true, Ordering::Relaxed);
    }

    pub fn unset(&self, what: Readiness) {
        self.flag(what).store(false, Ordering::Relaxed);
    }

    /// `Ok` while the loop beats; `Err` says for how long it has not.
    pub fn liveness_at(&self, now: Instant) -> Result<String, Unhealthy> {
        let last = self.0.started + Duration::from_millis(self.0.last_beat.load(Ordering::Relaxed));
        let silent = now.saturating_duration_since(last);
        if silent > self.0.wedged_after {
            Err(Unhealthy::Wedged {
                silent,
                limit: self.0.wedged_after,
            })
        } else {
            Ok(format!("ok: last progress {} ms ago", silent.as_millis()))
        }
    }

    /// What this node's pods need and it does not have yet: the lease, the data plane,
    /// the subnet file (the registry is not among them: pods are added while it is away).
    pub fn missing_for_pods(&self) -> Vec<String> {
        [
            (Readiness::LeaseAcquired, "lease"),
            (Readiness::DataplaneProgrammed, "data plane"),
            (Readiness::SubnetFileWritten, "subnet file"),
        ]
        .into_iter()
        .filter(|(what, _)| !self.flag(*what).load(Ordering::Relaxed))
        .map(|(_, name)| name.to_string())
        .collect()
    }

    /// `Ok` once everything is in place; `Err` names what is missing.
    pub fn readiness(&self) -> Result<String, Unhealthy> {
        let mut missing = self.missing_for_pods();
        if let Some(why) = self.0.registry.why() {
            missing.push(format!("the registry ({why})"));
        }
        if missing.is_empty() {
            Ok("ready".into())
        } else {
            Err(Unhealthy::NotReady { missing })
        }
    }
}

/// Why `/healthz` or `/readyz` fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unhealthy {
    #[error(
        "wedged: the control loop has made no progress for {} s (limit {} s)",
        silent.as_secs(),
        limit.as_secs()
    )]
    Wedged { silent: Duration, limit: Duration },
    #[error("not ready; waiting for: {}", missing.join(", "))]
    NotReady { missing: Vec<String> },
}

fn answer(result: Result<String, Unhealthy>) -> (StatusCode, String) {
    match result {
        Ok(text) => (StatusCode::OK, text + "\n"),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

/// What the endpoints answer from.
#[derive(Clone)]
pub struct Endpoints {
    pub health: Health,
    pub metrics: crate::observe::metrics::Metrics,
    pub snapshot: crate::observe::snapshot::Shared,
}

/// Which endpoints a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routes {
    /// `/healthz`, `/readyz` and `/metrics` (no `--metrics-port`).
    All,
    /// `/healthz` and `/readyz`.
    Health,
    /// `/metrics`.
    Metrics,
}

fn router(routes: Routes, endpoints: Endpoints) -> Router {
    let mut app = Router::new();
    if routes != Routes::Metrics {
        app = app
            .route(
                "/healthz",
                get(|State(e): State<Endpoints>| async move {
                    answer(e.health.liveness_at(Instant::now()))
                }),
            )
            .route(
                "/readyz",
                get(|State(e): State<Endpoints>| async move { answer(e.health.readiness()) }),
            );
    }
    if routes != Routes::Health {
        app = app.route(
            "/metrics",
            get(|State(e): State<Endpoints>| async move {
                let body = e.metrics.render(&e.snapshot.get()).await;
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    body,
                )
            }),
        );
    }
    app.with_state(endpoints)
}

/// Binds `addr` (failing start-up with a clear error naming `flags` if it cannot) and
/// serves `routes` on a task of their own, with the server's limits (`server::Limits`).
pub async fn serve(
    addr: SocketAddr,
    routes: Routes,
    flags: &str,
    endpoints: Endpoints,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("listening on {addr} ({flags})"))?;
    info!(%addr, ?routes, "serving HTTP endpoints");
    let app = router(routes, endpoints);
    tokio::spawn(super::server::run(listener, app, Default::default()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_fails_once_the_loop_stops_beating() {
        let h = Health::new(Duration::from_secs(30));
        h.beat();
        let now = Instant::now();
        assert!(h.liveness_at(now).is_ok());
        assert!(h.liveness_at(now + Duration::from_secs(59)).is_ok());
        let e = h.liveness_at(now + Duration::from_secs(61)).unwrap_err();
        assert!(e.to_string().contains("no progress for 6"), "{e}");
        // A longer resync period allows longer gaps.
        let slow = Health::new(Duration::from_secs(300));
        slow.beat();
        assert!(slow
            .liveness_at(Instant::now() + Duration::from_secs(500))
            .is_ok());
    }

    #[test]
    fn readiness_names_what_is_missing() {
        let h = Health::new(Duration::from_secs(30));
        assert_eq!(
            h.readiness().unwrap_err().to_string(),
            "not ready; waiting for: lease, data plane, subnet file"
        );
        h.set(Readiness::LeaseAcquired);
        h.set(Readiness::SubnetFileWritten);
        assert_eq!(
            h.readiness().unwrap_err().to_string(),
            "not ready; waiting for: data plane"
        );
        h.set(Readiness::DataplaneProgrammed);
        assert_eq!(h.readiness().unwrap(), "ready");
        h.unset(Readiness::DataplaneProgrammed);
        assert!(h.readiness().is_err());
        h.set(Readiness::DataplaneProgrammed);
        h.registry()
            .lost("etcd at http://x:2379: connection refused");
        assert_eq!(
            h.readiness().unwrap_err().to_string(),
            "not ready; waiting for: the registry (etcd at http://x:2379: connection refused)"
        );
        h.registry().back();
        assert_eq!(h.readiness().unwrap(), "ready");
    }
}
