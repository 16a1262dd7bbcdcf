//! The ipsec part of a data plane pass: the XFRM interface, states and policies
//! (`xfrm::reconcile_ipsec`).

use weft_crypto::esp::{Epoch, StoreError};
use weft_crypto::PrivateKey;

use super::dataplane::{Dataplane, DataplaneReport};
use super::netlink::VxlanNetlink;
use super::nft::Nft;
use super::wireguard::WgDevices;
use super::xfrm::{reconcile_ipsec, EncapSocket, EspBook, Xfrm};
use crate::model::DesiredState;

/// What the ipsec backend holds for the agent's life.
pub struct IpsecPlane<X> {
    pub(super) xfrm: X,
    pub(super) book: EspBook,
    /// What the last passes read and what is retiring.
    pub(super) memory: super::xfrm::StateMemory,
    /// The ESP-in-UDP socket (`UDPEncap`), open while the agent runs.
    _encap: Option<EncapSocket>,
}

impl<X: Xfrm> IpsecPlane<X> {
    /// XFRM writes made so far.
    pub fn xfrm_writes(&self) -> u64 {
        self.xfrm.writes()
    }
}

impl<X> IpsecPlane<X> {
    /// How long inbound states outlive the plan that dropped them (default 2 s).
    pub fn with_grace(mut self, grace: std::time::Duration) -> Self {
        self.memory.grace = grace;
        self
    }

    pub fn new(xfrm: X, book: EspBook, encap: Option<EncapSocket>) -> Self {
        IpsecPlane {
            xfrm,
            book,
            memory: Default::default(),
            _encap: encap,
        }
    }
}

impl<N: VxlanNetlink, F: Nft, W: WgDevices<Nl = N>, X: Xfrm> Dataplane<N, F, W, X> {
    /// Gives the data plane its XFRM socket and epoch book (the ipsec backend).
    pub fn with_ipsec(mut self, plane: IpsecPlane<X>) -> Self {
        self.ipsec = Some(plane);
        self
    }

    /// This node's ESP epoch, if it runs ipsec.
    pub fn esp_epoch(&self) -> Option<Epoch> {
        self.ipsec.as_ref().map(|p| p.book.epoch())
    }

    /// When this node's ESP epoch began, if the ipsec backend runs with a state directory.
    pub fn esp_epoch_since(&self) -> Option<std::time::SystemTime> {
        self.ipsec.as_ref().and_then(|p| p.book.epoch_since())
    }

    /// Persists a new ESP epoch (after states were lost) and returns it, to be published
    /// before anything is installed under it.
    pub fn bump_esp_epoch(&mut self) -> Option<Result<Epoch, StoreError>> {
        self.ipsec.as_mut().map(|p| p.book.bump())
    }

    /// A rotation's next epoch (see `EspBook::advance`); `None` without ipsec.
    pub fn advance_esp_epoch(&mut self) -> Option<Result<Epoch, StoreError>> {
        self.ipsec.as_mut().map(|p| p.book.advance())
    }

    /// The SPIs of the inbound states of `state`'s ipsec peers that have carried packets,
    /// read now (`Observed::esp_heard`); empty without ipsec.
    pub fn esp_heard(
        &mut self,
        state: &DesiredState,
    ) -> Result<std::collections::BTreeSet<u32>, super::ApplyError> {
        let (Some(plane), Some(spec)) = (self.ipsec.as_mut(), state.ipsec.as_ref()) else {
            return Ok(Default::default());
        };
        let heard = plane
            .xfrm
            .states(spec.if_id)?
            .into_iter()
            .filter(|o| o.spec.dst == spec.local && o.packets > 0)
            .map(|o| o.spec.spi)
            .collect();
        Ok(heard)
    }

    /// Each planned ipsec peer's states as the last pass read them, by public key.
    pub fn esp_counters(
        &self,
        state: &DesiredState,
    ) -> std::collections::BTreeMap<weft_crypto::PublicKey, super::xfrm::EspPair> {
        let (Some(plane), Some(spec)) = (self.ipsec.as_ref(), state.ipsec.as_ref()) else {
            return Default::default();
        };
        let peers = spec
            .peers
            .iter()
            .map(|p| (p.node.clone(), p.remote, p.spi_in(), p.outbound.spi));
        let by_node = super::xfrm::pairs(&plane.memory.seen, spec.local, peers);
        spec.peers
            .iter()
            .filter_map(|p| Some((p.public_key, by_node.get(&p.node)?.clone())))
            .collect()
    }

    pub(super) fn xfrm_writes(&self) -> u64 {
        self.ipsec.as_ref().map_or(0, |p| p.xfrm.writes())
    }

    /// Returns whether the XFRM interface was created.
    pub(super) async fn ipsec_pass(
        &mut self,
        state: &DesiredState,
        key: &PrivateKey,
        full: bool,
        report: &mut DataplaneReport,
    ) -> bool {
        let spec = state.ipsec.as_ref();
        let Some(plane) = self.ipsec.as_mut() else {
            if spec.is_some() {
                report.errors.push(
                    "flannel-ipsec: planned, but this agent opened no XFRM socket".to_string(),
                );
            } else if full {
                if let Err(e) = super::ipsec_link::remove(&mut self.nl, &mut report.changes).await {
                    report.errors.push(e.to_string());
                }
            }
            return false;
        };
        let (changes, errors) = (&mut report.changes, &mut report.errors);
        match reconcile_ipsec(&mut self.nl, plane, spec, key, full, changes, errors).await {
            Ok(outcome) => {
                report.esp_lost = outcome.lost;
                outcome.created
            }
            Err(e) => {
                report.errors.push(e.to_string());
                false
            }
        }
    }
}
