//! The UDP sockets of the agents' own traffic between nodes (path MTU probes,
//! post-quantum rounds): one per family on a port, the IPv6 one IPv6 only, so that both
//! families share the port.

use std::net::SocketAddr;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::UdpSocket;

/// A UDP socket of `addr`'s family, not bound yet: its options go on before `bind`.
pub(crate) fn socket(addr: SocketAddr) -> std::io::Result<Socket> {
    let domain = if addr.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    };
    let socket = Socket::new(domain, Type::DGRAM.cloexec(), Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    Ok(socket)
}

/// `socket` bound to `addr`, for tokio.
pub(crate) fn bind(socket: Socket, addr: SocketAddr) -> std::io::Result<UdpSocket> {
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    UdpSocket::from_std(socket.into())
}
