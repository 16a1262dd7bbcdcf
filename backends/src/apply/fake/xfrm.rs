//! XFRM in memory: states keyed by (destination, SPI), policies by (direction, selector),
//! as the kernel keys them; every state ever added is kept in `added`, so a test can check
//! that no (key, SPI) pair went in twice.

use std::net::Ipv4Addr;

use crate::apply::xfrm::{ObservedSa, PolicySpec, SaSpec, Xfrm};
use crate::apply::ApplyError;

#[derive(Debug, Default)]
pub struct FakeXfrm {
    pub states: Vec<ObservedSa>,
    pub policies: Vec<PolicySpec>,
    /// Every state added, in order.
    pub added: Vec<SaSpec>,
    writes: u64,
}

fn exists(op: String) -> ApplyError {
    ApplyError::Netlink {
        op,
        source: std::io::Error::from_raw_os_error(17),
    }
}

impl FakeXfrm {
    /// The state received on (`dst`, `spi`), if any.
    pub fn state(&self, dst: Ipv4Addr, spi: u32) -> Option<&SaSpec> {
        self.states
            .iter()
            .map(|s| &s.spec)
            .find(|s| s.dst == dst && s.spi == spi)
    }
}

impl Xfrm for FakeXfrm {
    fn states(&mut self, if_id: u32) -> Result<Vec<ObservedSa>, ApplyError> {
        Ok(self
            .states
            .iter()
            .filter(|s| s.spec.if_id == if_id)
            .cloned()
            .collect())
    }

    fn policies(&mut self, if_id: u32) -> Result<Vec<PolicySpec>, ApplyError> {
        Ok(self
            .policies
            .iter()
            .filter(|p| p.if_id == if_id)
            .cloned()
            .collect())
    }

    fn add_state(&mut self, sa: &SaSpec) -> Result<(), ApplyError> {
        self.writes += 1;
        if self.state(sa.dst, sa.spi).is_some() {
            return Err(exists(format!("adding XFRM state {sa:?}")));
        }
        self.added.push(sa.clone());
        self.states.push(ObservedSa {
            spec: sa.clone(),
            bytes: 0,
            packets: 0,
            replay_failed: 0,
            integrity_failed: 0,
            replay_window: crate::apply::xfrm::REPLAY_WINDOW,
            esn: true,
        });
        Ok(())
    }

    fn delete_state(&mut self, sa: &SaSpec) -> Result<(), ApplyError> {
        self.writes += 1;
        self.states
            .retain(|s| !(s.spec.dst == sa.dst && s.spec.spi == sa.spi));
        Ok(())
    }

    fn put_policy(&mut self, p: &PolicySpec) -> Result<(), ApplyError> {
        self.writes += 1;
        self.policies
            .retain(|q| !(q.dir == p.dir && q.src == p.src && q.dst == p.dst));
        self.policies.push(p.clone());
        Ok(())
    }

    fn delete_policy(&mut self, p: &PolicySpec) -> Result<(), ApplyError> {
        self.writes += 1;
        self.policies
            .retain(|q| !(q.dir == p.dir && q.src == p.src && q.dst == p.dst));
        Ok(())
    }

    fn writes(&self) -> u64 {
        self.writes
    }
}
