//! `Netlink` over rtnetlink: the only code here that talks to the kernel's routing tables.
//! Every error names the operation, the object and the errno.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{InfoData, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteMetric,
    RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::{Handle, LinkUnspec, LinkWireguard, RouteMessageBuilder};

use super::netlink::{Netlink, ObservedLink, ObservedRoute, RouteWrite, RTPROT_WEFT};
use super::ApplyError;
use crate::model::{Family, FAIL_CLOSED_METRIC};

/// A rtnetlink connection, bound to the network namespace of the thread that opened it.
pub struct RtNetlink {
    pub(super) handle: Handle,
    pub(super) writes: u64,
    connection: tokio::task::JoinHandle<()>,
}

fn io_of(e: rtnetlink::Error) -> io::Error {
    match e {
        rtnetlink::Error::NetlinkError(msg) => msg.to_io(),
        other => io::Error::other(other.to_string()),
    }
}

pub(super) fn fail(op: String) -> impl FnOnce(rtnetlink::Error) -> ApplyError {
    move |e| ApplyError::Netlink {
        op,
        source: io_of(e),
    }
}

impl RtNetlink {
    /// Opens a connection; must run inside a tokio runtime.
    pub fn connect() -> Result<Self, ApplyError> {
        let (conn, handle, _) =
            rtnetlink::new_connection().map_err(|source| ApplyError::Netlink {
                op: "opening a rtnetlink socket".into(),
                source,
            })?;
        Ok(RtNetlink {
            handle,
            writes: 0,
            connection: tokio::spawn(conn),
        })
    }

    /// Creates a kernel WireGuard link; the kernel answers `EOPNOTSUPP` when it has no
    /// WireGuard (module missing or not built).
    pub async fn add_wireguard_link(&mut self, name: &str) -> Result<(), ApplyError> {
        let msg = LinkWireguard::new(name).build();
        self.add_link(msg, format!("creating WireGuard link {name}"))
            .await
    }

    /// Adds the link `msg` describes (one write); an error names `op`.
    pub(super) async fn add_link(
        &mut self,
        msg: LinkMessage,
        op: String,
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        self.handle
            .link()
            .add(msg)
            .execute()
            .await
            .map_err(fail(op))
    }

    pub(super) fn parse_link(msg: &LinkMessage) -> ObservedLink {
        let mut link = ObservedLink {
            index: msg.header.index,
            name: String::new(),
            mtu: 0,
            up: msg.header.flags.contains(LinkFlags::Up),
            kind: None,
            mac: Vec::new(),
            vxlan: None,
            ipip: None,
            xfrm: None,
        };
        for attr in &msg.attributes {
            match attr {
                LinkAttribute::IfName(n) => link.name = n.clone(),
                LinkAttribute::Mtu(m) => link.mtu = *m,
                LinkAttribute::Address(mac) => link.mac = mac.clone(),
                LinkAttribute::LinkInfo(infos) => {
                    for info in infos {
                        match info {
                            LinkInfo::Kind(kind) => link.kind = Some(kind.to_string()),
                            LinkInfo::Data(InfoData::Vxlan(attrs)) => {
                                link.vxlan = Some(super::rtnl_vxlan::info_of(attrs))
                            }
                            LinkInfo::Data(InfoData::IpTunnel(attrs)) => {
                                link.ipip = Some(super::rtnl_vxlan::ipip_info_of(attrs))
                            }
                            LinkInfo::Data(InfoData::Xfrm(attrs)) => {
                                link.xfrm = Some(super::rtnl_vxlan::xfrm_info_of(attrs))
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        link
    }

    async fn address_messages(
        &self,
        link: &ObservedLink,
    ) -> Result<Vec<AddressMessage>, ApplyError> {
        self.handle
            .address()
            .get()
            .set_link_index_filter(link.index)
            .execute()
            .try_collect()
            .await
            .map_err(fail(format!("listing addresses of {}", link.name)))
    }
}

/// Route writes a pass has in flight on the connection together (`put_routes`).
const ROUTES_IN_FLIGHT: usize = 64;

impl RtNetlink {
    /// Adds (or replaces, same destination) one route; `op` names it in errors.
    async fn add_route(
        &mut self,
        op: String,
        msg: io::Result<RouteMessage>,
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        put(self.handle.clone(), op, msg).await
    }
}

/// Sends one route add (replacing the same destination) and waits for its answer.
async fn put(handle: Handle, op: String, msg: io::Result<RouteMessage>) -> Result<(), ApplyError> {
    let msg = msg.map_err(|source| ApplyError::Netlink {
        op: op.clone(),
        source,
    })?;
    handle
        .route()
        .add(msg)
        .replace()
        .execute()
        .await
        .map_err(fail(op))
}

/// The request of `put_route`, and the words naming it in errors.
fn route_write(route: &RouteWrite) -> (String, io::Result<RouteMessage>) {
    let op = format!("adding route {} dev {}", route.dst, route.device);
    let msg = route_message(route.dst, Some(route.oif), route.gateway, None).map(|mut m| {
        if route.onlink {
            m.header.flags.insert(RouteFlags::Onlink);
        }
        if let Some(mtu) = route.mtu {
            m.attributes
                .push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(mtu)]));
        }
        m
    });
    (op, msg)
}

impl Drop for RtNetlink {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

pub(super) fn address_of(msg: &AddressMessage) -> Option<IpNet> {
    let local = msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    let address = msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Address(ip) => Some(*ip),
        _ => None,
    });
    let ip = local.or(address)?;
    if let IpAddr::V6(v6) = ip {
        if v6.segments()[0] & 0xffc0 == 0xfe80 {
            return None;
        }
    }
    IpNet::new(ip, msg.header.prefix_len).ok()
}

pub(super) fn route_of(msg: &RouteMessage) -> Option<ObservedRoute> {
    let table = msg.attributes.iter().find_map(|a| match a {
        RouteAttribute::Table(t) => Some(*t),
        _ => None,
    });
    let blackhole = msg.header.kind == RouteType::BlackHole;
    if table.unwrap_or(u32::from(msg.header.table)) != u32::from(RouteHeader::RT_TABLE_MAIN)
        || !(blackhole || msg.header.kind == RouteType::Unicast)
    {
        return None;
    }
    let addr = |a: &RouteAddress| match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    };
    let mut dst = None;
    let mut route = ObservedRoute {
        dst: IpNet::default(),
        oif: None,
        gateway: None,
        protocol: u8::from(msg.header.protocol),
        blackhole,
        metric: 0,
        mtu: None,
    };
    for attr in &msg.attributes {
        match attr {
            RouteAttribute::Destination(a) => dst = addr(a),
            RouteAttribute::Gateway(a) => route.gateway = addr(a),
            RouteAttribute::Oif(i) => route.oif = Some(*i),
            RouteAttribute::Priority(m) => route.metric = *m,
            RouteAttribute::Metrics(metrics) => {
                route.mtu = metrics.iter().find_map(|m| match m {
                    RouteMetric::Mtu(mtu) if *mtu > 0 => Some(*mtu),
                    _ => None,
                })
            }
            _ => {}
        }
    }
    let dst = dst.unwrap_or(match msg.header.address_family {
        netlink_packet_route::AddressFamily::Inet6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    });
    route.dst = IpNet::new(dst, msg.header.destination_prefix_length).ok()?;
    Some(route)
}

/// A weft route message: unicast via `oif`/`gateway`, or a blackhole at `blackhole`'s metric.
fn route_message(
    dst: IpNet,
    oif: Option<u32>,
    gateway: Option<IpAddr>,
    blackhole: Option<u32>,
) -> io::Result<RouteMessage> {
    let invalid = |e| io::Error::new(io::ErrorKind::InvalidInput, e);
    let mut builder = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(dst.addr(), dst.prefix_len())
        .map_err(invalid)?
        .protocol(RouteProtocol::from(RTPROT_WEFT));
    if let Some(metric) = blackhole {
        return Ok(builder.kind(RouteType::BlackHole).priority(metric).build());
    }
    if let Some(oif) = oif {
        builder = builder.output_interface(oif);
    }
    match gateway {
        Some(gw) => builder = builder.gateway(gw).map_err(invalid)?,
        // A device route reaches its destination directly: scope link, as iproute2 sets it.
        None => builder = builder.scope(RouteScope::Link),
    }
    Ok(builder.build())
}

impl Netlink for RtNetlink {
    async fn del_link(&mut self, link: &ObservedLink) -> Result<(), ApplyError> {
        self.writes += 1;
        match self.handle.link().del(link.index).execute().await {
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code().abs() == libc::ENODEV => Ok(()),
            other => other.map_err(fail(format!("deleting link {}", link.name))),
        }
    }

    async fn link(&mut self, name: &str) -> Result<Option<ObservedLink>, ApplyError> {
        let found = self
            .handle
            .link()
            .get()
            .match_name(name.to_string())
            .execute()
            .try_next()
            .await;
        match found {
            Ok(Some(msg)) => Ok(Some(Self::parse_link(&msg))),
            Ok(None) => Ok(None),
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code().abs() == libc::ENODEV => {
                Ok(None)
            }
            Err(e) => Err(fail(format!("looking up link {name}"))(e)),
        }
    }

    async fn set_link(
        &mut self,
        link: &ObservedLink,
        mtu: u32,
        up: bool,
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        let mut msg = LinkUnspec::new_with_index(link.index).mtu(mtu);
        if up {
            msg = msg.up();
        }
        self.handle
            .link()
            .set(msg.build())
            .execute()
            .await
            .map_err(fail(format!(
                "setting link {} mtu {mtu}{}",
                link.name,
                if up { " up" } else { "" }
            )))
    }

    async fn addresses(&mut self, link: &ObservedLink) -> Result<Vec<IpNet>, ApplyError> {
        Ok(self
            .address_messages(link)
            .await?
            .iter()
            .filter_map(address_of)
            .collect())
    }

    async fn add_address(&mut self, link: &ObservedLink, addr: IpNet) -> Result<(), ApplyError> {
        self.writes += 1;
        self.handle
            .address()
            .add(link.index, addr.addr(), addr.prefix_len())
            .execute()
            .await
            .map_err(fail(format!("adding address {addr} dev {}", link.name)))
    }

    async fn del_address(&mut self, link: &ObservedLink, addr: IpNet) -> Result<(), ApplyError> {
        let Some(msg) = self
            .address_messages(link)
            .await?
            .into_iter()
            .find(|m| address_of(m) == Some(addr))
        else {
            return Ok(());
        };
        self.writes += 1;
        self.handle
            .address()
            .del(msg)
            .execute()
            .await
            .map_err(fail(format!("removing address {addr} dev {}", link.name)))
    }

    async fn routes(&mut self, family: Family) -> Result<Vec<ObservedRoute>, ApplyError> {
        let request = match family {
            Family::Ipv4 => RouteMessageBuilder::<Ipv4Addr>::new().build(),
            Family::Ipv6 => RouteMessageBuilder::<Ipv6Addr>::new().build(),
        };
        let messages: Vec<RouteMessage> = self
            .handle
            .route()
            .get(request)
            .execute()
            .try_collect()
            .await
            .map_err(fail(format!("listing {family:?} routes")))?;
        Ok(messages.iter().filter_map(route_of).collect())
    }

    async fn put_route(&mut self, route: &RouteWrite) -> Result<(), ApplyError> {
        let (op, msg) = route_write(route);
        self.add_route(op, msg).await
    }

    /// Up to `ROUTES_IN_FLIGHT` requests outstanding at once: the kernel answers each in
    /// turn, and waiting for every answer before the next request was most of a first
    /// pass at 10,000 routes.
    async fn put_routes(&mut self, routes: &[&RouteWrite]) -> Vec<Result<(), ApplyError>> {
        use futures::stream::{self, StreamExt};
        self.writes += routes.len() as u64;
        let handle = &self.handle;
        stream::iter(routes.iter().map(|r| {
            let (op, msg) = route_write(r);
            put(handle.clone(), op, msg)
        }))
        .buffered(ROUTES_IN_FLIGHT)
        .collect()
        .await
    }

    async fn put_blackhole(&mut self, dst: IpNet) -> Result<(), ApplyError> {
        let msg = route_message(dst, None, None, Some(FAIL_CLOSED_METRIC));
        self.add_route(format!("adding blackhole route {dst}"), msg)
            .await
    }

    async fn del_route(&mut self, route: &ObservedRoute) -> Result<(), ApplyError> {
        let op = format!("removing route {}", route.dst);
        let msg = route_message(
            route.dst,
            route.oif,
            route.gateway,
            route.blackhole.then_some(route.metric),
        )
        .map_err(|e| ApplyError::Netlink {
            op: op.clone(),
            source: io::Error::other(e),
        })?;
        self.writes += 1;
        match self.handle.route().del(msg).execute().await {
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code().abs() == libc::ESRCH => Ok(()),
            other => other.map_err(fail(op)),
        }
    }

    fn writes(&self) -> u64 {
        self.writes
    }
}
