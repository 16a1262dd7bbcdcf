//! The ipsec backend's part of net-conf.json: `ESPProposal`, flannel's `PSK` and the rest
//! of `IpsecConf`.

use std::fmt;

use super::error::ConfigError;
use super::fields::Fields;

/// The ESP algorithm of the ipsec backend, from flannel's strongSwan-style `ESPProposal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EspAlgorithm {
    /// `aes128gcm16…` (flannel's default proposal).
    #[default]
    Aes128Gcm,
    /// `aes256gcm16…`.
    Aes256Gcm,
    /// `chacha20poly1305…`.
    ChaCha20Poly1305,
}

impl EspAlgorithm {
    const PROPOSALS: [(&'static str, EspAlgorithm); 3] = [
        ("aes128gcm16", EspAlgorithm::Aes128Gcm),
        ("aes256gcm16", EspAlgorithm::Aes256Gcm),
        ("chacha20poly1305", EspAlgorithm::ChaCha20Poly1305),
    ];

    /// The kernel's AEAD name (`ip xfrm state` prints it).
    pub fn kernel_name(self) -> &'static str {
        match self {
            EspAlgorithm::Aes128Gcm | EspAlgorithm::Aes256Gcm => "rfc4106(gcm(aes))",
            EspAlgorithm::ChaCha20Poly1305 => "rfc7539esp(chacha20,poly1305)",
        }
    }

    /// Key material in bytes: the cipher key and the 4-byte salt the ESP AEADs take.
    pub fn key_len(self) -> usize {
        match self {
            EspAlgorithm::Aes128Gcm => 16 + 4,
            EspAlgorithm::Aes256Gcm | EspAlgorithm::ChaCha20Poly1305 => 32 + 4,
        }
    }

    /// The integrity check value's length in bits.
    pub fn icv_bits(self) -> u32 {
        128
    }

    /// The proposal's first word (`aes128gcm16`).
    pub fn as_str(self) -> &'static str {
        Self::PROPOSALS
            .iter()
            .find(|(_, a)| *a == self)
            .map_or("aes128gcm16", |(text, _)| text)
    }

    /// `aes128gcm16-sha256-prfsha256-ecp256` and the like: the first word picks the
    /// algorithm; the rest (IKE's PRF and group, which weft has no use for) may be anything.
    pub fn from_proposal(text: &str) -> Option<Self> {
        let lower = text.trim().to_ascii_lowercase();
        let first = lower.split('-').next().unwrap_or_default();
        Self::PROPOSALS
            .iter()
            .find(|(word, _)| *word == first)
            .map(|(_, a)| *a)
    }
}

/// flannel's ipsec `PSK`: at least 96 characters; weft salts its key derivation with it.
/// Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct IpsecPsk(pub Vec<u8>);

impl fmt::Debug for IpsecPsk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpsecPsk({} bytes, not shown)", self.0.len())
    }
}

/// flannel's PSK rule.
pub(super) const IPSEC_PSK_MIN: usize = 96;

/// The ipsec backend: kernel ESP in tunnel mode through the XFRM interface `flannel-ipsec`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpsecConf {
    pub psk: Option<IpsecPsk>,
    /// ESP in UDP (port 4500) instead of IP protocol 50.
    pub udp_encap: bool,
    pub algorithm: EspAlgorithm,
    /// Underlay MTU; `None` = the external interface's.
    pub mtu: Option<u32>,
    /// weft's `RekeyAfter` (seconds): each node rotates to a new epoch (new keys for every
    /// pair) once its epoch is this old. `None`: only on request or lost state.
    pub rekey_after: Option<std::time::Duration>,
    /// `PostQuantum`: each pair's keys also from an ML-KEM-768 exchange between the two
    /// agents.
    pub post_quantum: bool,
    /// weft's `RefuseClear`: no pair of this node ever runs in clear, not even with a peer
    /// that publishes no encrypting backend during a change (`plan::mixed`).
    pub refuse_clear: bool,
}

pub(super) fn ipsec_psk(f: &mut Fields<'_, '_>) -> Option<IpsecPsk> {
    let text = f.string("PSK")?;
    let chars = text.chars().count();
    if chars < IPSEC_PSK_MIN {
        f.push(ConfigError::invalid(
            f.path("PSK"),
            format!("<{chars} characters, not shown>"),
            format!("an ipsec PSK must be at least {IPSEC_PSK_MIN} characters (flannel's rule); generate one with `openssl rand -hex 48`"),
        ));
        return None;
    }
    Some(IpsecPsk(text.as_bytes().to_vec()))
}

pub(super) fn esp_proposal(f: &mut Fields<'_, '_>) -> Option<EspAlgorithm> {
    let text = f.string("ESPProposal")?;
    let found = EspAlgorithm::from_proposal(text);
    if found.is_none() {
        f.push(ConfigError::invalid(
            f.path("ESPProposal"),
            format!("{:?}", crate::model::clip(text)),
            "valid: aes128gcm16…, aes256gcm16…, chacha20poly1305… (a strongSwan ESP proposal such as \"aes128gcm16-sha256-prfsha256-ecp256\"; the first word picks the algorithm)",
        ));
    }
    found
}
