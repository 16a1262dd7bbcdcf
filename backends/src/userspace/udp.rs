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

    /// Sends one datagram.
    pub fn send(&self, to: SocketAddr, datagram: &[u8]) -> io::Result<()> {
        self.socket_for(&to)?.send_to(datagram, &to.into())?;
        Ok(())
    }

    /// Sends `buf` as datagrams of `segment` bytes each (the last may be shorter): one GSO
    /// call where the kernel takes it, else one `sendmmsg`.
    pub fn send_batch(&self, to: SocketAddr, buf: &[u8], segment: usize) -> io::Result<()> {
        if buf.len() <= segment {
            return self.send(to, buf);
        }
        let socket = self.socket_for(&to)?;
        let addr = SockaddrStorage::from(to);
        if self.gso() {
            let size = segment as u16;
            let cmsg = [ControlMessage::UdpGsoSegments(&size)];
            let iov = [IoSlice::new(buf)];
            match sendmsg(
                socket.as_raw_fd(),
                &iov,
                &cmsg,
                MsgFlags::empty(),
                Some(&addr),
            ) {
                Ok(_) => return Ok(()),
                Err(Errno::EIO) => {
                    self.gso.store(false, Ordering::Relaxed);
                    tracing::warn!("UDP GSO refused by the kernel (EIO): sending with sendmmsg");
                }
                // The path to `to` is known to be narrower than a segment (the kernel
                // refuses a GSO batch as a whole then): this batch goes one datagram at a
                // time, each fragmented by the kernel, never dropped.
                Err(Errno::EMSGSIZE | Errno::EINVAL) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let slices: Vec<[IoSlice; 1]> = buf.chunks(segment).map(|c| [IoSlice::new(c)]).collect();
        let addrs = vec![Some(addr); slices.len()];
        let mut headers = MultiHeaders::<SockaddrStorage>::preallocate(slices.len(), None);
        sendmmsg(
            socket.as_raw_fd(),
            &mut headers,
            &slices,
            &addrs,
            [],
            MsgFlags::empty(),
        )?;
        Ok(())
    }
}

/// One receive: the datagrams in `buf[..len]`, each `segment` bytes but the last.
pub struct Batch {
    pub from: SocketAddr,
    pub len: usize,
    pub segment: usize,
}

/// Blocks for the next datagram or GRO batch on `fd`.
pub fn receive(fd: RawFd, buf: &mut [u8], cmsg: &mut [u8]) -> io::Result<Batch> {
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<SockaddrStorage>(fd, &mut iov, Some(cmsg), MsgFlags::empty())?;
    let len = msg.bytes;
    let mut segment = len;
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::UdpGroSegments(size) = c {
                segment = usize::try_from(size).unwrap_or(len).max(1);
            }
        }
    }
    if len == 0 {
        // An empty datagram, or the socket was shut down: the caller tells them apart.
        return Ok(Batch {
            from: SocketAddr::from(([0, 0, 0, 0], 0)),
            len,
            segment,
        });
    }
    let from = msg
        .address
        .and_then(|a| {
            a.as_sockaddr_in()
                .map(|v4| SocketAddr::from(std::net::SocketAddrV4::from(*v4)))
                .or_else(|| {
                    a.as_sockaddr_in6()
                        .map(|v6| SocketAddr::from(std::net::SocketAddrV6::from(*v6)))
                })
        })
        .ok_or_else(|| io::Error::other("a datagram without a source address"))?;
    Ok(Batch { from, len, segment })
}
