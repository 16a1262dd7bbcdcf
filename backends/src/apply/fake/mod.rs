//! In-memory kernels for the reconcilers' tests: `FakeNetlink` holds links, addresses,
//! routes and vxlan neighbour and FDB entries as the kernel would (a route is keyed by
//! destination and metric, so the fail-closed blackhole sits beside the unicast route to
//! the same network); `FakeNft` holds nftables tables as `nft -j list table` prints them;
//! `FakeWg` holds WireGuard devices, each tied to its link. All count writes, and a test
//! can delete or change anything behind the reconciler's back, as an operator would. No
//! root, no kernel: the real ones are exercised by the lab.

mod nft;
mod wg;
mod xfrm;

pub use nft::FakeNft;
pub use wg::FakeWg;
pub use xfrm::FakeXfrm;

use std::collections::BTreeMap;

use std::net::IpAddr;

use ipnet::IpNet;

use super::{
    ApplyError, IpipInfo, NeighbourEntry, Netlink, ObservedLink, ObservedRoute, RouteWrite,
    VxlanInfo, VxlanNetlink, XfrmInfo, RTPROT_WEFT,
};
use crate::model::{Family, IpipSpec, IpsecSpec, VxlanSpec, FAIL_CLOSED_METRIC};

/// A neighbour (`bridge` false) or FDB entry (`bridge` true) on link `index`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeEntry {
    pub index: u32,
    pub bridge: bool,
    pub ip: Option<IpAddr>,
    pub mac: Vec<u8>,
}

#[derive(Debug, Default)]
pub struct FakeNetlink {
    pub links: BTreeMap<String, ObservedLink>,
    pub addresses: BTreeMap<u32, Vec<IpNet>>,
    /// By (destination, metric).
    pub routes: BTreeMap<(IpNet, u32), ObservedRoute>,
    pub entries: Vec<FakeEntry>,
    /// Link lookups so far (`link`): each is a netlink request on a real kernel.
    pub lookups: u64,
    writes: u64,
}

impl FakeNetlink {
    /// Adds a link (as a device reconciler or an operator would), down, MTU 1500.
    pub fn add_link(&mut self, name: &str, kind: &str) -> u32 {
        let index = self.links.values().map(|l| l.index).max().unwrap_or(1) + 1;
        self.links.insert(
            name.to_string(),
            ObservedLink {
                index,
                name: name.to_string(),
                mtu: 1500,
                up: false,
                kind: Some(kind.to_string()),
                mac: Vec::new(),
                vxlan: None,
                ipip: None,
                xfrm: None,
            },
        );
        index
    }

    /// Deletes a link, and with it its addresses and the routes through it, as the kernel
    /// does.
    pub fn delete_link(&mut self, name: &str) {
        if let Some(l) = self.links.remove(name) {
            self.addresses.remove(&l.index);
            self.routes.retain(|_, r| r.oif != Some(l.index));
            self.entries.retain(|e| e.index != l.index);
        }
    }

    fn unknown(op: &str, what: impl std::fmt::Display) -> ApplyError {
        ApplyError::Netlink {
            op: format!("{op} {what}"),
            source: std::io::Error::from_raw_os_error(libc_enodev()),
        }
    }
}

/// ENODEV, without a libc dependency here.
fn libc_enodev() -> i32 {
    19
}

impl Netlink for FakeNetlink {
    async fn link(&mut self, name: &str) -> Result<Option<ObservedLink>, ApplyError> {
        self.lookups += 1;
        Ok(self.links.get(name).cloned())
    }

    async fn set_link(
        &mut self,
        link: &ObservedLink,
        mtu: u32,
        up: bool,
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        let l = self
            .links
            .get_mut(&link.name)
            .ok_or_else(|| Self::unknown("setting link", &link.name))?;
        l.mtu = mtu;
        l.up = up;
        Ok(())
    }

    async fn addresses(&mut self, link: &ObservedLink) -> Result<Vec<IpNet>, ApplyError> {
        Ok(self.addresses.get(&link.index).cloned().unwrap_or_default())
    }

    async fn add_address(&mut self, link: &ObservedLink, addr: IpNet) -> Result<(), ApplyError> {
        self.writes += 1;
        let list = self.addresses.entry(link.index).or_default();
        if list.contains(&addr) {
            return Err(ApplyError::Netlink {
                op: format!("adding address {addr} to {}", link.name),
                source: std::io::Error::from_raw_os_error(17),
            });
        }
        list.push(addr);
        Ok(())
    }

    async fn del_address(&mut self, link: &ObservedLink, addr: IpNet) -> Result<(), ApplyError> {
        self.writes += 1;
        if let Some(list) = self.addresses.get_mut(&link.index) {
            list.retain(|a| *a != addr);
        }
        Ok(())
    }

    async fn routes(&mut self, family: Family) -> Result<Vec<ObservedRoute>, ApplyError> {
        Ok(self
            .routes
            .values()
            .filter(|r| Family::of(&r.dst) == family)
            .cloned()
            .collect())
    }

    async fn put_route(&mut self, route: &RouteWrite) -> Result<(), ApplyError> {
        self.writes += 1;
        if !self.links.values().any(|l| l.index == route.oif) {
            return Err(Self::unknown("adding route", route.dst));
        }
        self.routes.insert(
            (route.dst, 0),
            ObservedRoute {
                dst: route.dst,
                oif: Some(route.oif),
                gateway: route.gateway,
                protocol: RTPROT_WEFT,
                blackhole: false,
                metric: 0,
                mtu: route.mtu,
            },
        );
        Ok(())
    }

    async fn put_blackhole(&mut self, dst: IpNet) -> Result<(), ApplyError> {
        self.writes += 1;
        self.routes.insert(
            (dst, FAIL_CLOSED_METRIC),
            ObservedRoute {
                dst,
                oif: None,
                gateway: None,
                protocol: RTPROT_WEFT,
                blackhole: true,
                metric: FAIL_CLOSED_METRIC,
                mtu: None,
            },
        );
        Ok(())
    }

    async fn del_route(&mut self, route: &ObservedRoute) -> Result<(), ApplyError> {
        self.writes += 1;
        self.routes.remove(&(route.dst, route.metric));
        Ok(())
    }

    async fn del_link(&mut self, link: &ObservedLink) -> Result<(), ApplyError> {
        self.writes += 1;
        self.delete_link(&link.name);
        Ok(())
    }

    fn writes(&self) -> u64 {
        self.writes
    }
}

impl VxlanNetlink for FakeNetlink {
    /// The entry itself.
    type Raw = FakeEntry;

    async fn all_links(&mut self) -> Result<Vec<ObservedLink>, ApplyError> {
        Ok(self.links.values().cloned().collect())
    }

    async fn create_vxlan(&mut self, spec: &VxlanSpec, info: &VxlanInfo) -> Result<(), ApplyError> {
        self.writes += 1;
        if self.links.contains_key(&spec.device) {
            return Err(ApplyError::Netlink {
                op: format!("creating vxlan device {}", spec.device),
                source: std::io::Error::from_raw_os_error(17),
            });
        }
        self.add_link(&spec.device, "vxlan");
        if let Some(l) = self.links.get_mut(&spec.device) {
            l.mtu = spec.mtu;
            l.mac = spec.mac.to_vec();
            l.vxlan = Some(info.clone());
        }
        Ok(())
    }

    async fn create_ipip(&mut self, spec: &IpipSpec, info: &IpipInfo) -> Result<(), ApplyError> {
        self.writes += 1;
        if self.links.contains_key(&spec.device) {
            return Err(ApplyError::Netlink {
                op: format!("creating ipip device {}", spec.device),
                source: std::io::Error::from_raw_os_error(17),
            });
        }
        self.add_link(&spec.device, "ipip");
        if let Some(l) = self.links.get_mut(&spec.device) {
            l.mtu = spec.mtu;
            l.ipip = Some(info.clone());
        }
        Ok(())
    }

    async fn create_xfrm(&mut self, spec: &IpsecSpec, info: &XfrmInfo) -> Result<(), ApplyError> {
        self.writes += 1;
        if self.links.contains_key(&spec.device) {
            return Err(ApplyError::Netlink {
                op: format!("creating XFRM interface {}", spec.device),
                source: std::io::Error::from_raw_os_error(17),
            });
        }
        self.add_link(&spec.device, "xfrm");
        if let Some(l) = self.links.get_mut(&spec.device) {
            l.mtu = spec.mtu;
            l.xfrm = Some(info.clone());
        }
        Ok(())
    }

    async fn set_mac(&mut self, link: &ObservedLink, mac: &[u8; 6]) -> Result<(), ApplyError> {
        self.writes += 1;
        let l = self
            .links
            .get_mut(&link.name)
            .ok_or_else(|| Self::unknown("setting the MAC of", &link.name))?;
        l.mac = mac.to_vec();
        Ok(())
    }

    async fn entries(
        &mut self,
        link: &ObservedLink,
        bridge: bool,
    ) -> Result<Vec<NeighbourEntry<FakeEntry>>, ApplyError> {
        Ok(self
            .entries
            .iter()
            .filter(|e| e.index == link.index && e.bridge == bridge)
            .map(|e| NeighbourEntry {
                ip: e.ip,
                mac: e.mac.clone(),
                raw: e.clone(),
            })
            .collect())
    }

    async fn put_neighbour(
        &mut self,
        link: &ObservedLink,
        ip: IpAddr,
        mac: &[u8; 6],
    ) -> Result<(), ApplyError> {
        self.put_entry(link, false, ip, mac)
    }

    async fn put_fdb(
        &mut self,
        link: &ObservedLink,
        mac: &[u8; 6],
        dst: IpAddr,
    ) -> Result<(), ApplyError> {
        self.put_entry(link, true, dst, mac)
    }

    async fn delete_entry(
        &mut self,
        entry: &NeighbourEntry<FakeEntry>,
        what: &str,
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        let before = self.entries.len();
        self.entries.retain(|e| *e != entry.raw);
        if self.entries.len() == before {
            return Err(Self::unknown("removing", what));
        }
        Ok(())
    }
}

impl FakeNetlink {
    /// Adds or replaces an entry: a neighbour is keyed by its IP, an FDB entry by its MAC
    /// (as `replace` does on a vxlan device).
    fn put_entry(
        &mut self,
        link: &ObservedLink,
        bridge: bool,
        ip: IpAddr,
        mac: &[u8; 6],
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        if !self.links.values().any(|l| l.index == link.index) {
            return Err(Self::unknown("adding an entry on", &link.name));
        }
        self.entries.retain(|e| {
            let same_key = if bridge {
                e.mac == mac
            } else {
                e.ip == Some(ip)
            };
            !(e.index == link.index && e.bridge == bridge && same_key)
        });
        self.entries.push(FakeEntry {
            index: link.index,
            bridge,
            ip: Some(ip),
            mac: mac.to_vec(),
        });
        Ok(())
    }
}
