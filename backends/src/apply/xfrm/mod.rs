//! IPsec in the kernel (XFRM): tunnel-mode ESP states and the policies that bind them to
//! the XFRM interface. `Xfrm` is the kernel as the ipsec reconciler sees it; `XfrmSocket`
//! speaks XFRM netlink, the fake in `apply::fake` keeps them in memory. Only states and
//! policies carrying weft's interface id are ever read back or removed.

mod book;
mod kernel;
mod missing;
mod reconcile;

use std::fmt;
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

pub use book::EspBook;
pub use kernel::{EncapSocket, XfrmSocket};
pub use reconcile::{reconcile_ipsec, IpsecOutcome, StateMemory, RETIRE_GRACE};

use super::ApplyError;

/// The UDP port of ESP in UDP (RFC 3948).
pub const ESP_UDP_PORT: u16 = 4500;
/// The replay window of every inbound SA, in packets.
pub const REPLAY_WINDOW: u32 = 1024;

/// An SA's key material, as planned or as read back from the kernel: never printed, and
/// zeroed when dropped (the reconciler keeps the states it read, keys included, between
/// passes).
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct EspKey(Vec<u8>);

impl EspKey {
    pub fn new(bytes: &[u8]) -> Self {
        EspKey(bytes.to_vec())
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl zeroize::Zeroize for EspKey {
    fn zeroize(&mut self) {
        self.0.zeroize();
    }
}

impl Drop for EspKey {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(self);
    }
}

impl fmt::Debug for EspKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EspKey({} bytes, not shown)", self.0.len())
    }
}

/// One tunnel-mode ESP state (SA). The key never prints.
#[derive(Clone, PartialEq, Eq)]
pub struct SaSpec {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub spi: u32,
    /// The kernel's AEAD name, e.g. `rfc4106(gcm(aes))`.
    pub algorithm: String,
    pub key: EspKey,
    pub icv_bits: u32,
    /// ESP in UDP, port 4500 both ends.
    pub udp_encap: bool,
    pub if_id: u32,
    /// The pair's reqid, which its policies' templates name.
    pub reqid: u32,
}

impl fmt::Debug for SaSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SA {} -> {} spi 0x{:08x} reqid {} {} ({} key bytes){}",
            self.src,
            self.dst,
            self.spi,
            self.reqid,
            self.algorithm,
            self.key.len(),
            if self.udp_encap { " in UDP" } else { "" }
        )
    }
}

/// A state as read back, with its counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedSa {
    pub spec: SaSpec,
    pub bytes: u64,
    pub packets: u64,
    /// Packets dropped as replays, and as failing the integrity check.
    pub replay_failed: u32,
    pub integrity_failed: u32,
    pub replay_window: u32,
    pub esn: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PolicyDir {
    In,
    Out,
    Fwd,
}

impl PolicyDir {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyDir::In => "in",
            PolicyDir::Out => "out",
            PolicyDir::Fwd => "fwd",
        }
    }
}

/// One policy: traffic `src` -> `dst` in direction `dir` goes through (or, inbound, must
/// have come through) an ESP tunnel `tmpl_src` -> `tmpl_dst`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicySpec {
    pub dir: PolicyDir,
    pub src: Ipv4Net,
    pub dst: Ipv4Net,
    pub tmpl_src: Ipv4Addr,
    pub tmpl_dst: Ipv4Addr,
    pub if_id: u32,
    /// The reqid of the pair's states: the only ones the template matches.
    pub reqid: u32,
}

impl fmt::Display for PolicySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "policy {} {} -> {} via {} -> {} reqid {}",
            self.dir.as_str(),
            self.src,
            self.dst,
            self.tmpl_src,
            self.tmpl_dst,
            self.reqid
        )
    }
}

/// One peer's two states as read: what this node receives on and what it sends with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EspPair {
    pub inbound: Option<ObservedSa>,
    pub outbound: Option<ObservedSa>,
}

/// Each peer's states among `states`, by node: the inbound one is the state to `local`
/// with the peer's `spi_in`, the outbound one the state to the peer with `spi_out`.
pub fn pairs(
    states: &[ObservedSa],
    local: Ipv4Addr,
    peers: impl IntoIterator<Item = (String, Ipv4Addr, u32, u32)>,
) -> std::collections::BTreeMap<String, EspPair> {
    let find = |dst: Ipv4Addr, spi: u32| {
        states
            .iter()
            .find(|s| s.spec.dst == dst && s.spec.spi == spi)
            .cloned()
    };
    peers
        .into_iter()
        .map(|(node, remote, spi_in, spi_out)| {
            let pair = EspPair {
                inbound: find(local, spi_in),
                outbound: find(remote, spi_out),
            };
            (node, pair)
        })
        .collect()
}

/// XFRM as the ipsec reconciler sees it. Reads return only what carries `if_id`.
pub trait Xfrm {
    fn states(&mut self, if_id: u32) -> Result<Vec<ObservedSa>, ApplyError>;
    fn policies(&mut self, if_id: u32) -> Result<Vec<PolicySpec>, ApplyError>;
    fn add_state(&mut self, sa: &SaSpec) -> Result<(), ApplyError>;
    fn delete_state(&mut self, sa: &SaSpec) -> Result<(), ApplyError>;
    /// Adds or replaces the policy of `p`'s direction and selector.
    fn put_policy(&mut self, p: &PolicySpec) -> Result<(), ApplyError>;
    fn delete_policy(&mut self, p: &PolicySpec) -> Result<(), ApplyError>;
    /// Writes made so far (for the zero-writes-in-steady-state check).
    fn writes(&self) -> u64;
}

#[cfg(test)]
mod epoch_tests;
#[cfg(test)]
mod outbound_tests;
#[cfg(test)]
mod pq_tests;
#[cfg(test)]
mod tests;

#[cfg(test)]
mod key_tests {
    use super::EspKey;
    use zeroize::Zeroize;

    /// What `Drop` does: the bytes are overwritten with zeros and the key is emptied.
    #[test]
    fn an_esp_key_is_zeroed_and_never_printed() {
        let mut key = EspKey::new(&[0xab; 20]);
        assert_eq!(format!("{key:?}"), "EspKey(20 bytes, not shown)");
        key.zeroize();
        assert!(key.is_empty());
    }
}
