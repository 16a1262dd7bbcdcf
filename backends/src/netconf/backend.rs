//! The `Backend` section of net-conf.json: a closed set of backend types, each with its own
//! keys and defaults.

use std::fmt;
use std::str::FromStr;

use serde_json::{json, Map, Value};
use weft_crypto::PresharedKey;

use super::error::ConfigError;
use super::fields::Fields;
use super::ipsec::{esp_proposal, ipsec_psk};
pub use super::ipsec::{EspAlgorithm, IpsecConf, IpsecPsk};
use super::short;

/// The backends weft implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BackendKind {
    Wireguard,
    Vxlan,
    HostGw,
    Ipip,
    Ipsec,
}

impl BackendKind {
    pub const ALL: [BackendKind; 5] = [
        BackendKind::Wireguard,
        BackendKind::Vxlan,
        BackendKind::HostGw,
        BackendKind::Ipip,
        BackendKind::Ipsec,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Wireguard => "wireguard",
            BackendKind::Vxlan => "vxlan",
            BackendKind::HostGw => "host-gw",
            BackendKind::Ipip => "ipip",
            BackendKind::Ipsec => "ipsec",
        }
    }

    /// Whether pod traffic between nodes is encrypted (and so must fail closed).
    pub fn encrypts(self) -> bool {
        matches!(self, BackendKind::Wireguard | BackendKind::Ipsec)
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// flannel backends weft does not implement; named so the error can say so.
const FLANNEL_ONLY: &[&str] = &[
    "udp",
    "alloc",
    "extension",
    "gce",
    "aws-vpc",
    "ali-vpc",
    "tencent-vpc",
];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.message())]
pub struct UnknownBackend(pub String);

impl UnknownBackend {
    fn message(&self) -> String {
        let valid = BackendKind::ALL.map(|k| k.as_str()).join(", ");
        if FLANNEL_ONLY.contains(&self.0.to_ascii_lowercase().as_str()) {
            format!("flannel's `{}` backend is not implemented by weft; valid types: {valid} (wireguard and ipsec encrypt, vxlan, host-gw and ipip do not)", crate::model::clip(&self.0))
        } else {
            format!(
                "unknown backend type {:?}; valid types: {valid}",
                crate::model::clip(&self.0)
            )
        }
    }
}

impl FromStr for BackendKind {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> Result<Self, UnknownBackend> {
        BackendKind::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| UnknownBackend(s.to_string()))
    }
}

/// Which WireGuard implementation runs the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Implementation {
    /// Kernel if the kernel accepts a `wireguard` link, else userspace.
    #[default]
    Auto,
    Kernel,
    Userspace,
}

/// flannel's WireGuard `Mode`: how IPv4 and IPv6 peers map onto devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WireguardMode {
    /// One device per family (`flannel-wg`, `flannel-wg-v6`).
    #[default]
    Separate,
    /// One device; peers reached over IPv4 if both ends have it, else IPv6.
    Auto,
    /// One device; peers reached over IPv4.
    Ipv4,
    /// One device; peers reached over IPv6.
    Ipv6,
}

macro_rules! keyword_enum {
    ($ty:ty, $key:literal, [$(($variant:expr, $text:literal)),+]) => {
        impl $ty {
            pub fn as_str(self) -> &'static str {
                $(if self == $variant { return $text; })+
                unreachable!()
            }
            fn parse_key(f: &mut Fields<'_, '_>) -> Option<Self> {
                let text = f.string($key)?;
                $(if text.eq_ignore_ascii_case($text) { return Some($variant); })+
                f.push(ConfigError::invalid(
                    f.path($key),
                    format!("{text:?}"),
                    format!("valid: {}", [$($text),+].join(", ")),
                ));
                None
            }
        }
    };
}

keyword_enum!(
    WireguardMode,
    "Mode",
    [
        (WireguardMode::Separate, "separate"),
        (WireguardMode::Auto, "auto"),
        (WireguardMode::Ipv4, "ipv4"),
        (WireguardMode::Ipv6, "ipv6")
    ]
);
keyword_enum!(
    Implementation,
    "Implementation",
    [
        (Implementation::Auto, "auto"),
        (Implementation::Kernel, "kernel"),
        (Implementation::Userspace, "userspace")
    ]
);

#[derive(Debug, Clone, PartialEq)]
pub struct WireguardConf {
    pub listen_port: u16,
    pub listen_port_v6: u16,
    /// Underlay MTU; `None` = the external interface's.
    pub mtu: Option<u32>,
    pub psk: Option<PresharedKey>,
    /// Seconds; 0 = off.
    pub persistent_keepalive: u16,
    pub mode: WireguardMode,
    pub implementation: Implementation,
    /// `PostQuantum`: each pair's PSK from an ML-KEM-768 exchange between the two agents.
    pub post_quantum: bool,
    /// weft's `RefuseClear`: no pair of this node ever runs in clear, not even with a peer
    /// that publishes no encrypting backend during a change (`plan::mixed`).
    pub refuse_clear: bool,
}

impl Default for WireguardConf {
    /// A `{"Type": "wireguard"}` config's.
    fn default() -> Self {
        WireguardConf {
            listen_port: 51820,
            listen_port_v6: 51821,
            mtu: None,
            psk: None,
            persistent_keepalive: 0,
            mode: WireguardMode::default(),
            implementation: Implementation::default(),
            post_quantum: POST_QUANTUM_DEFAULT,
            refuse_clear: false,
        }
    }
}

impl Default for VxlanConf {
    /// A `{"Type": "vxlan"}` config's.
    fn default() -> Self {
        VxlanConf {
            vni: 1,
            port: 0,
            gbp: false,
            learning: false,
            direct_routing: false,
            mtu: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanConf {
    pub vni: u32,
    /// UDP port; 0 = the kernel's default (8472).
    pub port: u16,
    pub gbp: bool,
    pub learning: bool,
    pub direct_routing: bool,
    /// Underlay MTU; `None` = the external interface's.
    pub mtu: Option<u32>,
}

/// flannel's `ipip` backend: IPv4 in IPv4 over `flannel.ipip`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpipConf {
    pub direct_routing: bool,
    /// Underlay MTU; `None` = the external interface's.
    pub mtu: Option<u32>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Backend {
    Wireguard(WireguardConf),
    Vxlan(VxlanConf),
    HostGw,
    Ipip(IpipConf),
    Ipsec(IpsecConf),
}

impl Backend {
    pub fn kind(&self) -> BackendKind {
        match self {
            Backend::Wireguard(_) => BackendKind::Wireguard,
            Backend::Vxlan(_) => BackendKind::Vxlan,
            Backend::HostGw => BackendKind::HostGw,
            Backend::Ipip(_) => BackendKind::Ipip,
            Backend::Ipsec(_) => BackendKind::Ipsec,
        }
    }

    /// The config's underlay MTU, if it sets one.
    pub fn mtu(&self) -> Option<u32> {
        match self {
            Backend::Wireguard(w) => w.mtu,
            Backend::Vxlan(v) => v.mtu,
            Backend::HostGw => None,
            Backend::Ipip(i) => i.mtu,
            Backend::Ipsec(i) => i.mtu,
        }
    }

    /// `RefuseClear`: no pair runs in clear, even with a peer of no encrypting backend.
    pub fn refuses_clear(&self) -> bool {
        match self {
            Backend::Wireguard(w) => w.refuse_clear,
            Backend::Ipsec(i) => i.refuse_clear,
            _ => false,
        }
    }

    pub(super) fn to_json(&self) -> Value {
        match self {
            Backend::Wireguard(w) => json!({
                "Type": "wireguard",
                "ListenPort": w.listen_port,
                "ListenPortV6": w.listen_port_v6,
                "MTU": w.mtu,
                "PSK": w.psk.as_ref().map(|_| "(set: 32 bytes, not shown)"),
                "PersistentKeepaliveInterval": w.persistent_keepalive,
                "Mode": w.mode.as_str(),
                "Implementation": w.implementation.as_str(),
                "PostQuantum": w.post_quantum,
                "RefuseClear": w.refuse_clear,
            }),
            Backend::Vxlan(v) => json!({
                "Type": "vxlan",
                "VNI": v.vni,
                "Port": v.port,
                "GBP": v.gbp,
                "Learning": v.learning,
                "DirectRouting": v.direct_routing,
                "MTU": v.mtu,
            }),
            Backend::HostGw => json!({ "Type": "host-gw" }),
            Backend::Ipip(i) => json!({
                "Type": "ipip",
                "DirectRouting": i.direct_routing,
                "MTU": i.mtu,
            }),
            Backend::Ipsec(i) => json!({
                "Type": "ipsec",
                "PSK": i.psk.as_ref().map(|p| format!("(set: {} characters, not shown)", p.0.len())),
                "UDPEncap": i.udp_encap,
                "ESPProposal": i.algorithm.as_str(),
                "MTU": i.mtu,
                "RekeyAfter": i.rekey_after.map(|d| d.as_secs()),
                "PostQuantum": i.post_quantum,
                "RefuseClear": i.refuse_clear,
            }),
        }
    }
}

/// `PostQuantum` when the config does not say: on, on every encrypting backend (a peer
/// without it keeps its pairs classical, never down).
pub const POST_QUANTUM_DEFAULT: bool = true;

const WIREGUARD_KEYS: &[&str] = &[
    "Type",
    "ListenPort",
    "ListenPortV6",
    "MTU",
    "PSK",
    "PersistentKeepaliveInterval",
    "Mode",
    "Implementation",
    "PostQuantum",
    "RefuseClear",
];
const VXLAN_KEYS: &[&str] = &[
    "Type",
    "VNI",
    "Port",
    "GBP",
    "Learning",
    "DirectRouting",
    "MTU",
];
const HOST_GW_KEYS: &[&str] = &["Type"];
const IPIP_KEYS: &[&str] = &["Type", "DirectRouting", "MTU"];
const IPSEC_KEYS: &[&str] = &[
    "Type",
    "PSK",
    "UDPEncap",
    "ESPProposal",
    "MTU",
    "RekeyAfter",
    "PostQuantum",
    "RefuseClear",
];

/// Parses the `Backend` object. A missing `Backend` or `Type` means wireguard: weft
/// encrypts by default.
pub(super) fn parse(
    value: Option<&Value>,
    ipv6: bool,
    errors: &mut Vec<ConfigError>,
) -> Option<Backend> {
    let empty = Map::new();
    let map = match value {
        None => &empty,
        Some(Value::Object(map)) => map,
        Some(other) => {
            errors.push(ConfigError::invalid(
                "Backend",
                short(other),
                "expected an object such as {\"Type\": \"wireguard\"}",
            ));
            return None;
        }
    };
    let type_value = map
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("Type"))
        .map(|(_, v)| v)
        .filter(|v| !v.is_null());
    let kind = match type_value {
        None => BackendKind::Wireguard,
        Some(Value::String(s)) => match s.parse() {
            Ok(kind) => kind,
            Err(e) => {
                errors.push(ConfigError::invalid(
                    "Backend.Type",
                    format!("{s:?}"),
                    UnknownBackend::to_string(&e),
                ));
                return None;
            }
        },
        Some(other) => {
            errors.push(ConfigError::invalid(
                "Backend.Type",
                other,
                "expected a string: wireguard, vxlan, host-gw, ipip or ipsec",
            ));
            return None;
        }
    };
    let before = errors.len();
    let backend = match kind {
        BackendKind::Wireguard => {
            let mut f = Fields::new("Backend.", map, WIREGUARD_KEYS, errors);
            Backend::Wireguard(WireguardConf {
                listen_port: port(&mut f, "ListenPort", 1).unwrap_or(51820),
                listen_port_v6: port(&mut f, "ListenPortV6", 1).unwrap_or(51821),
                mtu: mtu(&mut f, ipv6),
                psk: psk(&mut f),
                persistent_keepalive: f
                    .integer("PersistentKeepaliveInterval", 0, 65535, "seconds (0 = off)")
                    .map_or(0, |n| n as u16),
                mode: WireguardMode::parse_key(&mut f).unwrap_or_default(),
                implementation: Implementation::parse_key(&mut f).unwrap_or_default(),
                post_quantum: f.bool("PostQuantum").unwrap_or(POST_QUANTUM_DEFAULT),
                refuse_clear: f.bool("RefuseClear").unwrap_or(false),
            })
        }
        BackendKind::Vxlan => {
            let mut f = Fields::new("Backend.", map, VXLAN_KEYS, errors);
            Backend::Vxlan(VxlanConf {
                vni: f
                    .integer("VNI", 0, (1 << 24) - 1, "a VXLAN network identifier")
                    .map_or(1, |n| n as u32),
                port: port(&mut f, "Port", 0).unwrap_or(0),
                gbp: f.bool("GBP").unwrap_or(false),
                learning: f.bool("Learning").unwrap_or(false),
                direct_routing: f.bool("DirectRouting").unwrap_or(false),
                mtu: mtu(&mut f, ipv6),
            })
        }
        BackendKind::HostGw => {
            Fields::new("Backend.", map, HOST_GW_KEYS, errors);
            Backend::HostGw
        }
        BackendKind::Ipip => {
            let mut f = Fields::new("Backend.", map, IPIP_KEYS, errors);
            Backend::Ipip(IpipConf {
                direct_routing: f.bool("DirectRouting").unwrap_or(false),
                mtu: mtu(&mut f, false),
            })
        }
        BackendKind::Ipsec => {
            let mut f = Fields::new("Backend.", map, IPSEC_KEYS, errors);
            Backend::Ipsec(IpsecConf {
                psk: ipsec_psk(&mut f),
                udp_encap: f.bool("UDPEncap").unwrap_or(false),
                algorithm: esp_proposal(&mut f).unwrap_or_default(),
                mtu: mtu(&mut f, false),
                rekey_after: f
                    .integer(
                        "RekeyAfter",
                        10,
                        u64::from(u32::MAX),
                        "seconds after which a node starts a new epoch by itself",
                    )
                    .map(std::time::Duration::from_secs),
                post_quantum: f.bool("PostQuantum").unwrap_or(POST_QUANTUM_DEFAULT),
                refuse_clear: f.bool("RefuseClear").unwrap_or(false),
            })
        }
    };
    (errors.len() == before).then_some(backend)
}

fn port(f: &mut Fields<'_, '_>, key: &str, min: u64) -> Option<u16> {
    let what = if min == 0 {
        "a UDP port (0 = kernel default)"
    } else {
        "a UDP port"
    };
    f.integer(key, min, 65535, what).map(|n| n as u16)
}

fn mtu(f: &mut Fields<'_, '_>, ipv6: bool) -> Option<u32> {
    let (min, what) = if ipv6 {
        (
            1280,
            "an underlay MTU with IPv6 enabled (IPv6 needs at least 1280)",
        )
    } else {
        (576, "an IPv4 underlay MTU")
    };
    f.integer("MTU", min, 65535, what).map(|n| n as u32)
}

fn psk(f: &mut Fields<'_, '_>) -> Option<PresharedKey> {
    let text = f.string("PSK")?;
    match text.parse() {
        Ok(psk) => Some(psk),
        Err(e) => {
            // Echo only the length: a near-miss PSK is still mostly secret.
            f.push(ConfigError::invalid(
                f.path("PSK"),
                format!("<{} characters, not shown>", text.chars().count()),
                format!("{e}; generate one with `weft keys psk` or `wg genpsk`"),
            ));
            None
        }
    }
}
