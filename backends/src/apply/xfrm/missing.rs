//! A planned state whose key the record says was installed before, and that is not in
//! place: lost by this node (its epoch must change) or a peer going back to old values
//! (refused, and no reason for a new epoch), judged by where the key stood last.

use std::collections::HashMap;
use std::net::Ipv4Addr;

use super::SaSpec;

/// Where a state stood: its tunnel ends and SPI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Placement {
    src: Ipv4Addr,
    dst: Ipv4Addr,
    spi: u32,
}

impl Placement {
    pub(super) fn of(sa: &SaSpec) -> Self {
        Placement {
            src: sa.src,
            dst: sa.dst,
            spi: sa.spi,
        }
    }

    /// The part of a state this node decides: for what it sends, its own address and
    /// the SPI (from its own subnet); for what it receives, its own address.
    pub(super) fn ours(&self, local: Ipv4Addr) -> (Ipv4Addr, Option<u32>) {
        if self.dst == local {
            (self.dst, None)
        } else {
            (self.src, Some(self.spi))
        }
    }
}

/// What a planned state whose key was installed before, and is not in place, means.
pub(super) enum Missing {
    /// This node lost it (deleted, flushed, a reboot), or moved it itself (its address
    /// or subnet changed): its epoch must change before anything is installed again.
    Lost(String),
    /// A peer's published values went back to, or moved, a key in use before (an old
    /// epoch republished, a public IP X -> Y -> X): not installed again, and no reason for
    /// this node to start a new epoch, which one peer could otherwise force on every
    /// node as often as it liked. The pair waits for the peer's next epoch.
    Refused(String),
}

/// Judges a planned state `sa` (for `node`) whose key is recorded as installed, by where
/// the key stood after the last pass (`standing`: `None` on the first pass, when the
/// record is all there is).
pub(super) fn missing(
    standing: Option<&HashMap<String, Placement>>,
    fingerprint: &str,
    sa: &SaSpec,
    node: &str,
    local: Ipv4Addr,
) -> Missing {
    let want = Placement::of(sa);
    match standing.map(|s| s.get(fingerprint)) {
        None => Missing::Lost(format!("{sa:?} was installed under this epoch and is gone")),
        Some(Some(stood)) if *stood == want => {
            Missing::Lost(format!("{sa:?} was installed under this epoch and is gone"))
        }
        Some(Some(stood)) if stood.ours(local) != want.ours(local) => Missing::Lost(format!(
            "{sa:?} would reuse the key of a state of this node's that stood at {stood:?}: this node's address or subnet changed"
        )),
        _ => Missing::Refused(format!(
            "node {node}: {sa:?} would use a key installed before (the node went back to an epoch or address it had); not installed again, the pair waits for the node's next epoch"
        )),
    }
}
