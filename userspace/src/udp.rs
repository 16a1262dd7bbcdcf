//! The device's UDP sockets: one for IPv4, one for IPv6, on the listen port. Sends go out
//! as UDP GSO batches (`UDP_SEGMENT`: many equal-sized datagrams in one call), receives
//! come in as GRO batches (`UDP_GRO`: many datagrams of one flow in one 64 KiB read).
//! Each is probed at start; where a kernel or a route refuses GSO (`EIO`), sends fall
//! back to `sendmmsg` for good.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;
use nix::sys::socket::{
    recvmsg, sendmmsg, sendmsg, setsockopt, sockopt, ControlMessage, ControlMessageOwned, MsgFlags,
    MultiHeaders, SockaddrStorage,
};
use socket2::{Domain, Protocol, Socket, Type};

/// How long a bind waits for a port that is being released.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);
/// Socket buffers: room for a few GRO batches in flight.
const BUFFER_BYTES: usize = 7 << 20;
/// The most datagrams one GSO send may carry (the kernel's UDP_MAX_SEGMENTS).
pub const MAX_SEGMENTS: usize = 64;
/// The most bytes one GSO send may carry (one IP packet's worth, less the headers).
pub const MAX_GSO_BYTES: usize = 65_000;

/// A local address datagrams arrived on, and its interface: the address a reply goes out
/// from (IP_PKTINFO / IPV6_PKTINFO), as kernel WireGuard answers a peer from the address
/// the peer chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Local {
    pub ip: IpAddr,
    pub ifindex: u32,
}

/// Where a datagram goes: the peer's address, and the local address to send it from if
/// one is known (`None`: the route's choice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub to: SocketAddr,
    pub from: Option<Local>,
}

impl Endpoint {
    /// `to`, from whatever address the route chooses.
    pub fn to(to: SocketAddr) -> Endpoint {
        Endpoint { to, from: None }
    }
}

/// Whether a send with a source address failed because of that address: it is no longer
/// this host's (removed, or on an interface that went down), so the kernel refuses it.
fn source_refused(e: Errno) -> bool {
    matches!(e, Errno::EINVAL | Errno::EADDRNOTAVAIL | Errno::ENETUNREACH)
}

/// The control message that sends from `from`: IPv4 by its address alone (the route picks
/// the interface), IPv6 with its interface only for a link-local address, which needs
/// one.
enum SourceCmsg {
    V4(libc::in_pktinfo),
    V6(libc::in6_pktinfo),
}

impl SourceCmsg {
    fn new(from: Local) -> SourceCmsg {
        match from.ip {
            IpAddr::V4(ip) => SourceCmsg::V4(libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: libc::in_addr {
                    s_addr: u32::from(ip).to_be(),
                },
                ipi_addr: libc::in_addr { s_addr: 0 },
            }),
            IpAddr::V6(ip) => SourceCmsg::V6(libc::in6_pktinfo {
                ipi6_addr: libc::in6_addr {
                    s6_addr: ip.octets(),
                },
                ipi6_ifindex: if ip.is_unicast_link_local() {
                    from.ifindex
                } else {
                    0
                },
            }),
        }
    }

    fn message(&self) -> ControlMessage<'_> {
        match self {
            SourceCmsg::V4(info) => ControlMessage::Ipv4PacketInfo(info),
            SourceCmsg::V6(info) => ControlMessage::Ipv6PacketInfo(info),
        }
    }

    /// Room for it in a message's control buffer.
    fn space(&self) -> Vec<u8> {
        match self {
            SourceCmsg::V4(_) => nix::cmsg_space!(libc::in_pktinfo),
            SourceCmsg::V6(_) => nix::cmsg_space!(libc::in6_pktinfo),
        }
    }
}

pub struct Udp {
    pub v4: Option<Socket>,
    pub v6: Option<Socket>,
    pub port: u16,
    gso: AtomicBool,
    pub gro: bool,
}

fn bind(domain: Domain, port: u16, fwmark: u32) -> io::Result<Socket> {
    let socket = Socket::new(domain, Type::DGRAM.cloexec(), Some(Protocol::UDP))?;
    let ip: IpAddr = if domain == Domain::IPV6 {
        socket.set_only_v6(true)?;
        Ipv6Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    };
    // No SO_REUSEADDR: with it, any process on the host that sets it too could bind the
    // same port and take the tunnel's datagrams. A device that replaces another waits for
    // the old process to be gone (the agent's `stop_server`; `Udp::bind_retrying`).
    // The outer don't-fragment policy, per family. IPv4: never set, as kernel WireGuard
    // does not; a path narrower than a datagram fragments it rather than dropping it, so
    // no datagram is lost to a narrow path even before its MTU is known (the agent then
    // gives the peer's routes the MTU that avoids fragments). IPv6: routers never
    // fragment, so the kernel's own choice stands (fragment at the source to the path
    // MTU it learned).
    if domain == Domain::IPV4 {
        setsockopt_at(
            socket.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DONT as usize,
        )?;
    }
    // Each datagram's local address comes with it, for the replies (best effort: without
    // it, replies go from the route's choice).
    let _ = if domain == Domain::IPV4 {
        setsockopt(&socket, sockopt::Ipv4PacketInfo, &true)
    } else {
        setsockopt(&socket, sockopt::Ipv6RecvPacketInfo, &true)
    };
    if fwmark != 0 {
        socket.set_mark(fwmark)?;
    }
    // As root the limits do not apply (…BUFFORCE); otherwise take what the limits allow.
    let fd = socket.as_raw_fd();
    if setsockopt_int(fd, libc::SO_RCVBUFFORCE, BUFFER_BYTES).is_err() {
        let _ = socket.set_recv_buffer_size(BUFFER_BYTES);
    }
    if setsockopt_int(fd, libc::SO_SNDBUFFORCE, BUFFER_BYTES).is_err() {
        let _ = socket.set_send_buffer_size(BUFFER_BYTES);
    }
    socket.bind(&SocketAddr::new(ip, port).into())?;
    Ok(socket)
}

fn setsockopt_int(fd: RawFd, option: libc::c_int, value: usize) -> io::Result<()> {
    setsockopt_at(fd, libc::SOL_SOCKET, option, value)
}

fn setsockopt_at(
    fd: RawFd,
    level: libc::c_int,
    option: libc::c_int,
    value: usize,
) -> io::Result<()> {
    let value = value as libc::c_int;
    // SAFETY: a valid int option of the right size for `level`.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            option,
            &value as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl Udp {
    /// Binds the port (0: any free port, the same for both families) and probes GSO/GRO.
    /// IPv6 is optional (a host without it still runs IPv4).
    pub fn bind(port: u16, fwmark: u32) -> io::Result<Udp> {
        let v4 = bind(Domain::IPV4, port, fwmark)?;
        let port = v4.local_addr()?.as_socket().map_or(port, |a| a.port());
        // A host without IPv6 gets no IPv6 socket; a port taken on IPv6 is an error.
        let v6 = match bind(Domain::IPV6, port, fwmark) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => return Err(e),
            Err(_) => None,
        };
        let gso = setsockopt(&v4, sockopt::UdpGsoSegment, &0).is_ok();
        let mut gro = setsockopt(&v4, sockopt::UdpGroSegment, &true).is_ok();
        if let Some(v6) = &v6 {
            gro &= setsockopt(v6, sockopt::UdpGroSegment, &true).is_ok();
        }
        Ok(Udp {
            v4: Some(v4),
            v6,
            port,
            gso: AtomicBool::new(gso),
            gro,
        })
    }

    /// As `bind`, waiting up to `RELEASE_WAIT` for a port another process is releasing
    /// (a device that went away a moment ago: a closed socket frees its port at once,
    /// but the process may be in the middle of exiting).
    pub fn bind_retrying(port: u16, fwmark: u32) -> io::Result<Udp> {
        let deadline = std::time::Instant::now() + RELEASE_WAIT;
        loop {
            match Udp::bind(port, fwmark) {
                Err(e)
                    if e.kind() == io::ErrorKind::AddrInUse
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                other => return other,
            }
        }
    }

    /// Wakes and ends the receivers blocked on these sockets.
    pub fn shutdown(&self) {
        for s in [&self.v4, &self.v6].into_iter().flatten() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    pub fn set_mark(&self, fwmark: u32) -> io::Result<()> {
        for s in [&self.v4, &self.v6].into_iter().flatten() {
            s.set_mark(fwmark)?;
        }
        Ok(())
    }

    pub fn gso(&self) -> bool {
        self.gso.load(Ordering::Relaxed)
    }

    fn socket_for(&self, to: &SocketAddr) -> io::Result<&Socket> {
        let socket = if to.is_ipv4() { &self.v4 } else { &self.v6 };
        socket.as_ref().ok_or_else(|| {
            io::Error::new(io::ErrorKind::AddrNotAvailable, "no socket for this family")
        })
    }

    /// Sends one datagram to `ep`, from its local address if it has one. A local address
    /// the kernel refuses (it is gone) is dropped from `ep` and the datagram goes from the
    /// route's choice at once, as kernel WireGuard does.
    pub fn send(&self, ep: &mut Endpoint, datagram: &[u8]) -> io::Result<()> {
        let socket = self.socket_for(&ep.to)?;
        let addr = SockaddrStorage::from(ep.to);
        let iov = [IoSlice::new(datagram)];
        if let Some(from) = ep.from {
            let source = SourceCmsg::new(from);
            let cmsg = [source.message()];
            match sendmsg(
                socket.as_raw_fd(),
                &iov,
                &cmsg,
                MsgFlags::empty(),
                Some(&addr),
            ) {
                Ok(_) => return Ok(()),
                Err(e) if source_refused(e) => ep.from = None,
                Err(e) => return Err(e.into()),
            }
        }
        sendmsg(
            socket.as_raw_fd(),
            &iov,
            &[],
            MsgFlags::empty(),
            Some(&addr),
        )?;
        Ok(())
    }

    /// Sends `buf` as datagrams of `segment` bytes each (the last may be shorter) to `ep`:
    /// one GSO call where the kernel takes it, else one `sendmmsg`. The local address as
    /// in `send`.
    pub fn send_batch(&self, ep: &mut Endpoint, buf: &[u8], segment: usize) -> io::Result<()> {
        if buf.len() <= segment {
            return self.send(ep, buf);
        }
        if ep.from.is_some() {
            match self.batch_from(ep.to, ep.from, buf, segment) {
                Err(e) if source_refused(e) => ep.from = None,
                other => return other.map_err(io::Error::from),
            }
        }
        self.batch_from(ep.to, None, buf, segment)
            .map_err(io::Error::from)
    }

    fn batch_from(
        &self,
        to: SocketAddr,
        from: Option<Local>,
        buf: &[u8],
        segment: usize,
    ) -> Result<(), Errno> {
        let socket = self.socket_for(&to).map_err(|_| Errno::EAFNOSUPPORT)?;
        let addr = SockaddrStorage::from(to);
        let source = from.map(SourceCmsg::new);
        let cmsgs: Vec<ControlMessage> = source.iter().map(SourceCmsg::message).collect();
        if self.gso() {
            let size = segment as u16;
            let mut with_gso = cmsgs.clone();
            with_gso.push(ControlMessage::UdpGsoSegments(&size));
            let iov = [IoSlice::new(buf)];
            match sendmsg(
                socket.as_raw_fd(),
                &iov,
                &with_gso,
                MsgFlags::empty(),
                Some(&addr),
            ) {
                Ok(_) => return Ok(()),
                Err(Errno::EIO) => {
                    self.gso.store(false, Ordering::Relaxed);
                    tracing::warn!("UDP GSO refused by the kernel (EIO): sending with sendmmsg");
                }
                // EINVAL is how the kernel refuses a source address that is no longer
                // this host's, and also a GSO batch on a path known to be narrower than a
                // segment: the first is the caller's to drop.
                Err(e) if from.is_some_and(|f| !is_local(f)) && source_refused(e) => return Err(e),
                // The narrow path: this batch goes one datagram at a time, each
                // fragmented by the kernel, never dropped.
                Err(Errno::EMSGSIZE | Errno::EINVAL) => {}
                Err(e) => return Err(e),
            }
        }
        let slices: Vec<[IoSlice; 1]> = buf.chunks(segment).map(|c| [IoSlice::new(c)]).collect();
        let addrs = vec![Some(addr); slices.len()];
        let space = source.as_ref().map(SourceCmsg::space);
        let mut headers = MultiHeaders::<SockaddrStorage>::preallocate(slices.len(), space);
        sendmmsg(
            socket.as_raw_fd(),
            &mut headers,
            &slices,
            &addrs,
            &cmsgs,
            MsgFlags::empty(),
        )?;
        Ok(())
    }
}

/// Whether `local` is still an address of this host (a socket can bind it).
fn is_local(local: Local) -> bool {
    let (domain, addr) = match local.ip {
        IpAddr::V4(ip) => (Domain::IPV4, SocketAddr::from((ip, 0))),
        IpAddr::V6(ip) => (
            Domain::IPV6,
            SocketAddr::V6(std::net::SocketAddrV6::new(ip, 0, 0, local.ifindex)),
        ),
    };
    Socket::new(domain, Type::DGRAM.cloexec(), Some(Protocol::UDP))
        .and_then(|s| s.bind(&addr.into()))
        .is_ok()
}

/// One receive: the datagrams in `buf[..len]`, each `segment` bytes but the last, from
/// `from`, to this host's `local` address (when the socket reports it).
pub struct Batch {
    pub from: SocketAddr,
    pub local: Option<Local>,
    pub len: usize,
    pub segment: usize,
}

/// Room for what `receive` reads beside the data: the GRO segment size and the local
/// address.
pub fn cmsg_buffer() -> Vec<u8> {
    nix::cmsg_space!(libc::c_int, libc::in6_pktinfo)
}

/// Blocks for the next datagram or GRO batch on `fd`; `None` when the read returned
/// nothing from nobody: the socket was shut down.
pub fn receive(fd: RawFd, buf: &mut [u8], cmsg: &mut [u8]) -> io::Result<Option<Batch>> {
    receive_with(fd, buf, cmsg, MsgFlags::empty())
}

/// As `receive`, without waiting: `WouldBlock` when nothing is there now.
pub fn receive_now(fd: RawFd, buf: &mut [u8], cmsg: &mut [u8]) -> io::Result<Option<Batch>> {
    receive_with(fd, buf, cmsg, MsgFlags::MSG_DONTWAIT)
}

fn receive_with(
    fd: RawFd,
    buf: &mut [u8],
    cmsg: &mut [u8],
    flags: MsgFlags,
) -> io::Result<Option<Batch>> {
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<SockaddrStorage>(fd, &mut iov, Some(cmsg), flags)?;
    let len = msg.bytes;
    let mut segment = len;
    let mut local = None;
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            match c {
                ControlMessageOwned::UdpGroSegments(size) => {
                    segment = usize::try_from(size).unwrap_or(len).max(1);
                }
                ControlMessageOwned::Ipv4PacketInfo(info) => {
                    local = Some(Local {
                        ip: IpAddr::V4(u32::from_be(info.ipi_addr.s_addr).into()),
                        ifindex: u32::try_from(info.ipi_ifindex).unwrap_or(0),
                    });
                }
                ControlMessageOwned::Ipv6PacketInfo(info) => {
                    local = Some(Local {
                        ip: IpAddr::V6(info.ipi6_addr.s6_addr.into()),
                        ifindex: info.ipi6_ifindex,
                    });
                }
                _ => {}
            }
        }
    }
    let from = msg.address.and_then(|a| {
        a.as_sockaddr_in()
            .map(|v4| SocketAddr::from(std::net::SocketAddrV4::from(*v4)))
            .or_else(|| {
                a.as_sockaddr_in6()
                    .map(|v6| SocketAddr::from(std::net::SocketAddrV6::from(*v6)))
            })
    });
    let Some(from) = from else {
        if len == 0 {
            return Ok(None);
        }
        return Err(io::Error::other("a datagram without a source address"));
    };
    Ok(Some(Batch {
        from,
        local,
        len,
        segment,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn received(udp: &Udp, v6: bool) -> Batch {
        let socket = if v6 { &udp.v6 } else { &udp.v4 };
        let fd = socket.as_ref().map(|s| s.as_raw_fd()).unwrap_or(-1);
        let (mut buf, mut cmsg) = (vec![0u8; 2048], cmsg_buffer());
        receive(fd, &mut buf, &mut cmsg).unwrap().unwrap()
    }

    /// A datagram's local address comes with it, a send from a given local address goes
    /// from it, and a local address that is not this host's is dropped from the endpoint
    /// and the datagram sent from the route's choice all the same.
    #[test]
    fn replies_go_from_the_address_a_datagram_came_to() {
        let (a, b) = (Udp::bind(0, 0).unwrap(), Udp::bind(0, 0).unwrap());
        for ip in ["127.0.0.1", "::1"] {
            let ip: IpAddr = ip.parse().unwrap();
            let from = Local { ip, ifindex: 1 };
            let mut ep = Endpoint {
                to: SocketAddr::new(ip, b.port),
                from: Some(from),
            };
            a.send(&mut ep, b"hello").unwrap();
            assert_eq!(ep.from, Some(from), "kept: {ip}");
            let got = received(&b, ip.is_ipv6());
            assert_eq!(got.len, 5);
            assert_eq!(got.local.map(|l| l.ip), Some(ip));
            assert_eq!(got.from.port(), a.port);
        }
        for (stranger, to) in [("192.0.2.1", "127.0.0.1"), ("2001:db8::1", "::1")] {
            let to: IpAddr = to.parse().unwrap();
            let mut ep = Endpoint {
                to: SocketAddr::new(to, b.port),
                from: Some(Local {
                    ip: stranger.parse().unwrap(),
                    ifindex: 0,
                }),
            };
            a.send(&mut ep, b"x").unwrap();
            assert_eq!(ep.from, None, "dropped: {stranger}");
            assert_eq!(received(&b, to.is_ipv6()).len, 1);
            let mut ep = Endpoint {
                to: SocketAddr::new(to, b.port),
                from: Some(Local {
                    ip: stranger.parse().unwrap(),
                    ifindex: 0,
                }),
            };
            a.send_batch(&mut ep, &[7u8; 300], 100).unwrap();
            assert_eq!(ep.from, None, "dropped from a batch: {stranger}");
            // One GRO batch, or the first datagram of three.
            assert!(matches!(received(&b, to.is_ipv6()).len, 100 | 300));
        }
    }
}
