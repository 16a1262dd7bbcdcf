//! The MTU of the path to each peer, measured by this node: padded probes over the
//! underlay with the don't-fragment bit set, answered by the peer's agent
//! (`wire`), searched round by round (`search`). Probes do not rely on ICMP reaching this
//! node: a path whose routers drop "fragmentation needed" is measured all the same.
//!
//! The probes travel beside the tunnel, not inside it, on UDP `--path-mtu-port`: kernel
//! WireGuard sends IPv4 without the don't-fragment bit, so a probe inside its tunnel would
//! be fragmented by a narrow path and answered as if it fit. One prober serves every
//! backend, WireGuard (kernel or userspace), vxlan, ipip, ipsec and host-gw alike.
//!
//! When: a new underlay address at once; every `check` period (longer with many peers:
//! `check_period`), each measured path is probed at its MTU and just above it (two
//! datagrams): a path that narrowed or widened is measured again at once. At most
//! `MAX_CONCURRENT` paths are probed at a time. A path that answers nothing is tried again after 1 s, then
//! less and less often (up to `UNANSWERED_RETRY`), its routes keeping the MTU it last
//! answered at (the pod MTU if it never did) meanwhile. The results go to the plan
//! (`plan::path_mtu` makes each peer route's MTU of them) through a watch channel.
//!
//! Trust: between nodes with keys an ack counts only with the pair's tag (`wire`), so a
//! host on the path, which sees every probe, can drop probes (a narrower path) but not
//! answer them (a wider one). Answers are limited per source address (`limit`), so a
//! flood of probes gets a bounded trickle of acks, each smaller than its probe.

mod auth;
mod limit;
mod respond;
pub mod search;
pub mod wire;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use tokio::net::UdpSocket;
use tokio::sync::watch;
use tracing::{info, warn};

use auth::{Auth, Probing};
use limit::Limiter;
use weft_crypto::pq::AuthKey;
use weft_crypto::{PrivateKey, PublicKey};
use wire::Nonce;

/// How long a round waits for its acks.
const ROUND_WAIT: Duration = Duration::from_millis(400);
/// A full search takes at most this many rounds.
const MAX_ROUNDS: usize = 5;
/// Paths measured or checked at once, at most: a node with thousands of peers paces its
/// probes instead of sending them all in one burst (a burst lost in a socket buffer would
/// read as narrow paths).
const MAX_CONCURRENT: usize = 32;
/// Each measured path costs the periodic check this much of its period: with many peers
/// the period stretches (2 s up to 500 peers, 20 s at 5,000), so the probes stay near one
/// datagram per 4 ms however large the cluster.
const CHECK_PER_PATH: Duration = Duration::from_millis(4);
/// A path that answered nothing is tried again after 1 s, then twice as long each time
/// (a peer's agent may be starting), up to this.
const UNANSWERED_RETRY: Duration = Duration::from_secs(30);

/// The addresses to measure, and the largest MTU worth trying (this node's own
/// interface's); with keys, the node's own and each peer's, which tag the acks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Targets {
    pub addresses: BTreeSet<IpAddr>,
    pub max: u16,
    /// This node's X25519 key (WireGuard, ipsec); `None` on backends without keys.
    pub own: Option<PrivateKey>,
    /// The key of the peer at each address: its probes are keyed and its acks must bear
    /// the pair's tag. An address without one is probed untagged.
    pub keys: BTreeMap<IpAddr, PublicKey>,
}

/// One path's latest measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measurement {
    /// `None`: the peer answered no probe (no agent listening, or the port is filtered).
    pub mtu: Option<u16>,
    pub at: SystemTime,
}

/// What the prober tells the control loop: the MTU of each path that answered, and the
/// paths whose latest measurement went unanswered (a change of either wakes a pass, which
/// puts it in `weft status`, `/metrics` and `weft doctor`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Published {
    pub mtus: BTreeMap<IpAddr, u32>,
    pub unanswered: BTreeSet<IpAddr>,
}

/// What the control loop holds of the prober.
pub struct Handle {
    pub targets: watch::Sender<Targets>,
    /// The measured MTU of each path that answered, and which went silent.
    pub mtus: watch::Receiver<Published>,
    /// Every path's latest measurement, for `weft status`, `/metrics` and `weft doctor`.
    pub measurements: Arc<Mutex<BTreeMap<IpAddr, Measurement>>>,
    /// With discovery off, the sender `mtus` waits on: kept, so that it never reports a
    /// change (a dropped sender would wake the control loop without pause).
    _silent: Option<watch::Sender<Published>>,
}

impl Handle {
    /// A handle on nothing: path MTU discovery is off (`--path-mtu-port=0`).
    pub fn off() -> Handle {
        let (silent, mtus) = watch::channel(Published::default());
        Handle {
            targets: watch::channel(Targets::default()).0,
            mtus,
            measurements: Arc::default(),
            _silent: Some(silent),
        }
    }
}

/// A probe sent and not yet answered: to whom, at what size, and the pair key its ack
/// must be tagged with (none: an untagged probe).
struct Pending {
    to: IpAddr,
    size: u16,
    key: Option<Arc<AuthKey>>,
    acked: bool,
}

struct Prober {
    v4: Option<Arc<UdpSocket>>,
    v6: Option<Arc<UdpSocket>>,
    pending: Mutex<HashMap<Nonce, Pending>>,
    auth: Mutex<Auth>,
    limiter: Mutex<Limiter>,
}

impl Prober {
    fn new(v4: Option<Arc<UdpSocket>>, v6: Option<Arc<UdpSocket>>) -> Prober {
        Prober {
            v4,
            v6,
            pending: Mutex::new(HashMap::new()),
            auth: Mutex::new(Auth::default()),
            limiter: Mutex::new(Limiter::default()),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Binds the probe port on each family this host has and starts the responder and the
/// prober. Fails only if IPv4 and IPv6 both cannot bind.
pub fn spawn(port: u16, check: Duration) -> std::io::Result<Handle> {
    let v4 = bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)));
    let v6 = bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)));
    let (v4, v6) = match (v4, v6) {
        (Err(e), Err(_)) => return Err(e),
        (v4, v6) => (v4.ok().map(Arc::new), v6.ok().map(Arc::new)),
    };
    let prober = Arc::new(Prober::new(v4, v6));
    for socket in [&prober.v4, &prober.v6].into_iter().flatten() {
        tokio::spawn(respond::answer(prober.clone(), socket.clone()));
    }
    let (targets, targets_rx) = watch::channel(Targets::default());
    let (mtus_tx, mtus) = watch::channel(Published::default());
    let measurements: Arc<Mutex<BTreeMap<IpAddr, Measurement>>> = Arc::default();
    tokio::spawn(manage(
        prober,
        targets_rx,
        mtus_tx,
        measurements.clone(),
        check,
    ));
    info!(
        port,
        "path MTU discovery: answering and probing on UDP port"
    );
    Ok(Handle {
        targets,
        mtus,
        measurements,
        _silent: None,
    })
}

/// A UDP socket on `addr` whose datagrams carry the don't-fragment bit and ignore the
/// kernel's path MTU cache (`IP_PMTUDISC_PROBE`): a probe either crosses whole or is lost.
/// The IPv6 socket is IPv6 only, so it and the IPv4 one share the port.
fn bind(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    let socket = crate::udp::socket(addr)?;
    let fd = socket.as_raw_fd();
    if addr.is_ipv4() {
        setsockopt(
            fd,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_PROBE,
        )?;
    } else {
        setsockopt(
            fd,
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_PROBE,
        )?;
        // IPv6 fragments at the source unless told not to; a probe must not be.
        setsockopt(fd, libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG, 1)?;
    }
    crate::udp::bind(socket, addr)
}

fn setsockopt(fd: i32, level: i32, option: i32, value: i32) -> std::io::Result<()> {
    // SAFETY: an int option of the length given, on a socket this process owns.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            option,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl Prober {
    /// Sends one probe of each size to `to` at once and returns the sizes acknowledged
    /// within `ROUND_WAIT`.
    async fn round(&self, to: SocketAddr, sizes: &[u16]) -> Vec<u16> {
        let socket = if to.is_ipv4() { &self.v4 } else { &self.v6 };
        let Some(socket) = socket else {
            return Vec::new();
        };
        let probing = lock(&self.auth).probing(to.ip());
        let (own, key) = match probing {
            Probing::Untagged => (None, None),
            Probing::Keyed { own, pair } => (Some(own), Some(pair)),
            // The peer has a key and this node cannot make the pair's: unmeasured.
            Probing::Unusable => return Vec::new(),
        };
        let mut nonces = Vec::new();
        for &size in sizes {
            let Ok(nonce) = weft_crypto::random_bytes::<16>() else {
                continue;
            };
            let probe = match &own {
                Some(own) => wire::keyed_probe(nonce, size, to.ip(), own),
                None => wire::probe(nonce, size, to.ip()),
            };
            let Some(probe) = probe else {
                continue;
            };
            lock(&self.pending).insert(
                nonce,
                Pending {
                    to: to.ip(),
                    size,
                    key: key.clone(),
                    acked: false,
                },
            );
            nonces.push(nonce);
            // Too large for this node's own interface (EMSGSIZE): as good as lost.
            let _ = socket.send_to(&probe, to).await;
        }
        tokio::time::sleep(ROUND_WAIT).await;
        let mut pending = lock(&self.pending);
        nonces
            .iter()
            .filter_map(|n| pending.remove(n))
            .filter(|p| p.acked)
            .map(|p| p.size)
            .collect()
    }

    /// The path MTU to `to`, searched from scratch; `None` if nothing was answered.
    async fn measure(&self, to: SocketAddr, max: u16) -> Option<u16> {
        let mut sizes = search::first_round(max);
        let mut bounds = None;
        for _ in 0..MAX_ROUNDS {
            let acked = self.round(to, &sizes).await;
            bounds = search::update(bounds, &sizes, &acked);
            sizes = search::next_round(bounds.as_ref()?);
            if sizes.is_empty() {
                break;
            }
        }
        bounds.map(|b| b.acked)
    }

    /// Whether the path to `to` still has MTU `mtu` (a probe at it crosses, one just above
    /// does not), with one retry for a lost probe.
    async fn unchanged(&self, to: SocketAddr, mtu: u16, max: u16) -> bool {
        let above = (mtu < max).then(|| (mtu + search::RESOLUTION).min(max));
        let sizes: Vec<u16> = std::iter::once(mtu).chain(above).collect();
        let mut acked = self.round(to, &sizes).await;
        if !acked.contains(&mtu) {
            acked = self.round(to, &[mtu]).await;
        }
        acked.contains(&mtu) && above.is_none_or(|a| !acked.contains(&a))
    }
}

/// One path's state in the manager.
struct Path {
    last: Measurement,
    /// The MTU the peer last answered at: its routes keep it while a later measurement
    /// goes unanswered (a lost probe or two never undoes what was measured).
    answered: Option<u16>,
    /// An unanswered path's next try.
    retry_at: Instant,
    /// Measurements in a row that nothing answered.
    misses: u32,
}

impl Path {
    /// The path after a measurement that gave `mtu` (`None`: nothing answered), following
    /// `before`; logs what changed.
    fn after(before: Option<&Path>, addr: IpAddr, mtu: Option<u16>) -> Path {
        let answered = mtu.or(before.and_then(|p| p.answered));
        let misses = match mtu {
            Some(_) => 0,
            None => before.map_or(0, |p| p.misses) + 1,
        };
        match (mtu, before.and_then(|p| p.last.mtu)) {
            (Some(m), b) if Some(m) != b => {
                info!(%addr, path_mtu = m, before = ?b, "path MTU measured")
            }
            // Said once a peer has had a few seconds to start answering.
            (None, _) if misses == 3 => warn!(
                %addr,
                last_answered = ?answered,
                "path MTU: the peer answers no probe (is its agent older, or UDP to the \
                 probe port filtered?); its routes keep the MTU it last answered at, or \
                 the pod MTU"
            ),
            _ => {}
        }
        let retry = Duration::from_secs(1 << misses.saturating_sub(1).min(5));
        Path {
            last: Measurement {
                mtu,
                at: SystemTime::now(),
            },
            retry_at: Instant::now() + retry.min(UNANSWERED_RETRY),
            answered,
            misses,
        }
    }
}

/// Shares every path's latest measurement and tells the control loop of a change.
fn publish(
    paths: &BTreeMap<IpAddr, Path>,
    shared: &Mutex<BTreeMap<IpAddr, Measurement>>,
    mtus: &watch::Sender<Published>,
) {
    *lock(shared) = paths.iter().map(|(a, p)| (*a, p.last)).collect();
    let published = Published {
        mtus: paths
            .iter()
            .filter_map(|(a, p)| Some((*a, u32::from(p.answered?))))
            .collect(),
        unanswered: paths
            .iter()
            .filter(|(_, p)| p.last.mtu.is_none())
            .map(|(a, _)| *a)
            .collect(),
    };
    mtus.send_if_modified(|m| {
        let changed = *m != published;
        *m = published;
        changed
    });
}

/// Keeps every target's measurement current and publishes the results.
async fn manage(
    prober: Arc<Prober>,
    mut targets: watch::Receiver<Targets>,
    mtus: watch::Sender<Published>,
    shared: Arc<Mutex<BTreeMap<IpAddr, Measurement>>>,
    check: Duration,
) {
    let mut paths: BTreeMap<IpAddr, Path> = BTreeMap::new();
    let mut next_check = Instant::now() + check;
    loop {
        let retry = paths
            .values()
            .filter(|p| p.last.mtu.is_none())
            .map(|p| p.retry_at)
            .min();
        // Only the periodic check probes the paths already measured; a new target list
        // (a pass) or a retry measures only what is new or unanswered.
        let periodic = tokio::select! {
            changed = targets.changed() => if changed.is_err() { return } else { false },
            () = tokio::time::sleep_until(next_check.into()) => true,
            () = sleep_until(retry) => false,
        };
        if periodic {
            next_check = Instant::now() + check_period(check, paths.len());
        }
        let want = targets.borrow_and_update().clone();
        lock(&prober.auth).update(want.own.as_ref(), &want.keys);
        paths.retain(|addr, _| want.addresses.contains(addr));
        let now = Instant::now();
        let work: Vec<_> = want
            .addresses
            .iter()
            .filter_map(|&addr| {
                let to = SocketAddr::new(addr, prober_port(&prober, addr)?);
                let path = paths.get(&addr);
                let prober = prober.clone();
                let max = want.max.max(search::FLOOR);
                let due = match path {
                    None => true,
                    Some(p) if p.last.mtu.is_none() => now >= p.retry_at,
                    Some(_) => periodic,
                };
                let known = path.and_then(|p| p.answered);
                due.then_some(async move {
                    if let Some(mtu) = known {
                        if mtu <= max && prober.unchanged(to, mtu, max).await {
                            // Confirmed: measured again, now.
                            return (addr, Some(mtu));
                        }
                    }
                    (addr, prober.measure(to, max).await)
                })
            })
            .collect();
        let results: Vec<_> = futures::stream::iter(work)
            .buffer_unordered(MAX_CONCURRENT)
            .collect()
            .await;
        for (addr, mtu) in results {
            let next = Path::after(paths.get(&addr), addr, mtu);
            paths.insert(addr, next);
        }
        publish(&paths, &shared, &mtus);
    }
}

/// The periodic check's period for `paths` measured paths: `check`, or longer with many.
fn check_period(check: Duration, paths: usize) -> Duration {
    let per_path = CHECK_PER_PATH.saturating_mul(u32::try_from(paths).unwrap_or(u32::MAX));
    check.max(per_path)
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// The peer's probe port: the same as ours (every node runs the same DaemonSet).
fn prober_port(prober: &Prober, addr: IpAddr) -> Option<u16> {
    let socket = if addr.is_ipv4() {
        &prober.v4
    } else {
        &prober.v6
    };
    socket.as_ref()?.local_addr().ok().map(|a| a.port())
}

#[doc(hidden)]
pub mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_check_period_stretches_with_the_number_of_paths() {
        let check = Duration::from_secs(2);
        assert_eq!(check_period(check, 0), check);
        assert_eq!(check_period(check, 500), check);
        assert_eq!(check_period(check, 1000), Duration::from_secs(4));
        assert_eq!(check_period(check, 5000), Duration::from_secs(20));
        assert_eq!(check_period(check, usize::MAX), CHECK_PER_PATH * u32::MAX);
    }

    /// A prober on `ip` (port chosen by the kernel), answering probes as the agent does.
    fn prober_on(ip: [u8; 4]) -> Arc<Prober> {
        let socket = bind(SocketAddr::from((Ipv4Addr::from(ip), 0))).unwrap();
        let prober = Arc::new(Prober::new(Some(Arc::new(socket)), None));
        tokio::spawn(respond::answer(prober.clone(), prober.v4.clone().unwrap()));
        prober
    }

    fn addr_of(prober: &Prober) -> SocketAddr {
        prober.v4.as_ref().unwrap().local_addr().unwrap()
    }

    /// `prober` with own key `own` and the peer at `peer` holding `key`.
    fn knows(prober: &Prober, own: &PrivateKey, peer: IpAddr, key: PublicKey) {
        lock(&prober.auth).update(Some(own), &BTreeMap::from([(peer, key)]));
    }

    #[tokio::test]
    async fn a_flood_of_probes_from_one_host_gets_at_most_the_limit_answered() {
        let responder = prober_on([127, 0, 0, 21]);
        let to = addr_of(&responder);
        // Blocking, off the runtime's thread: the responder answers meanwhile.
        let answered = tokio::task::spawn_blocking(move || {
            let flooder = std::net::UdpSocket::bind("127.0.0.22:0").unwrap();
            flooder
                .set_read_timeout(Some(Duration::from_millis(300)))
                .unwrap();
            let from = flooder.local_addr().unwrap().ip();
            for _ in 0..1000 {
                let probe = wire::probe([9; 16], 1280, from).unwrap();
                flooder.send_to(&probe, to).unwrap();
                // Paced, so that the responder's socket buffer holds every probe.
                std::thread::sleep(Duration::from_micros(200));
            }
            let mut answered = 0;
            let mut buf = [0u8; 256];
            while flooder.recv_from(&mut buf).is_ok() {
                answered += 1;
            }
            answered
        })
        .await
        .unwrap();
        // The burst, and what the bucket refilled while the flood was read (well under
        // a second here).
        let limit = limit::BURST + limit::RATE;
        assert!(
            (1..=limit as usize).contains(&answered),
            "{answered} of 1000 probes answered, the limit is {} at once",
            limit::BURST
        );
    }

    #[tokio::test]
    async fn an_ack_forged_on_the_path_does_not_widen_it() {
        let prober = prober_on([127, 0, 0, 23]);
        // On the path: it sees each probe (its nonce and size) where the peer would, and
        // answers it in the peer's name, untagged and with a tag of its own making,
        // though no probe ever reaches the peer.
        let on_path = std::net::UdpSocket::bind("127.0.0.24:0").unwrap();
        on_path
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let to = on_path.local_addr().unwrap();
        let (own, peer) = (
            PrivateKey::generate().unwrap(),
            PrivateKey::generate().unwrap(),
        );
        knows(&prober, &own, to.ip(), peer.public_key());
        let forger = std::thread::spawn(move || {
            let its_own = PrivateKey::generate().unwrap();
            let its_key =
                AuthKey::for_purpose(&its_own, &peer.public_key(), wire::ACK_LABEL).unwrap();
            let mut buf = vec![0u8; 65_536];
            let mut seen = 0;
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline {
                let Ok((n, from)) = on_path.recv_from(&mut buf) else {
                    continue;
                };
                if let Some(wire::Message::Probe { nonce, size, .. }) =
                    wire::decode(&buf[..n], to.ip())
                {
                    seen += 1;
                    let _ = on_path.send_to(&wire::ack(nonce, size), from);
                    let _ = on_path.send_to(&wire::tagged_ack(nonce, size, &its_key), from);
                }
            }
            seen
        });
        let acked = prober.round(to, &[1500, 1400, 1280]).await;
        assert_eq!(forger.join().unwrap(), 3, "the probes crossed the path");
        assert_eq!(acked, Vec::<u16>::new(), "sizes taken as crossing the path");
    }

    #[tokio::test]
    async fn the_peers_tagged_acks_count_and_replayed_ones_do_not() {
        let (a, b) = (prober_on([127, 0, 0, 25]), prober_on([127, 0, 0, 26]));
        let (ka, kb) = (
            PrivateKey::generate().unwrap(),
            PrivateKey::generate().unwrap(),
        );
        knows(&a, &ka, addr_of(&b).ip(), kb.public_key());
        knows(&b, &kb, addr_of(&a).ip(), ka.public_key());
        assert_eq!(
            a.round(addr_of(&b), &[1280]).await,
            vec![1280],
            "the peer's ack"
        );

        // Recorded on the path: the peer's tagged ack of a 1280-byte probe, replayed for
        // every later probe (its nonce is not theirs) and under another size (the tag
        // covers the size).
        let recorder = std::net::UdpSocket::bind("127.0.0.27:0").unwrap();
        recorder
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let to = recorder.local_addr().unwrap();
        knows(&a, &ka, to.ip(), kb.public_key());
        let pair = AuthKey::for_purpose(&kb, &ka.public_key(), wire::ACK_LABEL).unwrap();
        let recorded = wire::tagged_ack([5; 16], 1280, &pair);
        let replayer = std::thread::spawn(move || {
            let mut buf = vec![0u8; 65_536];
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline {
                let Ok((n, from)) = recorder.recv_from(&mut buf) else {
                    continue;
                };
                if let Some(wire::Message::Probe { nonce, .. }) = wire::decode(&buf[..n], to.ip()) {
                    let _ = recorder.send_to(&recorded, from);
                    // The recorded tag with this probe's nonce, claiming a larger size.
                    let mut moved = recorded.clone();
                    moved[9..25].copy_from_slice(&nonce);
                    let _ = recorder.send_to(&moved, from);
                }
            }
        });
        let acked = a.round(to, &[1500, 1400, 1280]).await;
        replayer.join().unwrap();
        assert_eq!(acked, Vec::<u16>::new(), "sizes taken as crossing the path");
    }

    #[tokio::test]
    async fn with_discovery_off_the_loop_is_never_woken() {
        let mut off = Handle::off();
        let woke = tokio::time::timeout(Duration::from_millis(50), off.mtus.changed()).await;
        assert!(woke.is_err(), "changed() must stay pending: {woke:?}");
    }
}
