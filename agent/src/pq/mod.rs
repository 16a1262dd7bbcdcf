//! Post-quantum pair secrets (`Backend.PostQuantum`): this node's ML-KEM-768 key pair, and
//! a task that runs a round with every peer that publishes a key (the rounds themselves
//! are `weft_crypto::pq::Exchange`), every `Timing::period` and whenever a key changes.
//! The control loop gives the task each plan's peers and takes back the PSK in force for
//! each pair, which the plan combines with the cluster PSK.
//!
//! On WireGuard the rounds travel inside the pair's tunnel, between the two nodes' tunnel
//! addresses on UDP `--post-quantum-port`, and the task listens for them on this node's
//! tunnel addresses alone; NAT is crossed as the tunnel crosses it. Should a pair ever hold
//! two different PSKs (one side's saved state lost), its handshakes fail; the liveness
//! watcher, once re-applying and re-handshaking the pair did not bring it back, calls
//! `fall_back`, which sends the peer a `classical` notice (through the tunnel and to its
//! public IP): both sides go classical, and a new round brings the protection back. For
//! that notice alone the task also listens on this node's public IPs (`Listen::notices`):
//! any other message arriving there is dropped unread. On ipsec they go
//! between the nodes' public IPs, outside the ESP policies: a pair whose two nodes hold
//! different secrets cannot carry anything through its tunnel, and the leader's next round
//! (at once if the leader is the node that lost its state) mends it.

mod list;
mod manager;
pub mod saved;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};
use weft_backends::model::PairSecret;
use weft_crypto::pq::{KemKeyPair, Own, Timing};
use weft_crypto::{PrivateKey, PublicKey};

/// The UDP port the rounds use, on the tunnel addresses (ipsec: the public IPs; WireGuard's
/// `classical` notices: the public IPs too).
pub const DEFAULT_PORT: u16 = 51823;

/// What the task tells the control loop.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Published {
    /// The PSK of each pair's last completed round (and the one it replaced), by the
    /// peer's key. Shared: a pass takes it without a copy, and the task changes it in
    /// place unless a pass holds it at that moment.
    pub psks: Arc<BTreeMap<PublicKey, PairSecret>>,
    /// This node's X25519 key the PSKs were made with. A pass that already has a newer
    /// one (its key switched before the task heard of it) plans every pair classical:
    /// the peers' entries for that key are new pairs with no PSK yet.
    pub own: Option<PublicKey>,
    /// The next moment a committed PSK takes over: the loop plans again then.
    pub next_switch: Option<SystemTime>,
}

impl Published {
    /// The PSKs to plan with on a node whose key is `own` now.
    pub fn psks_for(&self, own: &PublicKey) -> Arc<BTreeMap<PublicKey, PairSecret>> {
        if self.own.as_ref().is_some_and(|o| o != own) {
            return Arc::default();
        }
        self.psks.clone()
    }
}

/// One pair, for `weft status`, `weft doctor` and `/metrics`: the snapshot's own row.
pub use crate::observe::snapshot::PqPairInfo as PairStatus;
pub use list::PqList;

/// What the control loop holds of the task.
pub struct Handle {
    /// Each plan's post-quantum peers.
    pub peers: watch::Sender<PqList>,
    pub published: watch::Receiver<Published>,
    pub status: Arc<Mutex<BTreeMap<PublicKey, PairStatus>>>,
    /// A pair that cannot handshake (its peer's node): back to classical, and a new round.
    pub fall_back: mpsc::Sender<String>,
    /// This node's new X25519 key, at the moment it takes over.
    pub own_key: mpsc::Sender<PrivateKey>,
    /// This node's new ML-KEM key pair (`rotate_key`), before it is published.
    pub own_kem: mpsc::Sender<KemKeyPair>,
    /// Where `mlkem.key` is kept; `None` with the task off.
    state_dir: Option<PathBuf>,
    /// With the task off, the sender `published` waits on: kept, so it never changes.
    _silent: Option<watch::Sender<Published>>,
}

impl Handle {
    /// Rotates this node's ML-KEM key (with its X25519 key, `weft keys rotate`): a new key
    /// pair written over `mlkem.key`, then handed to the task; returns its encapsulation key
    /// to publish. `None` with the task off.
    pub fn rotate_key(&self) -> Option<anyhow::Result<String>> {
        let dir = self.state_dir.as_ref()?;
        let rotated = rotate_key(dir).and_then(|kem| {
            let ek = kem.encaps_key().to_base64();
            self.own_kem
                .try_send(kem)
                .map_err(|_| anyhow::anyhow!("the post-quantum task does not take it"))?;
            Ok(ek)
        });
        Some(rotated)
    }

    /// A handle on nothing: `PostQuantum` is off, every pair classical.
    pub fn off() -> Handle {
        let (silent, published) = watch::channel(Published::default());
        Handle {
            peers: watch::channel(PqList::default()).0,
            published,
            status: Arc::default(),
            fall_back: mpsc::channel(1).0,
            own_key: mpsc::channel(1).0,
            own_kem: mpsc::channel(1).0,
            state_dir: None,
            _silent: Some(silent),
        }
    }
}

/// Where the task listens, on `--post-quantum-port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listen {
    /// Where the rounds arrive, at most one address per family: on WireGuard this node's
    /// tunnel addresses (inside the tunnel), on ipsec every address (unspecified).
    pub rounds: Vec<IpAddr>,
    /// Where only a `classical` notice is taken, one per family: on WireGuard this node's
    /// public IPs (the tunnel may be what is broken); none on ipsec, whose rounds arrive
    /// there already.
    pub notices: Vec<IpAddr>,
}

impl Listen {
    /// Where a node listens on `backend`, with pod subnets `subnets` (its tunnel
    /// addresses are their network addresses) and public IPs `public`.
    pub fn of(
        backend: &weft_backends::netconf::Backend,
        subnets: &[ipnet::IpNet],
        public: &[IpAddr],
    ) -> Listen {
        match backend {
            weft_backends::netconf::Backend::Wireguard(_) => Listen {
                rounds: subnets.iter().map(|s| s.network()).collect(),
                notices: public.to_vec(),
            },
            _ => Listen {
                rounds: vec![
                    IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                    IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                ],
                notices: Vec::new(),
            },
        }
    }
}

/// What the task needs.
pub struct Config {
    pub own: Own,
    pub listen: Listen,
    pub port: u16,
    /// Where the PSKs in force are kept across restarts (`saved`).
    pub state_dir: PathBuf,
    pub timing: Timing,
}

/// This node's ML-KEM-768 key pair, kept beside its WireGuard key (`mlkem.key`, 0600),
/// when the config asks for post-quantum rounds.
/// `off`: this node takes no part whatever the config says (`--post-quantum-off`).
pub fn load_key(
    net: &weft_backends::netconf::NetConf,
    off: bool,
    state_dir: &std::path::Path,
) -> anyhow::Result<Option<KemKeyPair>> {
    use anyhow::Context;
    if off || !weft_backends::plan::post_quantum::enabled(net) {
        return Ok(None);
    }
    let path = state_dir.join(weft_crypto::KEM_SEED_FILE);
    let (kem, origin) = weft_crypto::load_or_create_secret::<KemKeyPair>(&path)
        .context("loading the node's ML-KEM key (Backend.PostQuantum)")?;
    tracing::info!(path = %path.display(), origin = ?origin, key = ?kem.encaps_key(), "ML-KEM-768 key");
    Ok(Some(kem))
}

/// A new ML-KEM-768 key pair for this node, written over `mlkem.key` in `state_dir` (0600,
/// in one rename) before anything uses it.
pub fn rotate_key(state_dir: &std::path::Path) -> anyhow::Result<KemKeyPair> {
    use anyhow::Context;
    let path = state_dir.join(weft_crypto::KEM_SEED_FILE);
    weft_crypto::write_new_secret::<KemKeyPair>(&path)
        .with_context(|| format!("writing a new ML-KEM key to {}", path.display()))
}

/// The task for `kem` (none without it: every pair classical), listening on `listen`. A
/// port that cannot be bound costs the protection, never the mesh.
/// `--post-quantum-port` and `--post-quantum-period` from `args`.
pub fn start(
    kem: Option<KemKeyPair>,
    key: &PrivateKey,
    args: &crate::cli::AgentArgs,
    state_dir: &std::path::Path,
    listen: Listen,
) -> Handle {
    let (port, period) = (args.post_quantum_port, args.post_quantum_period);
    let Some(kem) = kem else {
        return Handle::off();
    };
    let config = Config {
        own: Own {
            key: key.clone(),
            kem,
            previous_kem: None,
        },
        listen,
        port,
        state_dir: state_dir.to_path_buf(),
        timing: Timing {
            // At least a second: a round takes a round trip and the switch delay.
            period: u64::try_from(period.as_millis())
                .unwrap_or(u64::MAX)
                .max(1_000),
            ..Timing::default()
        },
    };
    spawn(config).unwrap_or_else(|e| {
        tracing::warn!(port, error = %e, "post-quantum rounds are off: their UDP port (--post-quantum-port) cannot be bound; every pair stays classical");
        Handle::off()
    })
}

/// Binds the port and starts the task. Fails only if no address for rounds can bind.
pub fn spawn(config: Config) -> std::io::Result<Handle> {
    let (v4, v6) = bind_families(&config.listen.rounds, config.port)?;
    // No notice socket where the rounds' socket takes every address already.
    let notices = (config.listen.notices.iter())
        .filter(|ip| !config.listen.rounds.contains(ip))
        .copied()
        .collect::<Vec<_>>();
    let notices = match bind_families(&notices, config.port) {
        Ok(sockets) => sockets,
        Err(e) => {
            tracing::warn!(port = config.port, addresses = ?notices, error = %e, "post-quantum: no socket for classical notices on the public IPs; a peer's notice arrives only through the tunnel");
            (None, None)
        }
    };
    let (published_tx, published) = watch::channel(Published::default());
    let (peers, peers_rx) = watch::channel(PqList::default());
    let (fall_back, fall_back_rx) = mpsc::channel(64);
    let (own_key, own_key_rx) = mpsc::channel(4);
    let (own_kem, own_kem_rx) = mpsc::channel(4);
    let status: Arc<Mutex<BTreeMap<PublicKey, PairStatus>>> = Arc::default();
    let state_dir = config.state_dir.clone();
    let sockets = manager::Sockets {
        v4,
        v6,
        notice4: notices.0,
        notice6: notices.1,
    };
    let manager = manager::Manager::new(config, sockets, published_tx, status.clone());
    tokio::spawn(manager.run(manager::Inputs {
        peers: peers_rx,
        fall_back: fall_back_rx,
        own_key: own_key_rx,
        own_kem: own_kem_rx,
    }));
    Ok(Handle {
        peers,
        published,
        status,
        fall_back,
        own_key,
        own_kem,
        state_dir: Some(state_dir),
        _silent: None,
    })
}

/// A socket on the first IPv4 and the first IPv6 address of `addrs` that bind, on `port`;
/// the first error if none does (none at all for no addresses).
fn bind_families(
    addrs: &[IpAddr],
    port: u16,
) -> std::io::Result<(Option<UdpSocket>, Option<UdpSocket>)> {
    let mut first_error = None;
    let mut family = |v6: bool| {
        (addrs.iter().filter(|a| a.is_ipv6() == v6)).find_map(|ip| {
            bind(SocketAddr::new(*ip, port))
                .map_err(|e| first_error.get_or_insert(e).kind())
                .ok()
        })
    };
    let (v4, v6) = (family(false), family(true));
    match (v4, v6, first_error) {
        (None, None, Some(e)) => Err(e),
        (v4, v6, _) => Ok((v4, v6)),
    }
}

/// A UDP socket on `addr`. Bound even before the address is the node's (`IP_FREEBIND`): a
/// tunnel address appears on the device only in the first pass, and again after the
/// device is re-created.
fn bind(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    let socket = crate::udp::socket(addr)?;
    if !addr.ip().is_unspecified() {
        match addr {
            SocketAddr::V4(_) => socket.set_freebind_v4(true)?,
            SocketAddr::V6(_) => socket.set_freebind_v6(true)?,
        }
    }
    crate::udp::bind(socket, addr)
}

#[cfg(test)]
mod tests;
