//! The vxlan reconciler: the device `flannel.<VNI>` (recreated when its VNI, port, local
//! address, underlay or flags differ; its MAC set in place), and on it one permanent
//! neighbour (peer subnet address -> peer VTEP MAC) and one FDB entry (peer VTEP MAC ->
//! peer public IP) per peer. Entries on weft's device that the plan does not hold are
//! removed; a peer whose MAC or public IP changed has its entries replaced in the same
//! pass. vxlan devices of another VNI named `flannel.*` are removed.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use super::netlink::{NeighbourEntry, ObservedLink, VxlanInfo, VxlanNetlink};
use super::ApplyError;
use crate::model::{format_mac, VxlanSpec};

/// The kernel's vxlan port when none is configured (Linux's default, as flannel relies on).
pub(crate) const KERNEL_DEFAULT_PORT: u16 = 8472;

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

/// Brings the vxlan devices in line with `specs` (one per family). With `sweep`, also
/// removes weft's other vxlan devices (another VNI, a family no longer enabled, or a
/// previous backend's): that needs every link listed, so it is done in full passes only (a
/// backend or VNI changes only across a restart, whose first pass is full). Returns one
/// line per change, and whether a device was created.
pub async fn reconcile_vxlan<N: VxlanNetlink>(
    nl: &mut N,
    specs: &[VxlanSpec],
    sweep: bool,
    changes: &mut Vec<String>,
) -> Result<bool, ApplyError> {
    if sweep {
        let links = nl.all_links().await?;
        let vxlan = links.into_iter().filter(|l| {
            l.kind.as_deref() == Some("vxlan")
                && (l.name.starts_with("flannel.") || l.name.starts_with("flannel-v6."))
        });
        for stale in vxlan {
            if !specs.iter().any(|s| s.device == stale.name) {
                nl.del_link(&stale).await?;
                changes.push(format!(
                    "removed vxlan device {}: not in the plan",
                    stale.name
                ));
            }
        }
    }
    let mut created = false;
    for spec in specs {
        created |= device(nl, spec, changes).await?;
    }
    Ok(created)
}

/// One vxlan device and its entries; whether it was created.
async fn device<N: VxlanNetlink>(
    nl: &mut N,
    spec: &VxlanSpec,
    changes: &mut Vec<String>,
) -> Result<bool, ApplyError> {
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
            nl.create_vxlan(spec, &want).await?;
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

async fn neighbours<N: VxlanNetlink>(
    nl: &mut N,
    link: &ObservedLink,
    spec: &VxlanSpec,
    changes: &mut Vec<String>,
) -> Result<(), ApplyError> {
    let have: BTreeMap<IpAddr, NeighbourEntry<N::Raw>> = nl
        .entries(link, false)
        .await?
        .into_iter()
        .filter_map(|e| Some((e.ip?, e)))
        .collect();
    for p in &spec.peers {
        if have.get(&p.gateway).is_some_and(|e| e.mac == p.mac) {
            continue;
        }
        nl.put_neighbour(link, p.gateway, &p.mac).await?;
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

async fn fdb<N: VxlanNetlink>(
    nl: &mut N,
    link: &ObservedLink,
    spec: &VxlanSpec,
    changes: &mut Vec<String>,
) -> Result<(), ApplyError> {
    // Entries with a remote destination; the device's own MAC and learned ones aside.
    let have: Vec<NeighbourEntry<N::Raw>> = nl
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
        nl.put_fdb(link, &p.mac, p.public_ip).await?;
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
