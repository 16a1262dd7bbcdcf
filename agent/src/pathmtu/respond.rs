//! The prober's responder: what comes to the probe port. A probe is answered within its
//! source's share (`limit`) and, when it names a key, only for a peer's; an ack counts
//! for its pending probe only when it is proven for it (address, size, the pair's tag).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tracing::debug;

use super::wire::{self, Message};
use super::{lock, Prober};

/// Answers probes and records acks, for as long as the socket works.
pub(super) async fn answer(prober: Arc<Prober>, socket: Arc<UdpSocket>) {
    let mut buf = vec![0u8; 65_536];
    loop {
        let (n, from) = match socket.recv_from(&mut buf).await {
            Ok(got) => got,
            Err(e) => {
                debug!(error = %e, "path MTU socket: receive failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let from = SocketAddr::new(from.ip().to_canonical(), from.port());
        if let Some(ack) = prober.on_datagram(&buf[..n], from, Instant::now()) {
            let _ = socket.send_to(&ack, from).await;
        }
    }
}

impl Prober {
    /// A datagram that came to the probe port from `from` at `now`: a probe is answered
    /// (the ack to send back), within the source's share and, when keyed, only for a
    /// peer's key; an ack marks its pending probe acknowledged if it is proven for it.
    pub(super) fn on_datagram(
        &self,
        datagram: &[u8],
        from: SocketAddr,
        now: Instant,
    ) -> Option<Vec<u8>> {
        match wire::decode(datagram, from.ip())? {
            Message::Probe {
                nonce,
                size,
                from: key,
            } => {
                if !lock(&self.limiter).allow(from.ip(), now) {
                    return None;
                }
                match key {
                    None => Some(wire::ack(nonce, size)),
                    // A key that is no peer's here gets no answer.
                    Some(key) => {
                        let pair = lock(&self.auth).key_of_peer(&key)?;
                        Some(wire::tagged_ack(nonce, size, &pair))
                    }
                }
            }
            Message::Ack { nonce, size, tag } => {
                if let Some(p) = lock(&self.pending).get_mut(&nonce) {
                    // Only from the address probed, for the size sent, and tagged by the
                    // peer when the probe was keyed.
                    let proven = match (&p.key, tag) {
                        (None, None) => true,
                        (Some(key), Some(tag)) => wire::tag_verifies(key, nonce, size, &tag),
                        _ => false,
                    };
                    if p.to == from.ip() && p.size == size && proven {
                        p.acked = true;
                    }
                }
                None
            }
        }
    }
}
