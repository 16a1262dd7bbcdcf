//! What an ipsec node publishes as `backend-data`: its public key and epoch, and during
//! a rotation the next epoch with the moment every node starts sending with it; read back
//! with a clear error naming the field that is wrong.

use std::time::{Duration, SystemTime};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::{json, Value};
use weft_crypto::esp::{Epoch, NONCE_LEN};
use weft_crypto::PublicKey;

use crate::model::backend_data;
use crate::model::BackendDataError;

/// `backend-data` of the ipsec backend: `{"PublicKey":"…","Epoch":1,"Nonce":"…"}`, and
/// during a rotation `"NextEpoch":2,"NextNonce":"…","SwitchAt":<ms since the Unix epoch>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpsecData {
    pub public_key: PublicKey,
    pub epoch: Epoch,
    pub next: Option<NextEpoch>,
}

/// An announced next epoch and the moment every node starts sending with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextEpoch {
    pub epoch: Epoch,
    pub switch_at: SystemTime,
}

/// What this node publishes as `backend-data`.
pub fn backend_data(key: &PublicKey, epoch: &Epoch) -> Value {
    json!({
        "PublicKey": key.to_base64(),
        "Epoch": epoch.number,
        "Nonce": STANDARD.encode(epoch.nonce),
    })
}

/// What a rotating node publishes: its epoch and the next one, taking over at `switch_at`.
pub fn rotating_backend_data(key: &PublicKey, epoch: &Epoch, next: &NextEpoch) -> Value {
    let mut data = backend_data(key, epoch);
    let ms = next
        .switch_at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    if let Some(obj) = data.as_object_mut() {
        obj.insert("NextEpoch".into(), next.epoch.number.into());
        obj.insert("NextNonce".into(), STANDARD.encode(next.epoch.nonce).into());
        obj.insert("SwitchAt".into(), ms.into());
    }
    data
}

impl IpsecData {
    /// Decodes a node's published data; the error names the field and the value.
    pub fn decode(value: Option<&Value>) -> Result<Self, BackendDataError> {
        let obj = backend_data::object(value, r#"{"PublicKey":"…","Epoch":1,"Nonce":"…"}"#)?;
        let key = backend_data::public_key(obj)?;
        let epoch = epoch_of(obj, "Epoch", "Nonce")?;
        let next = match obj.get("NextEpoch") {
            None | Some(Value::Null) => None,
            Some(v) => {
                let next = epoch_of(obj, "NextEpoch", "NextNonce")?;
                // Any other number would give two of its inbound states one SPI (the
                // generation byte repeats every 256 epochs) or take an epoch back.
                if Some(next.number) != epoch.number.checked_add(1) {
                    return Err(BackendDataError::bad(
                        "NextEpoch",
                        v,
                        format!("is not Epoch + 1 ({})", epoch.number.saturating_add(1)),
                    ));
                }
                let epoch = next;
                let ms = match obj.get("SwitchAt") {
                    None => return Err(BackendDataError::NoField("SwitchAt")),
                    Some(v) => v.as_u64().ok_or_else(|| {
                        BackendDataError::bad("SwitchAt", v, "is not milliseconds since 1970")
                    })?,
                };
                Some(NextEpoch {
                    epoch,
                    switch_at: SystemTime::UNIX_EPOCH + Duration::from_millis(ms),
                })
            }
        };
        Ok(IpsecData {
            public_key: key,
            epoch,
            next,
        })
    }

    /// The epoch the node sends with at `now`: the next one from its moment on.
    pub fn effective(&self, now: SystemTime) -> Epoch {
        match self.next {
            Some(n) if now >= n.switch_at => n.epoch,
            _ => self.epoch,
        }
    }

    /// The epochs its peers may send to it with, or it with: the effective one, then, while
    /// an announcement stands, the other one — the next before its moment, the one being
    /// left after it (a peer that learns of the moment late still sends with that one, and
    /// must be heard).
    pub fn epochs(&self, now: SystemTime) -> Vec<Epoch> {
        let mut out = vec![self.effective(now)];
        if let Some(n) = self.next {
            out.push(if now < n.switch_at {
                n.epoch
            } else {
                self.epoch
            });
        }
        out
    }

    /// The epoch it sends with, once no announced moment is ahead (`None` while one is).
    pub fn in_force(&self, now: SystemTime) -> Option<Epoch> {
        self.upcoming(now).is_none().then(|| self.effective(now))
    }

    /// The announced moment, if it is still ahead.
    pub(super) fn upcoming(&self, now: SystemTime) -> Option<SystemTime> {
        self.next.map(|n| n.switch_at).filter(|t| now < *t)
    }
}

/// The epoch in fields `number` and `nonce` of a published object.
fn epoch_of(
    obj: &serde_json::Map<String, Value>,
    number: &'static str,
    nonce: &'static str,
) -> Result<Epoch, BackendDataError> {
    let n = match obj.get(number) {
        None => return Err(BackendDataError::NoField(number)),
        Some(v) => v
            .as_u64()
            .filter(|n| *n > 0)
            .ok_or_else(|| BackendDataError::bad(number, v, "is not a positive whole number"))?,
    };
    let bytes = match obj.get(nonce) {
        None => return Err(BackendDataError::NoField(nonce)),
        Some(v) => v
            .as_str()
            .and_then(|s| STANDARD.decode(s).ok())
            .and_then(|b| <[u8; NONCE_LEN]>::try_from(b.as_slice()).ok())
            .ok_or_else(|| BackendDataError::bad(nonce, v, "is not 16 bytes of standard base64"))?,
    };
    Ok(Epoch {
        number: n,
        nonce: bytes,
    })
}
