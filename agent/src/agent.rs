//! `weft agent`: registry → plan, level-triggered. Whatever wakes the loop (a new view, a
//! change to our own lease, the resync timer) re-plans the whole node from the latest
//! state. This agent plans and writes subnet.env; the reconcilers that program the
//! kernel from the plan plug in at `apply` (the data-plane issue).

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use anyhow::{bail, Context};
use tokio::sync::watch;
use tracing::{error, info, warn, Instrument};
use weft_backends::apply::wireguard::process::UserspaceProcess;
use weft_backends::apply::{monitor, Dataplane, DataplaneReport};
use weft_backends::model::{ClusterView, DesiredState, Lease};
use weft_backends::netconf::NetConf;
use weft_backends::plan::{plan, PlanInput, PlanOptions};
use weft_crypto::{load_or_create, PrivateKey, DEFAULT_KEY_FILE, KEY_FILE_ENV};

use crate::backend_setup;
use crate::backoff::{sleep_or_shutdown, Backoff};
use crate::cli::AgentArgs;
use crate::health::{Health, Readiness};
use crate::registry::kube::{self, KubeConfig, KubeRegistry};
use crate::registry::{self, AcquireRequest, EtcdConfig, EtcdRegistry, LocalAttrs, Registry};
use crate::subnet_file;

/// Retries `$op` (an expression yielding a future of a `Result`) with backoff until it
/// succeeds; logs each failure. Each attempt counts as a heartbeat: retrying is alive. Evaluates to `None` if shutdown came first.
macro_rules! retry {
    ($what:literal, $shutdown:expr, $health:expr, $op:expr) => {{
        let mut backoff = Backoff::default();
        loop {
            $health.beat();
            match $op.await {
                Ok(v) => break Some(v),
                Err(e) => {
                    let delay = backoff.next_delay();
                    warn!(error = %e, retry_in = ?delay, concat!($what, " failed; retrying"));
                    if sleep_or_shutdown(delay, $shutdown).await {
                        break None;
                    }
                }
            }
        }
    }};
}

pub fn run(args: AgentArgs) -> anyhow::Result<i32> {
    init_tracing();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run_async(args))
}

pub(crate) fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only on a terminal: journald, kubectl logs and files get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn shutdown_on_signals() -> anyhow::Result<watch::Receiver<bool>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: stopping"),
            _ = int.recv() => info!("SIGINT: stopping"),
        }
        tx.send_replace(true);
    });
    Ok(rx)
}

async fn run_async(args: AgentArgs) -> anyhow::Result<i32> {
    let key_path = std::env::var_os(KEY_FILE_ENV)
        .map_or_else(|| PathBuf::from(DEFAULT_KEY_FILE), PathBuf::from);
    let (key, origin) = load_or_create(&key_path).context("loading the node's WireGuard key")?;
    info!(path = %key_path.display(), public_key = %key.public_key(), origin = ?origin, "WireGuard key");
    let public_ip = crate::iface::public_ip(&args)?;
    let mut shutdown = shutdown_on_signals()?;
    let health = Health::new(args.resync_period);
    if args.healthz_port != 0 {
        crate::health::serve(
            std::net::SocketAddr::new(args.healthz_ip, args.healthz_port),
            health.clone(),
        )
        .await?;
    }
    let start = Start {
        key,
        key_path,
        public_ip,
        health,
    };
    if args.kube_subnet_mgr {
        let client = kube::client(&args.kubeconfig_file, &args.kube_api_url)
            .await
            .context("--kube-subnet-mgr")?;
        let explicit = match args.node_name.as_str() {
            "" => std::env::var("NODE_NAME").unwrap_or_default(),
            name => name.to_string(),
        };
        let pod = std::env::var("POD_NAME")
            .ok()
            .zip(std::env::var("POD_NAMESPACE").ok())
            .map(|(name, ns)| (ns, name));
        if explicit.is_empty() && pod.is_none() {
            bail!(kube::KubeError::NoNodeName);
        }
        let Some(node_name) = retry!(
            "finding this node's name",
            &mut shutdown,
            start.health,
            kube::node_name(&client, &explicit, pod.clone())
        ) else {
            return Ok(0);
        };
        info!(node = %node_name, prefix = %args.kube_annotation_prefix, %public_ip, "starting with the Kubernetes registry");
        let cfg = KubeConfig {
            node_name,
            prefix: args
                .kube_annotation_prefix
                .trim_end_matches('/')
                .to_string(),
            net_config_path: args.net_config_path.clone(),
            set_network_unavailable: args.set_node_network_unavailable,
            backoff: Backoff::default(),
        };
        serve(&args, KubeRegistry::new(client, cfg), start, shutdown).await
    } else {
        let mut cfg = EtcdConfig::new(args.etcd_endpoints.clone(), args.etcd_prefix.clone());
        cfg.renew_margin = args.subnet_lease_renew_margin;
        if !args.etcd_username.is_empty() {
            cfg.auth = Some((args.etcd_username.clone(), args.etcd_password.clone()));
        }
        info!(endpoints = %cfg.endpoints.join(","), prefix = %cfg.prefix, %public_ip, "starting with the etcd registry");
        let Some(registry) = retry!(
            "connecting to etcd",
            &mut shutdown,
            start.health,
            EtcdRegistry::connect(cfg.clone())
        ) else {
            return Ok(0);
        };
        serve(&args, registry, start, shutdown).await
    }
}

/// What the agent has before it knows its registry.
struct Start {
    key: PrivateKey,
    key_path: PathBuf,
    public_ip: std::net::Ipv4Addr,
    health: Health,
}

/// Config, lease, data plane, then the control loop until shutdown; the same for every
/// registry.
async fn serve<R: Registry>(
    args: &AgentArgs,
    mut registry: R,
    start: Start,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<i32> {
    let Start {
        key,
        key_path,
        public_ip,
        health,
    } = start;
    let Some(net) = retry!(
        "reading the network config",
        &mut shutdown,
        health,
        registry.net_conf()
    ) else {
        return Ok(0);
    };
    let state_dir = key_path
        .parent()
        .map_or_else(|| PathBuf::from("/var/lib/weft"), PathBuf::from);
    let setup = backend_setup::prepare(
        &net,
        &key.public_key(),
        args.wireguard_implementation.as_deref(),
        &state_dir,
    )
    .await?;
    let attrs = LocalAttrs {
        public_ip: Some(public_ip),
        public_ipv6: None,
        backend: net.backend.kind(),
        backend_data: setup.backend_data.clone(),
        backend_v6_data: None,
    };
    let (previous, previous_v6) = subnet_file::previous_subnets(&args.subnet_file);
    let request = AcquireRequest {
        attrs,
        previous,
        previous_v6,
    };
    let Some(lease) = retry!(
        "acquiring a lease",
        &mut shutdown,
        health,
        registry.acquire(&net, &request)
    ) else {
        return Ok(0);
    };
    health.set(Readiness::LeaseAcquired);
    // The registry may publish another local address (an operator's node-public-ip).
    let public_ip = lease.public_ip.unwrap_or(public_ip);
    let (mut dataplane, why) =
        Dataplane::connect(setup.implementation, UserspaceProcess::default())
            .await
            .context("choosing the WireGuard implementation")?;
    info!(
        implementation = dataplane.implementation(),
        why, "WireGuard"
    );
    let deletions =
        monitor::deletions().context("watching the kernel for deleted links and routes")?;
    let handle = registry::spawn(registry, lease);
    let underlay = dataplane
        .underlay_of(IpAddr::V4(public_ip))
        .await
        .context("finding the external interface")?;
    match &underlay {
        Some(u) => {
            info!(device = %u.device, mtu = u.mtu, networks = ?u.networks, "external interface")
        }
        None => {
            warn!(%public_ip, "no interface holds the public IP: host-gw and DirectRouting cannot tell on-link peers, and the underlay MTU is taken as 1500")
        }
    }
    let underlay_mtu = setup
        .config_mtu
        .or(underlay.as_ref().map(|u| u.mtu))
        .unwrap_or(1500);
    let options = PlanOptions {
        ip_masq: args.ip_masq,
        underlay_mtu,
        underlay_device: underlay.as_ref().map(|u| u.device.clone()),
        underlay_networks: underlay.map(|u| u.networks).unwrap_or_default(),
    };
    let inputs = LoopInputs {
        views: handle.views.clone(),
        local: handle.local.clone(),
        deletions,
        shutdown,
        ready: handle.ready.clone(),
        health,
    };
    control_loop(args, &net, &options, &key, &mut dataplane, inputs).await;
    handle.stop().await;
    info!("stopped; the lease and the data plane are left in place for the next start");
    Ok(0)
}

/// Everything that can wake the control loop.
struct LoopInputs {
    views: watch::Receiver<Arc<ClusterView>>,
    local: watch::Receiver<Lease>,
    deletions: tokio::sync::mpsc::Receiver<()>,
    shutdown: watch::Receiver<bool>,
    /// Told once the data plane is first programmed (the registry may announce it).
    ready: watch::Sender<bool>,
    health: Health,
}

/// How often the nftables tables are checked: deleting one raises no netlink event.
const NFT_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

fn log_report(report: &DataplaneReport) {
    for change in &report.changes {
        info!(change = %change, "data plane");
    }
    for error in &report.errors {
        warn!(error = %error, "data plane");
    }
}

async fn control_loop(
    args: &AgentArgs,
    net: &NetConf,
    options: &PlanOptions,
    key: &PrivateKey,
    dataplane: &mut Dataplane,
    mut inputs: LoopInputs,
) {
    let mut resync = tokio::time::interval(args.resync_period);
    let mut nft_check = tokio::time::interval(NFT_CHECK);
    let mut last: Option<DesiredState> = None;
    let mut pass: u64 = 0;
    // A pass woken by the registry or a deletion trusts what the last passes read of the
    // WireGuard devices (no event reports their peers changing); the first pass and the
    // periodic resync read everything.
    let mut full = true;
    // Nothing is planned before the registry's first full listing: a plan made from the
    // empty view would remove every peer that a previous run left in place, dropping
    // traffic that the restart should not touch.
    loop {
        tokio::select! {
            listed = inputs.views.changed() => match listed {
                Ok(()) => break,
                Err(_) => return,
            },
            // Waiting for the registry (which retries on its own) is not being wedged.
            _ = nft_check.tick() => inputs.health.beat(),
            _ = inputs.shutdown.changed() => return,
        }
    }
    info!(
        nodes = inputs.views.borrow().leases.len(),
        "first full listing"
    );
    loop {
        inputs.health.beat();
        let me = inputs.local.borrow_and_update().clone();
        let view = inputs.views.borrow_and_update().clone();
        let t_plan = std::time::Instant::now();
        match plan(&PlanInput {
            local: &me,
            view: &view,
            config: net,
            options,
            now: SystemTime::now(),
        }) {
            Ok(state) => {
                let plan_ms = t_plan.elapsed().as_secs_f64() * 1e3;
                report(last.as_ref(), &state);
                match subnet_file::write(&args.subnet_file, &state.subnet_env) {
                    Ok(written) => {
                        if written {
                            info!(path = %args.subnet_file.display(), "wrote subnet file");
                        }
                        inputs.health.set(Readiness::SubnetFileWritten);
                    }
                    Err(e) => {
                        inputs.health.unset(Readiness::SubnetFileWritten);
                        error!(error = %e, "writing the subnet file");
                    }
                }
                pass += 1;
                let span = tracing::info_span!("reconcile", pass);
                let (started, writes) = (std::time::Instant::now(), dataplane.writes());
                let result = if full {
                    dataplane.reconcile(&state, key).instrument(span).await
                } else {
                    dataplane
                        .reconcile_incremental(&state, key)
                        .instrument(span)
                        .await
                };
                match result {
                    Ok(r) => {
                        log_report(&r);
                        inputs.health.set(Readiness::DataplaneProgrammed);
                        inputs
                            .ready
                            .send_if_modified(|ready| !std::mem::replace(ready, true));
                        info!(
                            pass,
                            full,
                            changes = r.changes.len(),
                            errors = r.errors.len(),
                            writes = dataplane.writes() - writes,
                            took_ms = started.elapsed().as_secs_f64() * 1e3,
                            plan_ms,
                            parts = ?r.timings,
                            "reconciled"
                        );
                    }
                    Err(e) => {
                        inputs.health.unset(Readiness::DataplaneProgrammed);
                        warn!(error = %e, "reconcile failed; retrying on the next event or resync")
                    }
                }
                last = Some(state);
            }
            Err(e) => error!(error = %e, "cannot plan this node"),
        }
        loop {
            tokio::select! {
                _ = inputs.views.changed() => {
                    full = false;
                    break;
                }
                _ = inputs.local.changed() => {
                    full = false;
                    break;
                }
                _ = resync.tick() => {
                    full = true;
                    break;
                }
                // Links, addresses, routes and neighbours are read in every pass, and a
                // deleted device is recreated and read afresh; so a deletion (often one of
                // the agent's own) needs no full pass.
                Some(()) = inputs.deletions.recv() => {
                    full = false;
                    break;
                }
                _ = nft_check.tick() => {
                    inputs.health.beat();
                    if let Some(state) = &last {
                        match dataplane.reconcile_nft(state).await {
                            Ok(r) => log_report(&r),
                            Err(e) => warn!(error = %e, "nftables check failed"),
                        }
                    }
                }
                _ = inputs.shutdown.changed() => return,
            }
        }
    }
}

/// Logs what changed in the plan: peers in and out, and each newly left-out peer's reason.
fn report(before: Option<&DesiredState>, after: &DesiredState) {
    if before == Some(after) {
        return;
    }
    let peers = |s: Option<&DesiredState>| -> std::collections::BTreeSet<String> {
        s.map(|s| {
            let tunnels = s
                .tunnels
                .iter()
                .flat_map(|t| t.peers.iter().map(|p| format!("{} {}", t.device, p.node)));
            let vxlan = s
                .vxlan
                .iter()
                .flat_map(|v| v.peers.iter().map(|p| format!("{} {}", v.device, p.node)));
            tunnels.chain(vxlan).collect()
        })
        .unwrap_or_default()
    };
    let (old, new) = (peers(before), peers(Some(after)));
    for p in new.difference(&old) {
        info!(peer = %p, "peer planned");
    }
    for p in old.difference(&new) {
        info!(peer = %p, "peer removed from plan");
    }
    for l in &after.left_out {
        if !before.is_some_and(|b| b.left_out.contains(l)) {
            warn!(node = %l.node, reason = %l.reason, "peer left out");
        }
    }
    info!(
        tunnels = after.tunnels.len(),
        peers = new.len(),
        routes = after.routes.len(),
        left_out = after.left_out.len(),
        "plan updated"
    );
}
