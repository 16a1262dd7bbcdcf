//! Why a peer is left out of the plan (`LeftOut`, `LeaveReason`): named in the log,
//! `/metrics`, `weft status` and `weft doctor`, each reason in words an operator can act on.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use weft_crypto::PublicKey;

use super::Family;

/// A peer left out of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftOut {
    pub node: String,
    pub reason: LeaveReason,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaveReason {
    Expired,
    WrongBackend {
        theirs: String,
        ours: &'static str,
    },
    BadBackendData {
        field: &'static str,
        detail: super::BackendDataError,
    },
    NoPublicIp {
        family: Family,
    },
    NoSubnet,
    SubnetOutsideNetwork {
        subnet: IpNet,
        network: IpNet,
    },
    OverlapsOurSubnet {
        subnet: IpNet,
        ours: IpNet,
    },
    DuplicateSubnet {
        subnet: IpNet,
        other: String,
    },
    DuplicateKey {
        key: PublicKey,
        other: String,
    },
    /// Its announced next key is a key another node publishes (`other`).
    NextKeyTaken {
        key: PublicKey,
        other: String,
    },
    /// Its subnet's prefix is not the one every node's subnet has.
    SubnetLength {
        subnet: IpNet,
        expected: u8,
    },
    KeyIsOurs {
        key: PublicKey,
    },
    /// host-gw: the peer's public IP is not on this node's L2 segment.
    NotOnLink {
        ip: IpAddr,
    },
    /// ipsec: another node (`other`, the older entry) publishes the same public IP.
    DuplicatePublicIp {
        ip: IpAddr,
        other: String,
    },
    /// ipsec: it publishes this node's own public IP.
    PublicIpIsOurs {
        ip: IpAddr,
    },
    /// It and this node both publish encrypting backends, none in common (a change from
    /// one encrypting backend to the other without the old one kept): the pair stays down
    /// rather than in clear.
    NoCommonEncryption {
        theirs: String,
        ours: String,
    },
    /// Its pair would run in clear, and this node's config refuses clear pairs
    /// (`RefuseClear`).
    ClearRefused {
        theirs: String,
    },
    /// ipsec: two of the states it would be heard on get one SPI.
    SpiCollision {
        spi: u32,
    },
}

impl fmt::Display for LeaveReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaveReason::Expired => write!(f, "its lease has expired"),
            LeaveReason::WrongBackend { theirs, ours } => write!(f, "it runs backend {theirs:?}, this node runs {ours}; all nodes must use one backend"),
            LeaveReason::BadBackendData { field, detail } => write!(f, "its {field} is unusable: {detail}"),
            LeaveReason::NoPublicIp { family: Family::Ipv4 } => write!(f, "it publishes no IPv4 public IP to reach it on"),
            LeaveReason::NoPublicIp { family: Family::Ipv6 } => write!(f, "it publishes no IPv6 public IP to reach it on"),
            LeaveReason::NoSubnet => write!(f, "it holds no subnet of an enabled family"),
            LeaveReason::SubnetOutsideNetwork { subnet, network } => write!(f, "its subnet {subnet} lies outside the pod network {network}"),
            LeaveReason::OverlapsOurSubnet { subnet, ours } => write!(f, "its subnet {subnet} overlaps this node's subnet {ours}"),
            LeaveReason::DuplicateSubnet { subnet, other } => write!(f, "its subnet {subnet} overlaps node {other}'s, which keeps it (the older entry, or the narrower subnet); left out until it lets go"),
            LeaveReason::DuplicateKey { key, other } => write!(f, "its public key {key} is also published by node {other}, which keeps it (it proves holding the key, or is the older entry); left out until it changes"),
            LeaveReason::NextKeyTaken { key, other } => write!(f, "its announced next key {key} is node {other}'s public key; left out until it announces another"),
            LeaveReason::SubnetLength { subnet, expected } => write!(f, "its subnet {subnet} is not a /{expected} like every node's subnet"),
            LeaveReason::KeyIsOurs { key } => write!(f, "it publishes this node's own public key {key}"),
            LeaveReason::DuplicatePublicIp { ip, other } => write!(f, "its public IP {ip} is also published by node {other}, which keeps it (the older entry); left out until it changes"),
            LeaveReason::PublicIpIsOurs { ip } => write!(f, "it publishes this node's own public IP {ip}"),
            LeaveReason::SpiCollision { spi } => write!(f, "two of its ESP states would share SPI 0x{spi:08x}; left out until it publishes consecutive epochs"),
            LeaveReason::NoCommonEncryption { theirs, ours } => write!(f, "it speaks {theirs} and this node {ours}: both encrypt, with no backend in common, so the pair stays down rather than in clear until one of them speaks the other's"),
            LeaveReason::ClearRefused { theirs } => write!(f, "it runs {theirs}, which does not encrypt, and this node's config refuses clear pairs (RefuseClear); down until it moves to an encrypting backend"),
            LeaveReason::NotOnLink { ip } => write!(f, "host-gw needs all nodes on one L2 segment; it is at {ip}, behind a router: use vxlan with DirectRouting"),
        }
    }
}

impl fmt::Display for LeftOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {} left out: {}", self.node, self.reason)
    }
}
