//! The kernel as the routing reconciler sees it: reads and writes of links, addresses and
//! routes behind one trait, so the reconciler is the same against rtnetlink and a fake.

use std::future::Future;
use std::net::IpAddr;

use ipnet::IpNet;

use super::ApplyError;
use crate::model::Family;

/// The `protocol` weft stamps on its routes (`ip route show proto 87`): how weft tells its
/// routes from everyone else's. Routes with another protocol are never removed.
pub const RTPROT_WEFT: u8 = 87;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedLink {
    pub index: u32,
    pub name: String,
    pub mtu: u32,
    pub up: bool,
    /// The link type (`IFLA_INFO_KIND`: `wireguard`, `tun`, `vxlan`, …), when it has one.
    pub kind: Option<String>,
    /// The link-layer address (empty for links without one).
    pub mac: Vec<u8>,
    /// A vxlan link's settings.
    pub vxlan: Option<VxlanInfo>,
    /// An ipip link's settings.
    pub ipip: Option<IpipInfo>,
    /// An XFRM interface's settings.
    pub xfrm: Option<XfrmInfo>,
}

/// What an XFRM interface was created with; one that differs is recreated.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct XfrmInfo {
    pub if_id: u32,
    pub underlay_index: Option<u32>,
}

/// What an ipip link was created with; a link that differs is recreated.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IpipInfo {
    pub local: Option<IpAddr>,
    pub underlay_index: Option<u32>,
}

/// What a vxlan link was created with; a link that differs is recreated.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VxlanInfo {
    pub vni: u32,
    pub port: u16,
    pub local: Option<IpAddr>,
    pub underlay_index: Option<u32>,
    pub learning: bool,
    pub gbp: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedRoute {
    pub dst: IpNet,
    /// Output interface index.
    pub oif: Option<u32>,
    pub gateway: Option<IpAddr>,
    pub protocol: u8,
    /// A `blackhole` route (weft's fail-closed routes), not a unicast one.
    pub blackhole: bool,
    pub metric: u32,
    /// The route's MTU metric (`ip route … mtu N`), if it has one.
    pub mtu: Option<u32>,
}

/// A route to install, resolved to an interface index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteWrite {
    pub dst: IpNet,
    pub oif: u32,
    pub device: String,
    pub gateway: Option<IpAddr>,
    /// The gateway is on the link though no address of the device covers it.
    pub onlink: bool,
    /// The path's MTU to the destination, when narrower than the device's.
    pub mtu: Option<u32>,
}

pub trait Netlink {
    fn link(
        &mut self,
        name: &str,
    ) -> impl Future<Output = Result<Option<ObservedLink>, ApplyError>>;
    fn set_link(
        &mut self,
        link: &ObservedLink,
        mtu: u32,
        up: bool,
    ) -> impl Future<Output = Result<(), ApplyError>>;
    /// Addresses on the link, link-local IPv6 excluded (the kernel manages those).
    fn addresses(
        &mut self,
        link: &ObservedLink,
    ) -> impl Future<Output = Result<Vec<IpNet>, ApplyError>>;
    fn add_address(
        &mut self,
        link: &ObservedLink,
        addr: IpNet,
    ) -> impl Future<Output = Result<(), ApplyError>>;
    fn del_address(
        &mut self,
        link: &ObservedLink,
        addr: IpNet,
    ) -> impl Future<Output = Result<(), ApplyError>>;
    /// Unicast and blackhole routes of the main table of one family.
    fn routes(
        &mut self,
        family: Family,
    ) -> impl Future<Output = Result<Vec<ObservedRoute>, ApplyError>>;
    /// Adds or replaces (same destination) a route, stamped `RTPROT_WEFT`.
    fn put_route(&mut self, route: &RouteWrite) -> impl Future<Output = Result<(), ApplyError>>;
    /// `put_route` for each of `routes` (their destinations differ), each result in their
    /// order; a kernel connection may have them in flight together.
    fn put_routes(
        &mut self,
        routes: &[&RouteWrite],
    ) -> impl Future<Output = Vec<Result<(), ApplyError>>> {
        async move {
            let mut done = Vec::with_capacity(routes.len());
            for route in routes {
                done.push(self.put_route(route).await);
            }
            done
        }
    }
    /// Adds a `blackhole` route for `dst` at the fail-closed metric, stamped `RTPROT_WEFT`.
    fn put_blackhole(&mut self, dst: IpNet) -> impl Future<Output = Result<(), ApplyError>>;
    fn del_route(&mut self, route: &ObservedRoute) -> impl Future<Output = Result<(), ApplyError>>;
    /// Deletes a link; one already gone is not an error.
    fn del_link(&mut self, link: &ObservedLink) -> impl Future<Output = Result<(), ApplyError>>;
    /// Writes made so far (for the "steady state makes zero writes" guarantee).
    fn writes(&self) -> u64;
}

/// A neighbour (`bridge` false: subnet address -> VTEP MAC) or FDB entry (`bridge` true:
/// VTEP MAC -> public IP) as the kernel holds it. `raw` is whatever the implementation
/// needs to delete exactly this entry.
#[derive(Debug, Clone)]
pub struct NeighbourEntry<R> {
    pub ip: Option<IpAddr>,
    pub mac: Vec<u8>,
    pub raw: R,
}

/// What the vxlan and ipip reconcilers need beyond links and routes: the vxlan device
/// itself and the neighbour and FDB entries on it, and the ipip device.
pub trait VxlanNetlink: Netlink {
    type Raw: Clone;
    /// Every link (for finding stale vxlan devices).
    fn all_links(&mut self) -> impl Future<Output = Result<Vec<ObservedLink>, ApplyError>>;
    /// Creates the vxlan device `spec.device` with the settings `info` and `spec`'s MAC
    /// and MTU.
    fn create_vxlan(
        &mut self,
        spec: &crate::model::VxlanSpec,
        info: &VxlanInfo,
    ) -> impl Future<Output = Result<(), ApplyError>>;
    /// Creates the ipip device `spec.device` with the settings `info` and `spec`'s MTU.
    fn create_ipip(
        &mut self,
        spec: &crate::model::IpipSpec,
        info: &IpipInfo,
    ) -> impl Future<Output = Result<(), ApplyError>>;
    /// Creates the XFRM interface `spec.device` with the settings `info` and `spec`'s MTU.
    fn create_xfrm(
        &mut self,
        spec: &crate::model::IpsecSpec,
        info: &XfrmInfo,
    ) -> impl Future<Output = Result<(), ApplyError>>;
    fn set_mac(
        &mut self,
        link: &ObservedLink,
        mac: &[u8; 6],
    ) -> impl Future<Output = Result<(), ApplyError>>;
    /// The link's FDB entries (`bridge`), or its permanent neighbour entries.
    fn entries(
        &mut self,
        link: &ObservedLink,
        bridge: bool,
    ) -> impl Future<Output = Result<Vec<NeighbourEntry<Self::Raw>>, ApplyError>>;
    /// Adds or replaces the permanent neighbour `ip` -> `mac`.
    fn put_neighbour(
        &mut self,
        link: &ObservedLink,
        ip: IpAddr,
        mac: &[u8; 6],
    ) -> impl Future<Output = Result<(), ApplyError>>;
    /// Adds or replaces the permanent FDB entry `mac` -> `dst`.
    fn put_fdb(
        &mut self,
        link: &ObservedLink,
        mac: &[u8; 6],
        dst: IpAddr,
    ) -> impl Future<Output = Result<(), ApplyError>>;
    /// Deletes one entry; `what` names it for the error.
    fn delete_entry(
        &mut self,
        entry: &NeighbourEntry<Self::Raw>,
        what: &str,
    ) -> impl Future<Output = Result<(), ApplyError>>;
}
