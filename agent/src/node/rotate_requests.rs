//! Key rotations the control loop is asked for: `weft keys rotate` on this node (through
//! the control socket) and an operator's `--all` or `--node` written in the registry. Each
//! takes the ML-KEM key along (with `PostQuantum`), then starts the node's own switch (a
//! new WireGuard key, or on ipsec a new epoch).

use tracing::{info, warn};

use super::run_loop::Controller;
use crate::keys::rotation::RotateRequest;

impl Controller<'_> {
    /// `weft keys rotate` on this node, through the control socket.
    pub(super) async fn rotate_on_request(&mut self, request: RotateRequest) {
        info!("key rotation: the control loop takes the request");
        self.rotate_ml_kem().await;
        let started = match self.dataplane.esp_epoch() {
            Some(_) => self.rotate_esp().await,
            None => self.keys.start().await,
        };
        let pending = self.keys.rotation.pending().cloned();
        self.inputs.snapshot.update(|s| s.rotating = pending);
        if let Err(e) = &started {
            warn!(error = %e, "cannot rotate the key");
        }
        if let Some(reply) = request.reply {
            let _ = reply.send(started);
        }
    }

    /// A key rotation takes the ML-KEM key along (with `PostQuantum`): the new one is in
    /// use before it is published.
    async fn rotate_ml_kem(&mut self) {
        match self.inputs.pq.rotate_key() {
            None => {}
            Some(Ok(ek)) => {
                self.keys.attrs.ml_kem_key = Some(ek);
                self.keys.publish().await;
            }
            Some(Err(e)) => {
                warn!(error = %format!("{e:#}"), "the ML-KEM key is not rotated (the rest of the rotation goes on)");
            }
        }
    }

    /// An operator's `weft keys rotate --all`, written in the registry.
    pub(super) async fn rotate_from_registry(&mut self, id: &str) {
        if self.keys.takes_request(id) {
            info!(request = ?id, "key rotation requested through the registry");
            self.rotate_ml_kem().await;
            let started = match self.dataplane.esp_epoch() {
                Some(_) => self.rotate_esp().await.map(|_| ()),
                None => self.keys.start().await.map(|_| ()),
            };
            if let Err(e) = started {
                warn!(error = %e, "cannot rotate the key");
            }
            let pending = self.keys.rotation.pending().cloned();
            self.inputs.snapshot.update(|s| s.rotating = pending);
        }
    }
}
