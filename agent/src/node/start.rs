//! Start-up of `weft agent`: key, health and control endpoints, registry, config, lease,
//! data plane; then the control loop (`run_loop`) until shutdown.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tokio::sync::watch;
use tracing::{info, warn};
use weft_backends::apply::wireguard::process::UserspaceProcess;
use weft_backends::apply::{monitor, Dataplane};
use weft_backends::netconf::Backend;
use weft_crypto::{load_or_create, PrivateKey, DEFAULT_KEY_FILE, KEY_FILE_ENV};

use crate::backoff::{sleep_or_shutdown, Backoff};
use crate::cli::AgentArgs;
use crate::keys::rotation::{KeyState, RotateRequest, DEFAULT_LEAD};
use crate::node::backend_setup;
use crate::node::local_facts::{local_attrs, plan_options, resume_rotation};
use crate::node::run_loop::{control_loop, LoopInputs};
use crate::node::subnet_file;
use crate::observe::http::{Health, Readiness};
use crate::observe::metrics::Metrics;
use crate::observe::snapshot;
use crate::registry::kube::{self, KubeConfig, KubeRegistry};
use crate::registry::tls_link;
use crate::registry::{self, AcquireRequest, EtcdConfig, EtcdRegistry, LocalAttrs, Registry};

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
    // boringtun warns of every handshake retry, per peer: with thousands of peers down
    // that is thousands of lines a minute saying what the liveness watcher says once a
    // pair (`RUST_LOG` brings them back).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,boringtun=error"));
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
    // Before anything is touched: a second agent on this node stops here.
    let state_dir = state_dir_of(&key_path);
    let _one_agent = super::one_agent::take(&state_dir)?;
    let (key, origin) = load_or_create(&key_path).context("loading the node's WireGuard key")?;
    info!(path = %key_path.display(), public_key = %key.public_key(), origin = ?origin, "WireGuard key");
    let public_ip = crate::node::iface::public_ip(&args)?;
    let mut shutdown = shutdown_on_signals()?;
    let health = Health::new(args.resync_period);
    let snapshot = snapshot::Shared::default();
    let mut metrics = Metrics::default();
    metrics.alerts.registry = health.registry();
    crate::cni::release::spawn(
        args.cni_data_dir.clone(),
        args.cni_bin_dir.clone(),
        args.leaked_address_period,
        metrics.clone(),
    );
    let endpoints = crate::observe::http::Endpoints {
        health: health.clone(),
        metrics: metrics.clone(),
        snapshot: snapshot.clone(),
    };
    serve_http(&args, endpoints).await?;
    let (rotate_tx, rotate_rx) = tokio::sync::mpsc::channel(4);
    let control = crate::observe::control_socket::ControlState {
        snapshot: snapshot.clone(),
        health: health.clone(),
        rotate: rotate_tx.clone(),
    };
    crate::observe::control_socket::serve(&crate::observe::control_socket::socket_path(), control)
        .await?;
    let start = Start {
        key,
        key_path,
        public_ip,
        health,
        snapshot,
        metrics,
        rotate: (rotate_tx, rotate_rx),
    };
    if args.kube_subnet_mgr {
        let config = kube::config(&args.kubeconfig_file, &args.kube_api_url)
            .await
            .context("--kube-subnet-mgr")?;
        match kube::link(&config) {
            Ok(link) => tls_link::report(vec![link]),
            Err(e) => {
                warn!(link = "kubernetes", error = %e, "control-plane link: its TLS key exchange group is not learned")
            }
        }
        let client = kube::client_from(config).context("--kube-subnet-mgr")?;
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
        let mut cfg = EtcdConfig::new(args.etcd_endpoints.clone(), args.etcd_prefix.clone())
            .with_access(args.etcd.access());
        cfg.renew_margin = args.subnet_lease_renew_margin;
        if cfg.auth.is_some() {
            cfg.refuse_in_clear("the etcd password")?;
        }
        info!(endpoints = %cfg.endpoints.join(","), prefix = %cfg.prefix, %public_ip, "starting with the etcd registry");
        match cfg.tls.links(&cfg.endpoints) {
            Ok(links) => tls_link::report(links),
            Err(e) => {
                warn!(link = "etcd", error = %e, "control-plane link: its TLS key exchange group is not learned")
            }
        }
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
    snapshot: snapshot::Shared,
    metrics: Metrics,
    /// Rotation requests (control socket, registry) and where the loop receives them.
    rotate: (
        tokio::sync::mpsc::Sender<RotateRequest>,
        tokio::sync::mpsc::Receiver<RotateRequest>,
    ),
}

/// The health endpoints on `--healthz-ip`:`--healthz-port`, and `/metrics` there or on
/// `--metrics-ip`:`--metrics-port` when that port is set (0 turns either off).
async fn serve_http(
    args: &AgentArgs,
    endpoints: crate::observe::http::Endpoints,
) -> anyhow::Result<()> {
    use crate::observe::http::{serve, Routes};
    use std::net::SocketAddr;
    let separate = args.metrics_port != 0;
    if args.healthz_port != 0 {
        let addr = SocketAddr::new(args.healthz_ip, args.healthz_port);
        let routes = if separate {
            Routes::Health
        } else {
            Routes::All
        };
        serve(
            addr,
            routes,
            "--healthz-ip, --healthz-port",
            endpoints.clone(),
        )
        .await?;
    }
    if separate {
        let addr = SocketAddr::new(args.metrics_ip, args.metrics_port);
        serve(
            addr,
            Routes::Metrics,
            "--metrics-ip, --metrics-port",
            endpoints,
        )
        .await?;
    }
    Ok(())
}

/// The data plane with the WireGuard implementation `setup` asks for, logging which runs
/// and why.
async fn connect_dataplane(setup: &backend_setup::BackendSetup) -> anyhow::Result<Dataplane> {
    let (dataplane, why) = Dataplane::connect(setup.implementation, UserspaceProcess::default())
        .await
        .context("choosing the WireGuard implementation")?;
    info!(
        implementation = dataplane.implementation(),
        why, "WireGuard"
    );
    Ok(dataplane)
}

/// The registry's network config, once a secret it holds would not travel in clear (see
/// `Registry::secrets_in_clear`; that ends the agent with the error). Retried until the
/// registry answers; `None` if shutdown came first.
async fn network_config<R: Registry>(
    registry: &mut R,
    shutdown: &mut watch::Receiver<bool>,
    health: &Health,
) -> anyhow::Result<Option<weft_backends::netconf::NetConf>> {
    let Some(net) = retry!(
        "reading the network config",
        shutdown,
        health,
        registry.net_conf()
    ) else {
        return Ok(None);
    };
    let Some(in_clear) = retry!(
        "looking for secrets in the registry",
        shutdown,
        health,
        registry.secrets_in_clear(&net)
    ) else {
        return Ok(None);
    };
    match in_clear {
        Some(refused) => Err(refused.into()),
        None => Ok(Some(net)),
    }
}

/// With an encrypting backend, the pod networks are sealed before anything else is done
/// (`weft_backends::apply::seal`): routes another backend left stop carrying pod packets
/// in clear now, not at the first pass. A failure is logged; the first pass tries again.
async fn seal_early(net: &weft_backends::netconf::NetConf) {
    if !matches!(net.backend, Backend::Wireguard(_)) {
        return;
    }
    let networks: Vec<ipnet::IpNet> = [false, true]
        .into_iter()
        .filter_map(|v6| net.network(v6).map(|n| n.network))
        .collect();
    let tunnels = [
        weft_backends::plan::WG_DEVICE,
        weft_backends::plan::WG_DEVICE_V6,
    ];
    let sealed = match weft_backends::apply::RtNetlink::connect() {
        Ok(mut nl) => weft_backends::apply::seal(&mut nl, &networks, &tunnels).await,
        Err(e) => Err(e),
    };
    match sealed {
        Ok(changes) => {
            for change in changes {
                info!(change = %change, "data plane sealed");
            }
            info!(networks = ?networks, "pod networks sealed: from here on a pod packet to a peer enters a tunnel or is dropped");
        }
        Err(e) => warn!(error = %e, "sealing the pod networks before the first pass"),
    }
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
        snapshot,
        metrics,
        rotate,
    } = start;
    let (key, rotation) = resume_rotation(key, &key_path)?;
    let Some(net) = network_config(&mut registry, &mut shutdown, &health).await? else {
        return Ok(0);
    };
    // A node keeping its old unencrypted backend (`also`) is sealed too: until its first
    // pass, its pairs with peers that publish an encrypting backend must not go in clear.
    seal_early(&net).await;
    let state_dir = state_dir_of(&key_path);
    let kem = crate::pq::load_key(&net, args.post_quantum_off, &state_dir)?;
    let setup = backend_setup::prepare(
        &net,
        &key.public_key(),
        args.wireguard_implementation.as_deref(),
        &state_dir,
    )
    .await?;
    let (previous, previous_v6) = subnet_file::previous_subnets(&args.subnet_file);
    let request = AcquireRequest {
        attrs: LocalAttrs {
            ml_kem_key: kem.as_ref().map(|k| k.encaps_key().to_base64()),
            ..local_attrs(args, &net, public_ip, &setup, &rotation)
        },
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
    let dataplane = connect_dataplane(&setup).await?;
    let mut dataplane = backend_setup::attach_ipsec(dataplane, &setup, &net, &state_dir)?;
    let ipsec = matches!(net.backend, Backend::Ipsec(_));
    let deletions = monitor::deletions(ipsec, dataplane.own_deletions())
        .context("watching the kernel for deleted links and routes")?;
    let nft_changes = monitor::nftables_changes()
        .map_err(|e| warn!(error = %e, "no nftables events: listing the tables every 2 s"))
        .ok();
    // The name this node's entry has in the registry: what its key proof is made for.
    let identity = lease.node.clone();
    let pq_listen = crate::pq::Listen::of(
        &net.backend,
        &[lease.subnet, lease.subnet_v6]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>(),
        &std::iter::once(std::net::IpAddr::V4(public_ip))
            .chain(lease.public_ipv6.map(std::net::IpAddr::V6))
            .collect::<Vec<_>>(),
    );
    let mut handle = registry::spawn(registry, lease, metrics.alerts.clone());
    let options = plan_options(args, &setup, &mut dataplane, public_ip).await?;
    snapshot.update(|s| {
        s.implementation = dataplane.implementation().to_string();
        s.underlay_mtu = options.underlay_mtu;
    });
    let registry_rotations =
        std::mem::replace(&mut handle.rotate_requests, tokio::sync::mpsc::channel(1).1);
    let path_mtu = path_mtu_prober(args);
    let pq = crate::pq::start(kem, &key, args, &state_dir, pq_listen);
    let inputs = LoopInputs {
        path_mtu,
        pq,
        psk: crate::keys::psk::PskSources::new(args.psk_dir.clone(), handle.psk.clone()),
        registry_rotations,
        views: handle.views.clone(),
        local: handle.local.clone(),
        deletions,
        nft_changes,
        shutdown,
        ready: handle.ready.clone(),
        health,
        snapshot,
        metrics,
        rotate: rotate.1,
    };
    let mut keys = KeyState {
        key,
        rotation,
        attrs: request.attrs.clone(),
        updates: handle.updates.clone(),
        listen_port: wireguard_port(&net),
        lead: DEFAULT_LEAD,
        unpublished: false,
        identity,
    };
    keys.prove().await;
    control_loop(args, &net, &options, &mut keys, &mut dataplane, inputs).await;
    handle.stop().await;
    info!("stopped; the lease and the data plane are left in place for the next start");
    Ok(0)
}

/// The directory of the node's state: the key file's.
fn state_dir_of(key_path: &Path) -> PathBuf {
    key_path
        .parent()
        .map_or_else(|| PathBuf::from("/var/lib/weft"), PathBuf::from)
}

/// The WireGuard listen port; `None` on backends without keys.
fn wireguard_port(net: &weft_backends::netconf::NetConf) -> Option<u16> {
    match &net.backend {
        Backend::Wireguard(wg) => Some(wg.listen_port),
        _ => None,
    }
}

/// The path MTU prober `--path-mtu-port` asks for, or none (port 0). A taken port costs
/// the measurement, never the mesh: every peer route keeps the pod MTU, as with it off.
fn path_mtu_prober(args: &AgentArgs) -> crate::pathmtu::Handle {
    match args.path_mtu_port {
        0 => crate::pathmtu::Handle::off(),
        port => crate::pathmtu::spawn(port, args.path_mtu_check).unwrap_or_else(|e| {
            tracing::warn!(
                port,
                error = %e,
                "path MTU discovery is off: its UDP port (--path-mtu-port) cannot be bound; \
                 every peer route keeps the pod MTU"
            );
            crate::pathmtu::Handle::off()
        }),
    }
}
