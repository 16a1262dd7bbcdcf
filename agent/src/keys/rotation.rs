//! This node's key rotation (docs/key-rotation.md), as files in the state directory so a
//! crash mid-way resumes:
//! - `wireguard.key.next`: the next private key (0600);
//! - `rotation.json`: the announcement (`NextKey`: public key, switch moment, generation);
//! - `wireguard.key.generation`: the current key's generation (1 when absent).
//!
//! The controller announces the next key (the registry publishes it beside the unchanged
//! backend-data), peers stage it, and at the announced moment everyone switches: this node
//! sets its device's key, peers move the node's AllowedIPs to the new key. `promote`
//! makes the next key the key: one rename, so the key file always holds a key that is or
//! was published.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::Context;
use tracing::warn;
use weft_backends::model::NextKey;
use weft_crypto::atomic_file::read_bounded;
use weft_crypto::{read_key, write_new_key, PrivateKey};

/// How far ahead of the switch a rotation is announced: time for every peer to see the
/// announcement and stage the key.
pub const DEFAULT_LEAD: Duration = Duration::from_secs(3);

pub struct Rotation {
    key_path: PathBuf,
    pending: Option<(PrivateKey, NextKey)>,
    generation: u64,
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

/// `t` in milliseconds since the Unix epoch (0 before it).
pub(crate) fn ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Rotation {
    fn next_path(&self) -> PathBuf {
        sibling(&self.key_path, ".next")
    }

    fn announcement_path(&self) -> PathBuf {
        self.key_path.with_file_name("rotation.json")
    }

    fn generation_path(&self) -> PathBuf {
        sibling(&self.key_path, ".generation")
    }

    /// The rotation state next to the key file `key_path`: an unfinished rotation is
    /// resumed; one whose files are unreadable is dropped (logged) and the current key
    /// stays.
    pub fn load(key_path: &Path) -> Rotation {
        Self::load_explained(key_path).0
    }

    /// As `load`, also saying why an unfinished rotation was dropped, if one was.
    pub fn load_explained(key_path: &Path) -> (Rotation, Option<String>) {
        let mut r = Rotation {
            key_path: key_path.to_path_buf(),
            pending: None,
            generation: 1,
        };
        r.generation = read_bounded(&r.generation_path(), 64)
            .ok()
            .and_then(|g| g.trim().parse().ok())
            .unwrap_or(1);
        let announced = match read_bounded(&r.announcement_path(), 4096) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", r.announcement_path().display())),
        };
        let key = read_key(&r.next_path());
        let why = match (announced, key) {
            (Ok(None), Ok(None)) => None,
            (Ok(Some(text)), Ok(Some(key))) => match serde_json::from_str::<NextKey>(&text) {
                Ok(next) if next.public_key == key.public_key().to_string() => {
                    r.pending = Some((key, next));
                    None
                }
                Ok(_) => Some("the announcement does not match the next key".to_string()),
                Err(e) => Some(format!(
                    "{}: {}",
                    r.announcement_path().display(),
                    weft_backends::model::json_error(&e)
                )),
            },
            (Err(e), _) => Some(e),
            (_, Err(e)) => Some(e.to_string()),
            _ => Some("the next key or its announcement is missing".to_string()),
        };
        if let Some(why) = &why {
            r.drop_files(why);
        }
        (r, why)
    }

    fn drop_files(&mut self, why: &str) {
        warn!(
            reason = why,
            "dropping an unfinished key rotation; the current key stays"
        );
        let _ = std::fs::remove_file(self.next_path());
        let _ = std::fs::remove_file(self.announcement_path());
        self.pending = None;
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The announced rotation, if one is under way.
    pub fn pending(&self) -> Option<&NextKey> {
        self.pending.as_ref().map(|(_, n)| n)
    }

    /// Starts a rotation switching `lead` from now (or returns the one under way).
    pub fn start(&mut self, lead: Duration) -> anyhow::Result<NextKey> {
        if let Some((_, next)) = &self.pending {
            return Ok(next.clone());
        }
        let key = write_new_key(&self.next_path()).context("writing the next key")?;
        let next = NextKey {
            public_key: key.public_key().to_string(),
            switch_at_ms: ms(SystemTime::now() + lead),
            generation: self.generation + 1,
        };
        self.write_announcement(&next)?;
        self.pending = Some((key, next.clone()));
        Ok(next)
    }

    fn write_announcement(&self, next: &NextKey) -> anyhow::Result<()> {
        let path = self.announcement_path();
        weft_crypto::atomic_file::write_atomic(&path, &serde_json::to_vec(next)?, 0o600)
            .context("writing the rotation announcement")
    }

    /// Moves the switch `lead` from now (the announcement was not confirmed in time).
    pub fn postpone(&mut self, lead: Duration) -> anyhow::Result<NextKey> {
        let Some((_, next)) = self.pending.as_mut() else {
            anyhow::bail!("no rotation under way");
        };
        next.switch_at_ms = ms(SystemTime::now() + lead);
        let next = next.clone();
        self.write_announcement(&next)?;
        Ok(next)
    }

    /// The next key becomes the key (one rename); returns it.
    pub fn promote(&mut self) -> anyhow::Result<PrivateKey> {
        let Some((key, next)) = self.pending.take() else {
            anyhow::bail!("no rotation under way");
        };
        weft_crypto::atomic_file::rename_durably(&self.next_path(), &self.key_path)
            .context("moving the next key into place")?;
        self.generation = next.generation;
        let generation = format!("{}\n", self.generation);
        if let Err(e) = weft_crypto::atomic_file::write_atomic(
            &self.generation_path(),
            generation.as_bytes(),
            0o600,
        ) {
            tracing::warn!(error = %e, "recording the key generation");
        }
        let _ = std::fs::remove_file(self.announcement_path());
        Ok(key)
    }
}

/// Why a rotation cannot start.
#[derive(Debug, thiserror::Error)]
pub enum RotateError {
    #[error("only the wireguard and ipsec backends have keys to rotate")]
    NoKey,
    /// Writing the next key or its announcement failed (the chain names the file).
    #[error("{}", crate::report::error_text(.0))]
    State(anyhow::Error),
}

/// A request to rotate this node's key: from the control socket (answered on `reply`) or
/// from the registry (`request`: the id an operator's `weft keys rotate --all` wrote).
pub struct RotateRequest {
    pub reply: Option<tokio::sync::oneshot::Sender<Result<NextKey, RotateError>>>,
    pub request: Option<String>,
}

/// The key the control loop programs, with the rotation that may replace it and the
/// attributes this node publishes (which carry the announcement).
pub struct KeyState {
    pub key: PrivateKey,
    pub rotation: Rotation,
    pub attrs: crate::registry::LocalAttrs,
    pub updates: tokio::sync::mpsc::Sender<crate::registry::LocalAttrs>,
    /// The WireGuard listen port; `None` on backends without keys.
    pub listen_port: Option<u16>,
    pub lead: Duration,
    /// The key changed but is not published yet: it is, once the device carries it.
    pub unpublished: bool,
    /// This node's name in the registry (its entry's): what its key proof is made for.
    pub identity: String,
}

impl KeyState {
    /// Whether registry request `id` is new (and records it as handled, in the state
    /// directory, so a restarted agent does not rotate again for it).
    pub fn takes_request(&mut self, id: &str) -> bool {
        let path = self.rotation.key_path.with_file_name("rotate-request");
        if std::fs::read_to_string(&path).is_ok_and(|last| last.trim() == id) {
            return false;
        }
        if let Err(e) = std::fs::write(&path, format!("{id}\n")) {
            warn!(error = %e, path = %path.display(), "recording the rotation request");
        }
        true
    }

    /// The directory of the node's state: the key file's.
    pub fn state_dir(&self) -> std::path::PathBuf {
        self.rotation.key_path.with_file_name("")
    }

    /// Hands the attributes to the registry to publish.
    /// Publishes the proof that this node holds its key (backends that publish a key:
    /// wireguard and ipsec), if it does not already.
    pub async fn prove(&mut self) {
        if self.proof_for_key() {
            self.publish().await;
        }
    }

    /// Sets the published proof to one for the current key; whether it changed.
    fn proof_for_key(&mut self) -> bool {
        use weft_backends::netconf::BackendKind;
        if !matches!(
            self.attrs.backend,
            BackendKind::Wireguard | BackendKind::Ipsec
        ) {
            return false;
        }
        let proof = match weft_crypto::proof::prove(&self.key, &self.identity) {
            Ok(p) => Some(weft_crypto::proof::to_text(&p)),
            Err(e) => {
                warn!(error = %e, "no key proof: this node's key stays unproven");
                None
            }
        };
        let changed = self.attrs.key_proof != proof;
        self.attrs.key_proof = proof;
        changed
    }

    pub(crate) async fn publish(&self) {
        if self.updates.send(self.attrs.clone()).await.is_err() {
            warn!("the registry has stopped; the new attributes are not published");
        }
    }

    /// Announces a rotation (or returns the one under way).
    pub async fn start(&mut self) -> Result<NextKey, RotateError> {
        if self.listen_port.is_none() {
            return Err(RotateError::NoKey);
        }
        let next = self.rotation.start(self.lead).map_err(RotateError::State)?;
        if self.attrs.next_key.as_ref() != Some(&next) {
            self.attrs.next_key = Some(next.clone());
            self.publish().await;
            tracing::info!(next = %next.public_key, generation = next.generation, switch_at_ms = next.switch_at_ms, "key rotation announced");
        }
        Ok(next)
    }

    /// After a pass that programmed the device: publishes a switched key.
    pub async fn published_after_switch(&mut self) {
        if std::mem::take(&mut self.unpublished) {
            self.publish().await;
        }
    }

    /// When this node's announced switch is due.
    pub fn due(&self) -> Option<SystemTime> {
        self.rotation.pending().map(NextKey::switch_at)
    }

    /// The switch moment has come: with the announcement confirmed by the registry
    /// (`published` is what our lease there carries), the next key becomes the key and is
    /// published as backend-data; unconfirmed, the switch moves `lead` later and the
    /// announcement is sent again. True when the key changed.
    pub async fn switch(&mut self, published: Option<&NextKey>) -> bool {
        let Some(next) = self.rotation.pending().cloned() else {
            return false;
        };
        if published != Some(&next) {
            match self.rotation.postpone(self.lead) {
                Ok(later) => {
                    warn!(
                        switch_at_ms = later.switch_at_ms,
                        "the registry has not confirmed the announced key yet; switching later"
                    );
                    self.attrs.next_key = Some(later);
                    self.publish().await;
                }
                Err(e) => warn!(error = %e, "postponing the key switch"),
            }
            return false;
        }
        let Some(port) = self.listen_port else {
            return false;
        };
        match self.rotation.promote() {
            Ok(key) => {
                self.key = key;
                self.attrs.backend_data = Some(weft_backends::plan::wireguard_backend_data(
                    &self.key.public_key(),
                    port,
                ));
                // The IPv6 device (`EnableIPv6`) publishes the same key.
                if let Some(v6) = self
                    .attrs
                    .backend_v6_data
                    .as_mut()
                    .and_then(|v| v.as_object_mut())
                {
                    v6.insert("PublicKey".into(), self.key.public_key().to_string().into());
                }
                self.attrs.next_key = None;
                self.proof_for_key();
                // Published once the device carries the key (`published_after_switch`):
                // a peer that saw it earlier would send a handshake the device still
                // refuses, and WireGuard retries that only after 5 s.
                self.unpublished = true;
                tracing::info!(public_key = %self.key.public_key(), generation = self.rotation.generation(), "switched to the new key");
                true
            }
            Err(e) => {
                warn!(error = %e, "switching to the next key");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rotation_survives_a_restart_and_promotes_by_rename() {
        let dir = tempfile::tempdir().unwrap();
        let key_path = dir.path().join("wireguard.key");
        let (first, _) = weft_crypto::load_or_create(&key_path).unwrap();
        let mut r = Rotation::load(&key_path);
        assert_eq!((r.generation(), r.pending()), (1, None));
        let next = r.start(Duration::from_secs(3)).unwrap();
        assert_eq!(next.generation, 2);
        assert_ne!(next.public_key, first.public_key().to_string());
        // Again: the same rotation, not a second one.
        assert_eq!(r.start(Duration::from_secs(3)).unwrap(), next);

        // A crash: the next agent finds the same rotation.
        let mut again = Rotation::load(&key_path);
        assert_eq!(again.pending(), Some(&next));
        let key = again.promote().unwrap();
        assert_eq!(key.public_key().to_string(), next.public_key);
        let (on_disk, _) = weft_crypto::load_or_create(&key_path).unwrap();
        assert_eq!(on_disk.public_key(), key.public_key());
        let after = Rotation::load(&key_path);
        assert_eq!((after.generation(), after.pending()), (2, None));
    }

    #[test]
    fn unreadable_rotation_files_are_dropped_and_the_key_stays() {
        let dir = tempfile::tempdir().unwrap();
        let key_path = dir.path().join("wireguard.key");
        weft_crypto::load_or_create(&key_path).unwrap();
        let mut r = Rotation::load(&key_path);
        r.start(Duration::from_secs(3)).unwrap();
        std::fs::write(dir.path().join("rotation.json"), "{").unwrap();
        let dropped = Rotation::load(&key_path);
        assert_eq!(dropped.pending(), None);
        assert!(!dir.path().join("wireguard.key.next").exists());
    }
}
