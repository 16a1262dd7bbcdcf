//! The task that runs every post-quantum pair of this node: it keeps one `Exchange` per
//! peer the plan lists, carries their datagrams on its UDP sockets, and tells the control
//! loop the PSKs in force.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};
use weft_crypto::pq::{Exchange, KemKeyPair, Message, Own, Timing, MAX_LEN};
use weft_crypto::{PrivateKey, PublicKey};

use super::list::PqList;
use super::saved::{Kept, Saved};
use super::{PairStatus, Published};

mod left;
mod listing;
mod publish;

use publish::secret;

/// One pair: its exchange and where its peer's agent listens.
struct Pair {
    node: String,
    address: IpAddr,
    /// The peer's public IP: a `Classical` notice goes there too (`fall_back`).
    underlay: IpAddr,
    ex: Exchange,
    /// When to poll the exchange next (its entry in `Manager::timers`).
    wake_at: u64,
    /// The moment its committed PSK takes over (its entry in `Manager::switches`).
    switch_at: Option<u64>,
    rounds: u64,
    /// The round of the PSK last seen in force (a new one is a completed round).
    in_force: Option<u64>,
}

impl Pair {
    /// Whether the pair has a post-quantum PSK in force or committed.
    fn holds_psk(&self) -> bool {
        self.in_force.is_some() || self.ex.pending().is_some()
    }
}

pub(super) struct Manager {
    own: Own,
    own_public: PublicKey,
    timing: Timing,
    port: u16,
    v4: Option<UdpSocket>,
    v6: Option<UdpSocket>,
    /// On the public IPs, for `classical` notices alone (none: `v4`/`v6` take them).
    notice4: Option<UdpSocket>,
    notice6: Option<UdpSocket>,
    saved: Saved,
    published: watch::Sender<Published>,
    status: Arc<Mutex<BTreeMap<PublicKey, PairStatus>>>,
    pairs: HashMap<PublicKey, Pair>,
    /// Every pair's `wake_at`, in order: what is due is found without a look at the rest.
    timers: BTreeSet<(u64, PublicKey)>,
    /// Every pair's `switch_at`, in order.
    switches: BTreeSet<(u64, PublicKey)>,
    /// Pairs that may have changed since the last `publish` (a datagram, a poll, a new
    /// key, a switch moment come): only these are looked at again, so a datagram costs
    /// the same with 10 peers as with 10,000.
    dirty: HashSet<PublicKey>,
    /// Saved PSKs not yet given back to a pair (its peer not listed yet), and the state
    /// of pairs whose peer left the listing (`left`).
    restored: BTreeMap<PublicKey, Kept>,
    /// Peers that left the listing with a PSK, and when: their state waits in `restored`
    /// and their PSK stays published, so a peer back with the same key (a registry
    /// restored from a snapshot, a lease lost and claimed again) has the PSK it never
    /// stopped using. At most `LEFT_MAX`, for `LEFT_KEPT_MS`.
    left: BTreeMap<PublicKey, u64>,
    /// Each pair's PSK in force and the one committed to follow it: what the saved file is
    /// to hold.
    kept: BTreeMap<PublicKey, Kept>,
    /// `kept` changed since the file was written (written at most once a millisecond per
    /// pair, so a period's burst of rounds with many peers costs a few writes).
    unsaved: bool,
    stored_at: Option<std::time::Instant>,
    /// The plan's last list, to rebuild the pairs under a new own key.
    listed: PqList,
}

/// The task's sockets: the rounds' (one per family), and the notices' on the public IPs.
pub(super) struct Sockets {
    pub(super) v4: Option<UdpSocket>,
    pub(super) v6: Option<UdpSocket>,
    pub(super) notice4: Option<UdpSocket>,
    pub(super) notice6: Option<UdpSocket>,
}

/// What wakes the task besides its sockets and its timers.
pub(super) struct Inputs {
    pub(super) peers: watch::Receiver<PqList>,
    pub(super) fall_back: mpsc::Receiver<String>,
    pub(super) own_key: mpsc::Receiver<PrivateKey>,
    pub(super) own_kem: mpsc::Receiver<KemKeyPair>,
}

/// The saved file is written at most once this long per pair it holds, and at least this
/// often (`SAVE_EVERY_MAX`). A commit is saved before its moment (the switch delay) unless
/// the pairs are more than the delay in milliseconds; a restart that loses one puts back
/// the PSK before it, and the pair falls back and runs a new round.
const SAVE_EVERY_PAIR: Duration = Duration::from_millis(1);
const SAVE_EVERY_MAX: Duration = Duration::from_secs(1);

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Manager {
    pub(super) fn new(
        config: super::Config,
        sockets: Sockets,
        published: watch::Sender<Published>,
        status: Arc<Mutex<BTreeMap<PublicKey, PairStatus>>>,
    ) -> Manager {
        let own_public = config.own.key.public_key();
        let saved = Saved::in_dir(&config.state_dir);
        let restored = saved.load(&own_public);
        if !restored.is_empty() {
            info!(pairs = restored.len(), path = %saved.path().display(), "post-quantum PSKs restored from the last run");
        }
        // In force from the first pass on, before the plan has listed any peer: a pass
        // without them would give the peers the classical PSK for a moment.
        let now = now_ms();
        published.send_replace(Published {
            psks: Arc::new(
                (restored.iter())
                    .filter_map(|(k, kept)| Some((*k, secret(kept.in_force(now)?, None))))
                    .collect(),
            ),
            own: Some(own_public),
            next_switch: None,
        });
        Manager {
            own: config.own,
            own_public,
            timing: config.timing,
            port: config.port,
            v4: sockets.v4,
            v6: sockets.v6,
            notice4: sockets.notice4,
            notice6: sockets.notice6,
            saved,
            published,
            status,
            pairs: HashMap::new(),
            timers: BTreeSet::new(),
            switches: BTreeSet::new(),
            // The first publish drops what no listed peer took back by then.
            dirty: restored.keys().copied().collect(),
            kept: restored.clone(),
            unsaved: false,
            stored_at: None,
            restored,
            left: BTreeMap::new(),
            listed: PqList::default(),
        }
    }

    pub(super) async fn run(mut self, mut inputs: Inputs) {
        let mut buf4 = vec![0u8; 2 * MAX_LEN];
        let mut buf6 = vec![0u8; 2 * MAX_LEN];
        let mut notice_buf = vec![0u8; 2 * MAX_LEN];
        loop {
            let wake = self.timers.first().map(|(at, _)| *at);
            let pending = self.published.borrow().next_switch;
            let wait = wake
                .map(|w| Duration::from_millis(w.saturating_sub(now_ms())))
                .into_iter()
                .chain(pending.map(|at| {
                    at.duration_since(SystemTime::now())
                        .unwrap_or(Duration::ZERO)
                }))
                .chain(self.save_due())
                .min()
                .unwrap_or(Duration::from_secs(3600));
            tokio::select! {
                got = recv(self.v4.as_ref(), &mut buf4) => {
                    if let Some((n, from)) = got {
                        let bytes = buf4[..n].to_vec();
                        self.datagram(&bytes, from).await;
                    }
                }
                got = recv(self.v6.as_ref(), &mut buf6) => {
                    if let Some((n, from)) = got {
                        let bytes = buf6[..n].to_vec();
                        self.datagram(&bytes, from).await;
                    }
                }
                got = recv_either(self.notice4.as_ref(), self.notice6.as_ref(), &mut notice_buf) => {
                    if let Some((n, from)) = got {
                        let bytes = notice_buf[..n].to_vec();
                        if Message::is_classical_notice(&bytes) {
                            self.datagram(&bytes, from).await;
                        } else {
                            debug!(from = %from, "post-quantum datagram refused: on a public IP only a classical notice is taken");
                        }
                    }
                }
                changed = inputs.peers.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let list = inputs.peers.borrow_and_update().clone();
                    self.take_list(list);
                }
                Some(node) = inputs.fall_back.recv() => self.fall_back(&node).await,
                Some(key) = inputs.own_key.recv() => self.set_own_key(key),
                Some(kem) = inputs.own_kem.recv() => self.set_own_kem(kem),
                () = tokio::time::sleep(wait) => {}
            }
            self.poll_due().await;
            self.publish();
        }
    }

    /// This node's X25519 key changed: every pair is a new pair, classical until its round.
    fn set_own_key(&mut self, key: PrivateKey) {
        self.own_public = key.public_key();
        self.own.key = key;
        let keys: Vec<PublicKey> = self.pairs.keys().copied().collect();
        for key in keys {
            self.forget(key);
        }
        self.restored.clear();
        self.left.clear();
        let listed = std::mem::take(&mut self.listed);
        self.set_peers(&[], listed.peers(), true);
        self.listed = listed;
    }

    /// This node has a new ML-KEM key pair: rounds begun under the old one still complete
    /// (it is kept as the previous one), and every pair this node leads begins a round to
    /// leave it behind at once; the peers lead theirs once they see the new key published.
    fn set_own_kem(&mut self, kem: KemKeyPair) {
        info!(key = ?kem.encaps_key(), "ML-KEM-768 key rotated: new rounds with every peer");
        self.own.previous_kem = Some(std::mem::replace(&mut self.own.kem, kem));
        let now = now_ms();
        let keys: Vec<PublicKey> = self.pairs.keys().copied().collect();
        for key in keys {
            if let Some(pair) = self.pairs.get_mut(&key) {
                pair.ex.own_kem_changed(now);
            }
            self.wake(key, 0);
        }
    }

    /// Moves `key`'s pair's next poll to `at`, and counts it as changed.
    fn wake(&mut self, key: PublicKey, at: u64) {
        if let Some(pair) = self.pairs.get_mut(&key) {
            self.timers.remove(&(pair.wake_at, key));
            pair.wake_at = at;
            self.timers.insert((at, key));
            self.dirty.insert(key);
        }
    }

    /// Drops `key`'s pair, its timers with it; the next publish drops its PSK (unless the
    /// pair is kept for its peer's return).
    fn forget(&mut self, key: PublicKey) {
        if let Some(pair) = self.pairs.remove(&key) {
            self.timers.remove(&(pair.wake_at, key));
            if let Some(at) = pair.switch_at {
                self.switches.remove(&(at, key));
            }
        }
        self.dirty.insert(key);
    }

    /// The pair of `node` cannot handshake: classical on this node, and a notice to the
    /// peer, through the tunnel and to its public IP (the tunnel may be what is broken), so
    /// that it goes classical too.
    async fn fall_back(&mut self, node: &str) {
        let Some((key, pair)) = self.pairs.iter_mut().find(|(_, p)| p.node == node) else {
            return;
        };
        // Classical already (its saved state lost, say): the peer may still hold a PSK.
        match pair.holds_psk() {
            true => {
                warn!(peer = %pair.node, "the pair does not handshake with its post-quantum PSK: back to the classical PSK until a new round completes; the peer is told")
            }
            false => {
                warn!(peer = %pair.node, "the pair does not handshake: telling the peer this node is classical, in case it holds a post-quantum PSK")
            }
        }
        let notice = pair.ex.fall_back(now_ms());
        let (address, underlay) = (pair.address, pair.underlay);
        let key = *key;
        self.wake(key, 0);
        let port = self.port;
        send(
            self.v4.as_ref(),
            self.v6.as_ref(),
            &notice,
            SocketAddr::new(address, port),
        )
        .await;
        if underlay != address {
            // From a public IP, where the peer takes it: the rounds' sockets would send
            // from a tunnel address, which is no source on the underlay.
            let v4 = self.notice4.as_ref().or(self.v4.as_ref());
            let v6 = self.notice6.as_ref().or(self.v6.as_ref());
            send(v4, v6, &notice, SocketAddr::new(underlay, port)).await;
        }
    }

    /// A datagram from `from`: to the pair of the key it names, if it comes from that
    /// peer's address for rounds (its tunnel address; an ipsec peer's public IP).
    async fn datagram(&mut self, bytes: &[u8], from: SocketAddr) {
        let refused = |why: &dyn std::fmt::Display| {
            debug!(from = %from, reason = %why, "post-quantum datagram refused");
        };
        let (sender, receiver) = match Message::addressed(bytes) {
            Ok(keys) => keys,
            Err(e) => return refused(&e),
        };
        if receiver != self.own_public {
            return refused(&"addressed to another key");
        }
        let Some(pair) = self.pairs.get_mut(&sender) else {
            return refused(&"from a key with no pair here");
        };
        let ip = from.ip().to_canonical();
        if ip != pair.address && ip != pair.underlay {
            return refused(&format!(
                "not from {}'s address for rounds {} nor its public IP {}",
                pair.node, pair.address, pair.underlay
            ));
        }
        let had_psk = pair.holds_psk();
        let now = now_ms();
        let to = SocketAddr::new(pair.address, self.port);
        self.dirty.insert(sender);
        match pair.ex.receive(&self.own, bytes, now) {
            Ok(replies) => {
                if had_psk && Message::is_classical_notice(bytes) {
                    warn!(peer = %pair.node, "the peer went back to the classical PSK (its pair could not handshake): so does this node, until a new round completes");
                }
                self.wake(sender, now);
                for reply in replies {
                    send(self.v4.as_ref(), self.v6.as_ref(), &reply, to).await;
                }
            }
            Err(e) => {
                debug!(peer = %pair.node, reason = %e, "post-quantum message refused");
                let (node, why) = (pair.node.clone(), e.to_string());
                self.note(&sender, &node, |s| s.last_refusal = Some(why));
            }
        }
    }

    /// Polls every pair whose moment came, and sends what each asks.
    async fn poll_due(&mut self) {
        let now = now_ms();
        let mut out: Vec<(Vec<u8>, SocketAddr)> = Vec::new();
        while let Some(&(at, key)) = self.timers.first() {
            if at > now {
                break;
            }
            self.timers.pop_first();
            let Some(pair) = self.pairs.get_mut(&key) else {
                continue;
            };
            pair.wake_at = match pair.ex.poll(now) {
                Ok(poll) => {
                    let to = SocketAddr::new(pair.address, self.port);
                    out.extend(poll.send.into_iter().map(|d| (d, to)));
                    poll.wake_at.max(now + 1)
                }
                Err(e) => {
                    warn!(peer = %pair.node, error = %e, "post-quantum round not started");
                    now + self.timing.retry
                }
            };
            self.timers.insert((pair.wake_at, key));
            self.dirty.insert(key);
        }
        for (datagram, to) in out {
            send(self.v4.as_ref(), self.v6.as_ref(), &datagram, to).await;
        }
    }

    fn note(&self, key: &PublicKey, node: &str, f: impl FnOnce(&mut PairStatus)) {
        if let Ok(mut status) = self.status.lock() {
            let s = status.entry(*key).or_default();
            s.node = node.to_string();
            f(s);
        }
    }
}

async fn recv(socket: Option<&UdpSocket>, buf: &mut [u8]) -> Option<(usize, SocketAddr)> {
    match socket {
        Some(s) => match s.recv_from(buf).await {
            Ok(got) => Some(got),
            Err(e) => {
                debug!(error = %e, "post-quantum socket: receive failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                None
            }
        },
        None => std::future::pending().await,
    }
}

/// A datagram from whichever of two sockets has one.
async fn recv_either(
    a: Option<&UdpSocket>,
    b: Option<&UdpSocket>,
    buf: &mut [u8],
) -> Option<(usize, SocketAddr)> {
    match (a, b) {
        (Some(a), Some(b)) => {
            tokio::select! {
                _ = a.readable() => {}
                _ = b.readable() => {}
            }
            for s in [a, b] {
                match s.try_recv_from(buf) {
                    Ok(got) => return Some(got),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => {
                        debug!(error = %e, "post-quantum notice socket: receive failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        return None;
                    }
                }
            }
            None
        }
        (a, b) => recv(a.or(b), buf).await,
    }
}

async fn send(v4: Option<&UdpSocket>, v6: Option<&UdpSocket>, datagram: &[u8], to: SocketAddr) {
    let socket = if to.is_ipv4() { v4 } else { v6 };
    let Some(socket) = socket else {
        debug!(to = %to, "post-quantum datagram not sent: no socket of its family");
        return;
    };
    if let Err(e) = socket.send_to(datagram, to).await {
        debug!(to = %to, error = %e, "post-quantum datagram not sent");
    }
}
