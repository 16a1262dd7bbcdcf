//! `DesiredState`: what the kernel should hold for this node, as plain data. Built by
//! `plan`, consumed by the reconcilers. Every piece has a `Display` a person can read in
//! a log or the demo.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use weft_crypto::{PresharedKey, PublicKey};

use super::rules::{Family, MasqueradeTable, SubnetEnv};
use super::LeftOut;

/// The whole plan for one node.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DesiredState {
    pub tunnels: Vec<TunnelSpec>,
    /// The vxlan devices (backend `vxlan`), each with its per-peer neighbour and FDB
    /// entries: `flannel.<VNI>` for IPv4, then `flannel-v6.<VNI>` for IPv6.
    pub vxlan: Vec<VxlanSpec>,
    /// The ipip device `flannel.ipip` (backend `ipip`).
    pub ipip: Option<IpipSpec>,
    /// The XFRM interface `flannel-ipsec` and its ESP peers (backend `ipsec`).
    pub ipsec: Option<IpsecSpec>,
    pub routes: Vec<RouteSpec>,
    /// Networks blackholed at a high metric, independent of any device: while a tunnel
    /// device or its routes are missing (first start, a device being recreated, the agent
    /// gone), traffic to them is dropped instead of following the default route in clear.
    pub fail_closed: Vec<IpNet>,
    /// The guard against forged clear packets, per family (encrypting backends only).
    pub guard: Vec<GuardSpec>,
    pub masquerade: Vec<MasqueradeTable>,
    pub subnet_env: SubnetEnv,
    /// Peers not in the plan, each with the reason.
    pub left_out: Vec<LeftOut>,
    /// The earliest moment a peer's announced key takes over by the clock: the plan
    /// changes then, so the agent plans again at that moment.
    pub next_switch: Option<std::time::SystemTime>,
    /// Announced keys whose first handshake the agent watches for (see `Observed`).
    pub key_watch: Option<super::KeyWatch>,
    /// Peers' next keys taken over by the clock, with no handshake on them seen: the agent
    /// sends one packet into the tunnel to each (`probe_target`) once, so the device
    /// starts the handshake at once. The rotating node's own first handshake may have come
    /// before this node staged the key, and been dropped; WireGuard would retry only
    /// after 5 s, while this node has already left the old key's session.
    pub switched_on_clock: Vec<PublicKey>,
    /// ipsec: a peer's evidence of holding this node's next epoch is awaited, so the agent
    /// reads its inbound states' counters (`Observed::esp_heard`) until it comes or
    /// `next_switch`.
    pub esp_watch: bool,
    /// The endpoint the registry gives each WireGuard peer, before a roamed one is kept:
    /// the agent remembers it (`PeerObserved::planned_before`).
    pub planned_endpoints: std::collections::BTreeMap<super::DevicePeer, SocketAddr>,
    /// Every peer's underlay address, whose path MTU the agent measures, and what the
    /// plan made of the measurement (`plan::path_mtu`).
    pub paths: Vec<PeerPath>,
    /// With `PostQuantum`, every peer this node runs post-quantum rounds with, or why a
    /// pair stays classical (`plan::post_quantum`).
    pub post_quantum: Vec<PqPeer>,
    /// While the cluster changes backend (`plan::mixed`): every planned pair's backend,
    /// and why it runs in clear if it does. Empty while every node runs this node's.
    pub pair_backends: Vec<PairBackend>,
    /// Encrypted pairs whose pods' packets the guard still takes in clear from the given
    /// device for a moment after the pair moved (`Observed::accept_clear_until`).
    pub clear_draining: Vec<(String, IpNet)>,
}

/// The backend one pair runs on while the cluster changes backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairBackend {
    pub node: String,
    pub backend: crate::netconf::BackendKind,
    /// `Some` for a pair in clear: why (its peer publishes no encrypting backend).
    pub why_clear: Option<String>,
}

/// A peer's part in post-quantum rounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PqPeer {
    pub node: String,
    /// Its X25519 key in use: the pair is this node's key and this one.
    pub public_key: PublicKey,
    /// Where the exchange goes. WireGuard: its tunnel address (its subnet's network
    /// address, IPv4 when it has one), inside the pair's tunnel, so the rounds need no port
    /// on the underlay (only a fall-back notice goes to `underlay`) and cross NAT as the
    /// tunnel does. ipsec: its public IP (see
    /// `plan::post_quantum::add`).
    pub address: std::net::IpAddr,
    /// Its public IP (a WireGuard peer's endpoint as the registry publishes it; an ipsec
    /// peer's `address`): where a fall-back notice goes when the tunnel cannot carry it.
    pub underlay: std::net::IpAddr,
    pub ek: PqKey,
}

/// A pair's post-quantum PSK in force (from the agent's rounds), as the plan takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairSecret {
    pub psk: PresharedKey,
    /// Its round's slot, 1 or 2 (`weft_crypto::pq::slot`): two in a row never share one.
    pub slot: u8,
    /// When it took over (on both nodes within the commit's one-way delay).
    pub since: std::time::SystemTime,
    /// The PSK it replaced, with its slot; `None`: the pair was classical before it.
    pub previous: Option<(PresharedKey, u8)>,
}

impl PairSecret {
    /// A PSK in force since long ago, with nothing before it (tests, a restart).
    pub fn settled(psk: PresharedKey, slot: u8) -> PairSecret {
        PairSecret {
            psk,
            slot,
            since: std::time::SystemTime::UNIX_EPOCH,
            previous: None,
        }
    }
}

/// A peer's ML-KEM-768 key as the plan found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PqKey {
    Published(weft_crypto::pq::EncapsKey),
    /// It publishes none (an older weft, flanneld, or `PostQuantum` off there): the pair is
    /// classical on both sides.
    None,
    /// What it publishes does not decode (why): the pair stays as it was (its PSK in force,
    /// rounds to the last key that decoded, if any).
    Bad(String),
}

/// One peer's path on the underlay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPath {
    pub node: String,
    /// The underlay address the peer's traffic goes to.
    pub address: std::net::IpAddr,
    /// What the backend wraps around a pod packet on this path (bytes).
    pub overhead: u32,
    /// The path's MTU as last measured, if it was.
    pub path_mtu: Option<u32>,
    /// The MTU its routes were given: the path is narrower than the pod MTU.
    pub route_mtu: Option<u32>,
}

/// Which pod-network sources one family accepts from where (`plan::guard`): from another
/// node's pods only out of a tunnel device, from this node's own never off the underlay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardSpec {
    pub family: Family,
    /// The pod network of this family.
    pub network: IpNet,
    /// This node's subnet in it.
    pub own: Option<IpNet>,
    /// The devices decrypted pod traffic comes out of.
    pub tunnels: Vec<String>,
    /// The external interface, if known.
    pub underlay: Option<String>,
    /// While the cluster changes backend: each pair in clear's pod subnet of this family,
    /// with the device its packets arrive on (the vxlan device, or the external
    /// interface for host-gw), accepted from there alone.
    pub clear: Vec<(String, IpNet)>,
}

/// One WireGuard device and its peers.
#[derive(Debug, Clone, PartialEq)]
pub struct TunnelSpec {
    pub device: String,
    pub listen_port: u16,
    pub mtu: u32,
    pub addresses: Vec<IpNet>,
    /// Sorted by node name.
    pub peers: Vec<PeerSpec>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PeerSpec {
    pub node: String,
    pub public_key: PublicKey,
    pub endpoint: SocketAddr,
    pub allowed_ips: Vec<IpNet>,
    /// Seconds; 0 = off.
    pub keepalive: u16,
    pub psk: Option<PresharedKey>,
    /// How the pair is carried: direct, or through a gateway whose relay is `endpoint`.
    pub via: Via,
}

/// How a WireGuard pair is carried (`plan::relay`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Via {
    #[default]
    Direct,
    /// Through this gateway's (node's) relay.
    Gateway(String),
    /// The two nodes cannot reach each other and no gateway can carry them (why): the
    /// direct endpoint is kept.
    NoPath(String),
}

impl Via {
    /// The gateway carrying the pair, if one does.
    pub fn gateway(&self) -> Option<&str> {
        match self {
            Via::Gateway(g) => Some(g),
            _ => None,
        }
    }
}

/// The ipip device `flannel.ipip`: IPv4 in IPv4 from this node's public IP to any peer
/// (the peer is the route's on-link next hop).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpipSpec {
    pub device: String,
    /// This node's public IP: the tunnel's source address.
    pub local: std::net::Ipv4Addr,
    /// The external interface the tunnel runs over.
    pub underlay_device: Option<String>,
    pub mtu: u32,
    /// The subnet's network address as /32.
    pub addresses: Vec<IpNet>,
}

/// The ipsec backend: the XFRM interface `flannel-ipsec` and, per peer, the two tunnel-mode
/// ESP SAs and three policies. Keys are not here: the reconciler derives them from this
/// node's private key, the peer's public key and the two epochs (docs/ipsec.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpsecSpec {
    pub device: String,
    /// The XFRM interface id binding the SAs and policies to the device.
    pub if_id: u32,
    /// The external interface the device sits on.
    pub underlay_device: Option<String>,
    pub mtu: u32,
    /// The subnet's network address as /32.
    pub addresses: Vec<IpNet>,
    /// This node's public IP: the tunnels' local end.
    pub local: std::net::Ipv4Addr,
    /// This node's epoch as published (the registry confirmed it).
    pub epoch: weft_crypto::esp::Epoch,
    pub algorithm: crate::netconf::EspAlgorithm,
    pub psk: Option<crate::netconf::IpsecPsk>,
    pub udp_encap: bool,
    /// This node's subnet; the guard drops clear packets from any other part of `network`
    /// that did not come through the device.
    pub subnet: IpNet,
    pub network: IpNet,
    /// Sorted by node name.
    pub peers: Vec<IpsecPeer>,
}

/// One ESP peer: what its states and the policies need, except the keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpsecPeer {
    pub node: String,
    pub public_key: PublicKey,
    /// The peer's public IP: the tunnels' remote end.
    pub remote: std::net::Ipv4Addr,
    pub subnet: IpNet,
    /// The state this node sends with (the peer receives on it).
    pub outbound: EspSa,
    /// The states this node receives on: first the one matching `outbound`'s epochs, then,
    /// while either node has announced its next epoch, the ones staged for it.
    pub inbound: Vec<EspSa>,
}

impl IpsecPeer {
    /// SPI of the state this node receives on now.
    pub fn spi_in(&self) -> u32 {
        self.inbound.first().map_or(0, |s| s.spi)
    }
}

/// One ESP state of a pair: its SPI and what its key is derived from: the two epochs, and
/// the pair's post-quantum PSK when it has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EspSa {
    pub spi: u32,
    /// This node's epoch and the peer's.
    pub local_epoch: weft_crypto::esp::Epoch,
    pub peer_epoch: weft_crypto::esp::Epoch,
    /// `None`: classical (the X25519 secret and the cluster PSK alone).
    pub pq: Option<EspPq>,
}

/// A pair's post-quantum PSK as one of its ESP states takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EspPq {
    /// 1 or 2 (`weft_crypto::pq::slot`): part of the SPI, so the states of two PSKs in a
    /// row stand side by side while the pair switches.
    pub slot: u8,
    pub psk: PresharedKey,
}

/// The vxlan device `flannel.<VNI>` and what each peer needs on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanSpec {
    pub device: String,
    pub vni: u32,
    /// UDP port; 0 = the kernel's default.
    pub port: u16,
    pub gbp: bool,
    pub learning: bool,
    /// The VTEP MAC this node publishes.
    pub mac: [u8; 6],
    /// This node's public IP: the tunnel's source address.
    pub local: IpAddr,
    /// The external interface the tunnel runs over.
    pub underlay_device: Option<String>,
    pub mtu: u32,
    /// The subnet's network address as /32.
    pub addresses: Vec<IpNet>,
    /// Sorted by node name: a permanent neighbour (peer subnet address -> peer VTEP MAC)
    /// and an FDB entry (peer VTEP MAC -> peer public IP) per peer reached over vxlan.
    pub peers: Vec<VxlanPeer>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanPeer {
    pub node: String,
    /// The peer subnet's network address: the on-link next hop of its route.
    pub gateway: IpAddr,
    pub mac: [u8; 6],
    pub public_ip: IpAddr,
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Parses `aa:bb:cc:dd:ee:ff` (case-insensitive).
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = text.split(':');
    for slot in &mut out {
        let part = parts.next()?;
        if part.len() != 2 {
            return None;
        }
        *slot = u8::from_str_radix(part, 16).ok()?;
    }
    parts.next().is_none().then_some(out)
}

/// Metric of the fail-closed blackhole routes: far behind any real route to the network.
pub const FAIL_CLOSED_METRIC: u32 = 4_000_000_000;

/// Why a route exists: the reconciler and the logs say it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteRole {
    /// The whole pod network into the tunnel: traffic to a peer without a usable key is
    /// dropped there instead of leaving in plaintext by the default route.
    Covering,
    Peer(String),
    /// `DirectRouting` / host-gw: straight to the peer's public IP on the underlay.
    Direct(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteSpec {
    pub dst: IpNet,
    pub device: String,
    pub via: Option<IpAddr>,
    /// The next hop is on the device's link though no address of the device covers it
    /// (vxlan: via the peer subnet's network address).
    pub onlink: bool,
    pub role: RouteRole,
    /// The MTU of the path to the peer, less the encapsulation, when it is narrower than
    /// the device's (`plan::path_mtu`): a pod sending more hears so from its own node.
    pub mtu: Option<u32>,
}

impl fmt::Display for DesiredState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for t in &self.tunnels {
            let addrs: Vec<_> = t.addresses.iter().map(ToString::to_string).collect();
            writeln!(
                f,
                "device {} (wireguard): listen {}, mtu {}, address {}",
                t.device,
                t.listen_port,
                t.mtu,
                addrs.join(", ")
            )?;
            for p in &t.peers {
                let allowed: Vec<_> = p.allowed_ips.iter().map(ToString::to_string).collect();
                write!(
                    f,
                    "  peer {:<12} key {}  endpoint {:<21} allowed {}",
                    p.node,
                    p.public_key,
                    p.endpoint,
                    allowed.join(",")
                )?;
                if p.keepalive > 0 {
                    write!(f, "  keepalive {}s", p.keepalive)?;
                }
                if p.psk.is_some() {
                    write!(f, "  psk")?;
                }
                writeln!(f)?;
            }
        }
        for v in &self.vxlan {
            writeln!(
                f,
                "vxlan {} vni {} port {} mtu {} vtep {} local {} address {}",
                v.device,
                v.vni,
                v.port,
                v.mtu,
                format_mac(&v.mac),
                v.local,
                v.addresses
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )?;
            for p in &v.peers {
                writeln!(
                    f,
                    "  peer {:<12} neigh {} lladdr {}  fdb {} dst {}",
                    p.node,
                    p.gateway,
                    format_mac(&p.mac),
                    format_mac(&p.mac),
                    p.public_ip
                )?;
            }
        }
        for r in &self.routes {
            let via = r.via.map(|v| format!(" via {v}")).unwrap_or_default();
            let why = match &r.role {
                RouteRole::Covering => "covering: fail closed".to_string(),
                RouteRole::Peer(n) => format!("peer {n}"),
                RouteRole::Direct(n) => format!("peer {n}, direct on the underlay"),
            };
            let onlink = if r.onlink { " onlink" } else { "" };
            let mtu = r.mtu.map(|m| format!(" mtu {m}")).unwrap_or_default();
            writeln!(
                f,
                "route {}{via} dev {}{onlink}{mtu}   ({why})",
                r.dst, r.device
            )?;
        }
        for net in &self.fail_closed {
            writeln!(
                f,
                "route blackhole {net} metric {}   (fail closed when the device is missing)",
                crate::model::FAIL_CLOSED_METRIC
            )?;
        }
        for table in &self.masquerade {
            writeln!(f, "nftables table {} {}:", table.family.nft(), table.table)?;
            for line in table.lines() {
                writeln!(f, "  {line}")?;
            }
        }
        writeln!(f, "subnet.env:")?;
        for line in self.subnet_env.render().lines() {
            writeln!(f, "  {line}")?;
        }
        for l in &self.left_out {
            writeln!(f, "{l}")?;
        }
        Ok(())
    }
}
