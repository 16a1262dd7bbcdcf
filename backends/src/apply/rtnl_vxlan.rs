//! `VxlanNetlink` over rtnetlink: the vxlan device and the neighbour and FDB entries on
//! it, and the ipip device. Every error names the operation, the object and the errno.

use std::net::IpAddr;

use futures::TryStreamExt;
use netlink_packet_route::link::{InfoIpTunnel, InfoVxlan};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::AddressFamily;
use rtnetlink::{LinkIpIp, LinkUnspec, LinkVxlan, LinkXfrm};

use super::netlink::{IpipInfo, NeighbourEntry, ObservedLink, VxlanInfo, VxlanNetlink, XfrmInfo};
use super::rtnl::fail;
use super::{ApplyError, RtNetlink};
use crate::model::{IpipSpec, IpsecSpec, VxlanSpec};

/// A vxlan link's settings, from its `IFLA_INFO_DATA`.
pub(super) fn info_of(attrs: &[InfoVxlan]) -> VxlanInfo {
    let mut info = VxlanInfo::default();
    for a in attrs {
        match a {
            InfoVxlan::Id(v) => info.vni = *v,
            InfoVxlan::Port(p) => info.port = *p,
            InfoVxlan::Local(ip) => info.local = Some(IpAddr::V4(*ip)),
            InfoVxlan::Local6(ip) => info.local = Some(IpAddr::V6(*ip)),
            InfoVxlan::Link(i) => info.underlay_index = Some(*i),
            InfoVxlan::Learning(l) => info.learning = *l,
            InfoVxlan::Gbp => info.gbp = true,
            _ => {}
        }
    }
    info
}

/// An XFRM interface's settings, from its `IFLA_INFO_DATA`.
pub(super) fn xfrm_info_of(attrs: &[netlink_packet_route::link::InfoXfrm]) -> XfrmInfo {
    use netlink_packet_route::link::InfoXfrm;
    let mut info = XfrmInfo::default();
    for a in attrs {
        match a {
            InfoXfrm::IfId(id) => info.if_id = *id,
            InfoXfrm::Link(index) if *index != 0 => info.underlay_index = Some(*index),
            _ => {}
        }
    }
    info
}

/// An ipip link's settings, from its `IFLA_INFO_DATA`.
pub(super) fn ipip_info_of(attrs: &[InfoIpTunnel]) -> IpipInfo {
    let mut info = IpipInfo::default();
    for a in attrs {
        match a {
            InfoIpTunnel::Local(ip) if !ip.is_unspecified() => info.local = Some(*ip),
            InfoIpTunnel::Link(i) if *i != 0 => info.underlay_index = Some(*i),
            _ => {}
        }
    }
    info
}

fn entry_of(msg: NeighbourMessage) -> NeighbourEntry<NeighbourMessage> {
    let mut ip = None;
    let mut mac = Vec::new();
    for a in &msg.attributes {
        match a {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => {
                ip = Some(IpAddr::V4(*v4))
            }
            NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => {
                ip = Some(IpAddr::V6(*v6))
            }
            // FDB entries (family bridge) carry their destination as raw bytes.
            NeighbourAttribute::Destination(NeighbourAddress::Other(b)) => {
                ip = match b.len() {
                    4 => <[u8; 4]>::try_from(b.as_slice()).ok().map(IpAddr::from),
                    16 => <[u8; 16]>::try_from(b.as_slice()).ok().map(IpAddr::from),
                    _ => None,
                }
            }
            NeighbourAttribute::LinkLayerAddress(m) => mac = m.clone(),
            _ => {}
        }
    }
    NeighbourEntry { ip, mac, raw: msg }
}

impl VxlanNetlink for RtNetlink {
    type Raw = NeighbourMessage;

    async fn all_links(&mut self) -> Result<Vec<ObservedLink>, ApplyError> {
        let all: Vec<_> = self
            .handle
            .link()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(fail("listing links".into()))?;
        Ok(all.iter().map(RtNetlink::parse_link).collect())
    }

    async fn create_vxlan(&mut self, spec: &VxlanSpec, info: &VxlanInfo) -> Result<(), ApplyError> {
        let mut b = LinkVxlan::new(&spec.device, spec.vni);
        b = match spec.local {
            IpAddr::V4(local) => b.local(local),
            IpAddr::V6(local) => b.local6(local),
        };
        let mut b = b.port(info.port).learning(spec.learning);
        if let Some(index) = info.underlay_index {
            b = b.dev(index);
        }
        if spec.gbp {
            b = b.gbp();
        }
        let msg = b.address(spec.mac.to_vec()).mtu(spec.mtu).build();
        self.add_link(msg, format!("creating vxlan device {}", spec.device))
            .await
    }

    async fn create_ipip(&mut self, spec: &IpipSpec, info: &IpipInfo) -> Result<(), ApplyError> {
        let mut b = LinkIpIp::new(&spec.device).local(spec.local);
        if let Some(index) = info.underlay_index {
            b = b.dev(index);
        }
        let msg = b.mtu(spec.mtu).build();
        self.add_link(msg, format!("creating ipip device {}", spec.device))
            .await
    }

    async fn create_xfrm(&mut self, spec: &IpsecSpec, info: &XfrmInfo) -> Result<(), ApplyError> {
        let mut b = rtnetlink::LinkMessageBuilder::<LinkXfrm>::new(&spec.device).if_id(info.if_id);
        if let Some(index) = info.underlay_index {
            b = b.dev(index);
        }
        let msg = b.mtu(spec.mtu).build();
        self.add_link(msg, format!("creating XFRM interface {}", spec.device))
            .await
    }

    async fn set_mac(&mut self, link: &ObservedLink, mac: &[u8; 6]) -> Result<(), ApplyError> {
        self.writes += 1;
        let msg = LinkUnspec::new_with_index(link.index)
            .address(mac.to_vec())
            .build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(fail(format!("setting the MAC of {}", link.name)))
    }

    async fn entries(
        &mut self,
        link: &ObservedLink,
        bridge: bool,
    ) -> Result<Vec<NeighbourEntry<NeighbourMessage>>, ApplyError> {
        let mut req = self.handle.neighbours().get();
        // Neighbours of both families (an IPv6 device's are IPv6).
        req = if bridge {
            req.set_address_family(AddressFamily::Bridge)
        } else {
            req.set_address_family(AddressFamily::Unspec)
        };
        let what = if bridge { "FDB" } else { "neighbour" };
        let all: Vec<NeighbourMessage> = req
            .execute()
            .try_collect()
            .await
            .map_err(fail(format!("listing {what} entries of {}", link.name)))?;
        Ok(all
            .into_iter()
            .filter(|m| m.header.ifindex == link.index)
            .filter(|m| bridge || m.header.state == NeighbourState::Permanent)
            .map(entry_of)
            .collect())
    }

    async fn put_neighbour(
        &mut self,
        link: &ObservedLink,
        ip: IpAddr,
        mac: &[u8; 6],
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        self.handle
            .neighbours()
            .add(link.index, ip)
            .link_layer_address(mac)
            .state(NeighbourState::Permanent)
            .replace()
            .execute()
            .await
            .map_err(fail(format!("adding neighbour {ip} on {}", link.name)))
    }

    async fn put_fdb(
        &mut self,
        link: &ObservedLink,
        mac: &[u8; 6],
        dst: IpAddr,
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        self.handle
            .neighbours()
            .add_bridge(link.index, mac)
            .destination(dst)
            .flags(NeighbourFlags::Own)
            .state(NeighbourState::Permanent)
            .replace()
            .execute()
            .await
            .map_err(fail(format!(
                "adding FDB entry {} dst {dst} on {}",
                crate::model::format_mac(mac),
                link.name
            )))
    }

    async fn delete_entry(
        &mut self,
        entry: &NeighbourEntry<NeighbourMessage>,
        what: &str,
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        self.handle
            .neighbours()
            .del(entry.raw.clone())
            .execute()
            .await
            .map_err(fail(format!("removing {what}")))
    }
}
