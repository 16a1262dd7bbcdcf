//! The pre-shared key and its rotation without restarting agents (docs/key-rotation.md).
//!
//! The PSK is the config's `Backend.PSK` unless a source gives one:
//! - Kubernetes: a Secret mounted as a directory (`--psk-dir`) with the files `psk`, and
//!   while a rotation is announced `next-psk` and `switch-at` (milliseconds since the
//!   Unix epoch); the kubelet updates the files within a minute of a Secret change;
//! - etcd: the key `<prefix>/weft/psk`, JSON `{"PSK": "…", "NextPSK": "…", "SwitchAt": ms}`.
//!
//! Every node uses `next-psk` from `switch-at` on: the same moment everywhere, announced
//! ahead of time, as for a node's key. A PSK only enters new handshakes, so sessions in
//! flight are untouched; each node starts new handshakes when its PSK changes.

use std::path::Path;
use std::time::{Duration, SystemTime};

use serde::Deserialize;
use weft_crypto::PresharedKey;

/// The PSK state a source gives.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PskState {
    pub current: Option<PresharedKey>,
    pub next: Option<(PresharedKey, SystemTime)>,
}

impl PskState {
    /// The PSK in force at `now`.
    pub fn effective(&self, now: SystemTime) -> Option<PresharedKey> {
        match &self.next {
            Some((next, at)) if now >= *at => Some(next.clone()),
            _ => self.current.clone(),
        }
    }

    /// When the PSK changes next, if a change is announced and still ahead.
    pub fn next_switch(&self, now: SystemTime) -> Option<SystemTime> {
        self.next.as_ref().map(|(_, at)| *at).filter(|at| *at > now)
    }
}

/// `net` with the PSK `state` puts in force at `now` (the config's when there is no state):
/// WireGuard's per-peer PSK, or the salt of every ipsec key derivation (the Secret's 32
/// random bytes, instead of the ConfigMap's text).
pub fn effective_net<'a>(
    net: &'a weft_backends::netconf::NetConf,
    state: Option<&PskState>,
    now: SystemTime,
) -> std::borrow::Cow<'a, weft_backends::netconf::NetConf> {
    use weft_backends::netconf::{Backend, IpsecPsk};
    let Some(state) = state else {
        return std::borrow::Cow::Borrowed(net);
    };
    let psk = state.effective(now);
    match &net.backend {
        Backend::Wireguard(wg) if wg.psk != psk => {
            let mut net = net.clone();
            if let Backend::Wireguard(wg) = &mut net.backend {
                wg.psk = psk;
            }
            std::borrow::Cow::Owned(net)
        }
        Backend::Ipsec(conf) => {
            let salt = psk.map(|k| IpsecPsk(k.as_bytes().to_vec()));
            if conf.psk == salt {
                return std::borrow::Cow::Borrowed(net);
            }
            let mut net = net.clone();
            if let Backend::Ipsec(conf) = &mut net.backend {
                conf.psk = salt;
            }
            std::borrow::Cow::Owned(net)
        }
        _ => std::borrow::Cow::Borrowed(net),
    }
}

/// The PSK sources, as the control loop follows them.
pub struct PskSources {
    pub dir: Option<std::path::PathBuf>,
    pub registry: tokio::sync::watch::Receiver<Option<String>>,
    /// The state in force, from the directory if one is given, else from the registry.
    pub state: Option<PskState>,
}

impl PskSources {
    /// The sources, with no state read yet.
    pub fn new(
        dir: Option<std::path::PathBuf>,
        registry: tokio::sync::watch::Receiver<Option<String>>,
    ) -> PskSources {
        PskSources {
            dir,
            registry,
            state: None,
        }
    }

    /// Reads the sources again; true if the state changed. A bad source is logged and the
    /// last good state stays.
    pub fn refresh(&mut self) -> bool {
        let fresh = match &self.dir {
            Some(dir) => read_dir(dir),
            None => match self.registry.borrow_and_update().as_deref() {
                Some(v) => parse_etcd(v).map(Some),
                None => Ok(None),
            },
        };
        match fresh {
            Ok(state) if state != self.state => {
                tracing::info!(
                    rotation = ?state.as_ref().and_then(|s| s.next.as_ref()).map(|(_, at)| at),
                    "PSK source changed"
                );
                self.state = state;
                true
            }
            Ok(_) => false,
            Err(e) => {
                tracing::warn!(error = %e, "ignoring the PSK source; the PSK in force stays");
                false
            }
        }
    }
}

fn at_ms(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

/// What is wrong with a PSK source; names the file or field.
#[derive(Debug, thiserror::Error)]
pub enum PskError {
    #[error("reading {}: {source}", path.display())]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{what} is not a pre-shared key (base64 of 32 bytes, as `wg genpsk` prints): {source}"
    )]
    NotAKey {
        what: String,
        #[source]
        source: weft_crypto::KeyError,
    },
    #[error("{}/switch-at {:?} is not milliseconds since the Unix epoch", dir.display(), weft_backends::model::clip(value))]
    SwitchAt {
        dir: std::path::PathBuf,
        value: String,
    },
    #[error("{}: next-psk and switch-at go together", dir.display())]
    Incomplete { dir: std::path::PathBuf },
    #[error("the PSK in etcd is not {{\"PSK\": …, \"NextPSK\": …, \"SwitchAt\": ms}}: {}", no_values(.0))]
    EtcdJson(#[source] serde_json::Error),
    #[error("NextPSK needs SwitchAt")]
    NextWithoutSwitchAt,
    #[error("the PSK in etcd is {size} bytes, more than the {MAX_ETCD_BYTES} its JSON holds")]
    TooLarge { size: usize },
}

/// serde's message without the values it quotes: a PSK is a secret, even a malformed one.
fn no_values(e: &serde_json::Error) -> String {
    weft_backends::model::json_error_showing(e, |_| "…".to_string())
}

fn psk(text: &str, what: &str) -> Result<PresharedKey, PskError> {
    text.trim().parse().map_err(|source| PskError::NotAKey {
        what: what.to_string(),
        source,
    })
}

/// Reads a Secret mounted as a directory. `Ok(None)` if the directory has no `psk`.
pub fn read_dir(dir: &Path) -> Result<Option<PskState>, PskError> {
    let read = |name: &str| -> Result<Option<String>, PskError> {
        // A PSK is 44 characters, a moment 13 digits.
        match weft_crypto::atomic_file::read_bounded(&dir.join(name), 1024) {
            Ok(t) => Ok(Some(t)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(PskError::Read {
                path: dir.join(name),
                source,
            }),
        }
    };
    let Some(current) = read("psk")? else {
        return Ok(None);
    };
    let current = psk(&current, &format!("{}/psk", dir.display()))?;
    let next = match (read("next-psk")?, read("switch-at")?) {
        (Some(n), Some(at)) => {
            let key = psk(&n, &format!("{}/next-psk", dir.display()))?;
            let ms: u64 = at.trim().parse().map_err(|_| PskError::SwitchAt {
                dir: dir.to_path_buf(),
                value: at.trim().to_string(),
            })?;
            Some((key, at_ms(ms)))
        }
        (None, None) => None,
        _ => {
            return Err(PskError::Incomplete {
                dir: dir.to_path_buf(),
            })
        }
    };
    Ok(Some(PskState {
        current: Some(current),
        next,
    }))
}

#[derive(Deserialize)]
struct EtcdPsk {
    #[serde(rename = "PSK")]
    psk: String,
    #[serde(rename = "NextPSK", default)]
    next_psk: Option<String>,
    #[serde(rename = "SwitchAt", default)]
    switch_at: Option<u64>,
}

/// The largest PSK value read from etcd: two keys and a moment take about 140 bytes.
pub const MAX_ETCD_BYTES: usize = 4096;

/// Parses the etcd key's value.
pub fn parse_etcd(value: &str) -> Result<PskState, PskError> {
    if value.len() > MAX_ETCD_BYTES {
        return Err(PskError::TooLarge { size: value.len() });
    }
    let v: EtcdPsk = serde_json::from_str(value).map_err(PskError::EtcdJson)?;
    let current = psk(&v.psk, "PSK")?;
    let next = match (v.next_psk, v.switch_at) {
        (Some(n), Some(at)) => Some((psk(&n, "NextPSK")?, at_ms(at))),
        (None, _) => None,
        (Some(_), None) => return Err(PskError::NextWithoutSwitchAt),
    };
    Ok(PskState {
        current: Some(current),
        next,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_psk_takes_over_at_its_moment() {
        let (a, b) = (
            PresharedKey::from_bytes([1; 32]),
            PresharedKey::from_bytes([2; 32]),
        );
        let t = at_ms(1_000_000);
        let s = PskState {
            current: Some(a.clone()),
            next: Some((b.clone(), t)),
        };
        assert_eq!(s.effective(t - Duration::from_millis(1)), Some(a));
        assert_eq!(s.effective(t), Some(b));
        assert_eq!(s.next_switch(t - Duration::from_secs(1)), Some(t));
        assert_eq!(s.next_switch(t), None);
    }

    /// The Secret's PSK is ipsec's salt too (the ConfigMap's `PSK` is where flannel put
    /// it; a Secret keeps it out of the ConfigMap), and its rotation moves it at the moment.
    #[test]
    fn the_secrets_psk_salts_ipsec_and_follows_its_rotation() {
        use weft_backends::netconf::{parse, Backend, IpsecPsk};
        let net = parse(r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec"}}"#).unwrap();
        let (a, b) = (
            PresharedKey::from_bytes([4; 32]),
            PresharedKey::from_bytes([5; 32]),
        );
        let t = at_ms(2_000_000);
        let state = PskState {
            current: Some(a),
            next: Some((b, t)),
        };
        let salt = |now| match &effective_net(&net, Some(&state), now).backend {
            Backend::Ipsec(conf) => conf.psk.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            salt(t - Duration::from_secs(1)),
            Some(IpsecPsk(vec![4; 32]))
        );
        assert_eq!(salt(t), Some(IpsecPsk(vec![5; 32])));
        assert!(matches!(
            effective_net(&net, None, t),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[test]
    fn sources_parse_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(read_dir(dir.path()), Ok(None)));
        let key = PresharedKey::from_bytes([3; 32]).to_base64_secret();
        std::fs::write(dir.path().join("psk"), format!("{key}\n")).unwrap();
        assert!(read_dir(dir.path()).unwrap().unwrap().next.is_none());
        std::fs::write(dir.path().join("next-psk"), &key).unwrap();
        let e = read_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("go together"), "{e}");
        std::fs::write(dir.path().join("switch-at"), "soon").unwrap();
        let e = read_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("switch-at \"soon\""), "{e}");
        std::fs::write(dir.path().join("switch-at"), "1795000000000").unwrap();
        assert_eq!(
            read_dir(dir.path()).unwrap().unwrap().next.unwrap().1,
            at_ms(1_795_000_000_000)
        );
        let e = parse_etcd(r#"{"PSK": "short"}"#).unwrap_err().to_string();
        assert!(e.contains("PSK is not a pre-shared key"), "{e}");
        let ok = parse_etcd(&format!(
            r#"{{"PSK": "{key}", "NextPSK": "{key}", "SwitchAt": 5}}"#
        ))
        .unwrap();
        assert_eq!(ok.next.unwrap().1, at_ms(5));
    }

    #[test]
    fn a_malformed_etcd_value_is_not_echoed() {
        let e = parse_etcd(r#"{"PSK": "a-secret-that-is-not-base64", "SwitchAt": "a-secret-too"}"#)
            .unwrap_err()
            .to_string();
        assert!(!e.contains("a-secret"), "{e}");
        assert!(e.contains("the PSK in etcd"), "{e}");
    }
}
