//! The vxlan reconciler: the device `flannel.<VNI>` (recreated when its VNI, port, local
//! address, underlay or flags differ; its MAC set in place), and on it one permanent
//! neighbour (peer subnet address -> peer VTEP MAC) and one FDB entry (peer VTEP MAC ->
//! peer public IP) per peer. Entries on weft's device that the plan does not hold are
//! removed; a peer whose MAC or public IP changed has its entries replaced in the same
//! pass. vxlan devices of another VNI named `flannel.*` are removed.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use futures::TryStreamExt;
use netlink_packet_route::link::InfoVxlan;
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::AddressFamily;
use rtnetlink::{LinkUnspec, LinkVxlan};

use super::netlink::{Netlink, ObservedLink, VxlanInfo};
use super::{ApplyError, RtNetlink};
use crate::model::{format_mac, VxlanSpec};

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

/// The kernel's vxlan port when none is configured (Linux's default, as flannel relies on).
const KERNEL_DEFAULT_PORT: u16 = 8472;

fn wanted_info(spec: &VxlanSpec, underlay_index: Option<u32>) -> VxlanInfo {
    VxlanInfo {
        vni: spec.vni,
        port: if spec.port == 0 {
            KERNEL_DEFAULT_PORT
        } else {
            spec.port
        },
        local: Some(spec.local),
        underlay_index,
        learning: spec.learning,
        gbp: spec.gbp,
    }
}

/// A neighbour or FDB entry as the kernel holds it.
#[derive(Debug, Clone)]
struct Entry {
    message: NeighbourMessage,
    ip: Option<IpAddr>,
    mac: Vec<u8>,
}

fn fail(op: String) -> impl FnOnce(rtnetlink::Error) -> ApplyError {
    move |e| ApplyError::Netlink {
        op,
        source: match e {
            rtnetlink::Error::NetlinkError(m) => m.to_io(),
            other => std::io::Error::other(other.to_string()),
        },
    }
}

fn entry_of(msg: NeighbourMessage) -> Entry {
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
    Entry {
        message: msg,
        ip,
        mac,
    }
}

impl RtNetlink {
    async fn entries(&self, link: &ObservedLink, bridge: bool) -> Result<Vec<Entry>, ApplyError> {
        let mut req = self.handle.neighbours().get();
        req = if bridge {
            req.set_address_family(AddressFamily::Bridge)
        } else {
            req.set_address_family(AddressFamily::Inet)
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

    async fn delete_entry(&mut self, entry: &Entry, what: &str) -> Result<(), ApplyError> {
        self.writes += 1;
        self.handle
            .neighbours()
            .del(entry.message.clone())
            .execute()
            .await
            .map_err(fail(format!("removing {what}")))
    }

    async fn create_vxlan(
        &mut self,
        spec: &VxlanSpec,
        underlay: Option<u32>,
    ) -> Result<(), ApplyError> {
        let IpAddr::V4(local) = spec.local else {
            return Err(ApplyError::Netlink {
                op: format!("creating {}", spec.device),
                source: std::io::Error::other("an IPv6 underlay is not supported"),
            });
        };
        let mut b = LinkVxlan::new(&spec.device, spec.vni)
            .local(local)
            .port(wanted_info(spec, underlay).port)
            .learning(spec.learning);
        if let Some(index) = underlay {
            b = b.dev(index);
        }
        if spec.gbp {
            b = b.gbp();
        }
        let msg = b.address(spec.mac.to_vec()).mtu(spec.mtu).build();
        self.writes += 1;
        self.handle
            .link()
            .add(msg)
            .execute()
            .await
            .map_err(fail(format!("creating vxlan device {}", spec.device)))
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
}

/// All links (for finding stale `flannel.*` vxlan devices).
async fn vxlan_links(nl: &mut RtNetlink) -> Result<Vec<ObservedLink>, ApplyError> {
    let all: Vec<_> = nl
        .handle
        .link()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(fail("listing links".into()))?;
    Ok(all
        .iter()
        .map(RtNetlink::parse_link)
        .filter(|l| l.kind.as_deref() == Some("vxlan") && l.name.starts_with("flannel."))
        .collect())
}

/// Brings the vxlan device in line with `spec`. With `sweep`, also removes weft's other
/// vxlan devices (another VNI, or a previous backend's): that needs every link listed, so
/// it is done in full passes only (a backend or VNI changes only across a restart, whose
/// first pass is full). Returns one line per change, and whether the device was created.
pub async fn reconcile_vxlan(
    nl: &mut RtNetlink,
    spec: Option<&VxlanSpec>,
    sweep: bool,
    changes: &mut Vec<String>,
) -> Result<bool, ApplyError> {
    if sweep {
        for stale in vxlan_links(nl).await? {
            if spec.is_none_or(|s| s.device != stale.name) {
                nl.del_link(&stale).await?;
                changes.push(format!(
                    "removed vxlan device {}: not in the plan",
                    stale.name
                ));
            }
        }
    }
    let Some(spec) = spec else {
        return Ok(false);
    };
    let underlay = match &spec.underlay_device {
        Some(name) => nl.link(name).await?.map(|l| l.index),
        None => None,
    };
    let want = wanted_info(spec, underlay);
    let mut created = false;
    let link = match nl.link(&spec.device).await? {
        Some(l) if l.kind.as_deref() == Some("vxlan") && l.vxlan.as_ref() == Some(&want) => l,
        other => {
            if let Some(l) = other {
                nl.del_link(&l).await?;
                changes.push(format!("removed {}: its settings differ", l.name));
            }
            nl.create_vxlan(spec, underlay).await?;
            created = true;
            changes.push(format!(
                "created vxlan device {} vni {} port {} local {} vtep {}",
                spec.device,
                spec.vni,
                want.port,
                spec.local,
                format_mac(&spec.mac)
            ));
            nl.link(&spec.device)
                .await?
                .ok_or_else(|| ApplyError::Netlink {
                    op: format!("creating vxlan device {}", spec.device),
                    source: std::io::Error::other("created, but not found"),
                })?
        }
    };
    if link.mac != spec.mac {
        nl.set_mac(&link, &spec.mac).await?;
        changes.push(format!("{}: vtep MAC {}", link.name, format_mac(&spec.mac)));
    }
    neighbours(nl, &link, spec, changes).await?;
    fdb(nl, &link, spec, changes).await?;
    Ok(created)
}

async fn neighbours(
    nl: &mut RtNetlink,
    link: &ObservedLink,
    spec: &VxlanSpec,
    changes: &mut Vec<String>,
) -> Result<(), ApplyError> {
    let have: BTreeMap<IpAddr, Entry> = nl
        .entries(link, false)
        .await?
        .into_iter()
        .filter_map(|e| Some((e.ip?, e)))
        .collect();
    for p in &spec.peers {
        if have.get(&p.gateway).is_some_and(|e| e.mac == p.mac) {
            continue;
        }
        nl.writes += 1;
        nl.handle
            .neighbours()
            .add(link.index, p.gateway)
            .link_layer_address(&p.mac)
            .state(NeighbourState::Permanent)
            .replace()
            .execute()
            .await
            .map_err(fail(format!(
                "adding neighbour {} on {}",
                p.gateway, link.name
            )))?;
        changes.push(format!(
            "neighbour {} lladdr {} dev {} ({})",
            p.gateway,
            format_mac(&p.mac),
            link.name,
            p.node
        ));
    }
    for (ip, e) in &have {
        if !spec.peers.iter().any(|p| p.gateway == *ip) {
            nl.delete_entry(e, &format!("neighbour {ip} on {}", link.name))
                .await?;
            changes.push(format!("removed neighbour {ip} dev {}", link.name));
        }
    }
    Ok(())
}

async fn fdb(
    nl: &mut RtNetlink,
    link: &ObservedLink,
    spec: &VxlanSpec,
    changes: &mut Vec<String>,
) -> Result<(), ApplyError> {
    // Entries with a remote destination; the device's own MAC and learned ones aside.
    let have: Vec<Entry> = nl
        .entries(link, true)
        .await?
        .into_iter()
        .filter(|e| e.ip.is_some())
        .collect();
    for p in &spec.peers {
        let same = have
            .iter()
            .any(|e| e.mac == p.mac && e.ip == Some(p.public_ip));
        if same {
            continue;
        }
        // A stale entry for the same MAC (the peer moved) goes first.
        for e in have.iter().filter(|e| e.mac == p.mac) {
            nl.delete_entry(
                e,
                &format!("FDB entry {} on {}", format_mac(&p.mac), link.name),
            )
            .await?;
        }
        nl.writes += 1;
        nl.handle
            .neighbours()
            .add_bridge(link.index, &p.mac)
            .destination(p.public_ip)
            .flags(NeighbourFlags::Own)
            .state(NeighbourState::Permanent)
            .replace()
            .execute()
            .await
            .map_err(fail(format!(
                "adding FDB entry {} dst {} on {}",
                format_mac(&p.mac),
                p.public_ip,
                link.name
            )))?;
        changes.push(format!(
            "fdb {} dst {} dev {} ({})",
            format_mac(&p.mac),
            p.public_ip,
            link.name,
            p.node
        ));
    }
    for e in &have {
        let wanted = spec
            .peers
            .iter()
            .any(|p| e.mac == p.mac && e.ip == Some(p.public_ip));
        let moved = spec.peers.iter().any(|p| e.mac == p.mac);
        if !wanted && !moved {
            let dst = e.ip.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
            nl.delete_entry(e, &format!("FDB entry on {}", link.name))
                .await?;
            changes.push(format!(
                "removed fdb {} dst {dst} dev {}",
                mac_text(&e.mac),
                link.name
            ));
        }
    }
    Ok(())
}

fn mac_text(mac: &[u8]) -> String {
    <[u8; 6]>::try_from(mac)
        .map(|m| format_mac(&m))
        .unwrap_or_else(|_| format!("{mac:02x?}"))
}
