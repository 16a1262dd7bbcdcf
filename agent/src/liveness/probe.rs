//! The liveness probe: one ICMP echo request through the tunnel to a peer's tunnel
//! address (its subnet's network address, which weft and flannel put on the peer's
//! device). The peer's kernel answers it at once, and the answer arrives on our device as
//! authenticated data: its received-bytes counter moving is the answer, so the reply
//! itself is never read (the sockets filter every incoming ICMP message out).
//! Raw sockets: the agent has CAP_NET_RAW.

use std::io;
use std::net::{IpAddr, SocketAddr};

use socket2::{Domain, Protocol, Socket, Type};

const ECHO_REQUEST_V4: u8 = 8;
const ECHO_REQUEST_V6: u8 = 128;
/// `SOL_RAW` / `ICMP_FILTER` (linux/icmp.h), and `ICMP6_FILTER` (linux/icmpv6.h).
const SOL_RAW: libc::c_int = 255;
const ICMP_FILTER: libc::c_int = 1;
const ICMP6_FILTER: libc::c_int = 1;
const PAYLOAD: &[u8] = b"weft liveness";

/// The two sockets, opened when first needed.
#[derive(Default)]
pub struct Prober {
    v4: Option<Socket>,
    v6: Option<Socket>,
    sequence: u16,
}

/// The Internet checksum (RFC 1071) of `data`.
pub fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An ICMP echo request (ICMPv6 with `v6`) with `id`, `sequence` and `payload`; the
/// checksum is ours to fill for IPv4 (the kernel fills ICMPv6's).
pub fn echo_request(v6: bool, id: u16, sequence: u16, payload: &[u8]) -> Vec<u8> {
    let kind = if v6 { ECHO_REQUEST_V6 } else { ECHO_REQUEST_V4 };
    let mut packet = vec![kind, 0, 0, 0];
    packet.extend_from_slice(&id.to_be_bytes());
    packet.extend_from_slice(&sequence.to_be_bytes());
    packet.extend_from_slice(payload);
    if !v6 {
        let sum = checksum(&packet);
        packet[2..4].copy_from_slice(&sum.to_be_bytes());
    }
    packet
}

/// This agent's probe: its process id as the identifier.
fn echo(v6: bool, sequence: u16) -> Vec<u8> {
    echo_request(v6, (std::process::id() & 0xffff) as u16, sequence, PAYLOAD)
}

fn open(v6: bool) -> io::Result<Socket> {
    let (domain, protocol) = if v6 {
        (Domain::IPV6, Protocol::ICMPV6)
    } else {
        (Domain::IPV4, Protocol::ICMPV4)
    };
    let socket = Socket::new(domain, Type::RAW, Some(protocol))?;
    socket.set_nonblocking(true)?;
    // Nothing is read: every incoming type is filtered out (a set bit blocks a type).
    let (level, name, filter): (libc::c_int, libc::c_int, Vec<u32>) = if v6 {
        (libc::IPPROTO_ICMPV6, ICMP6_FILTER, vec![u32::MAX; 8])
    } else {
        (SOL_RAW, ICMP_FILTER, vec![u32::MAX])
    };
    use std::os::fd::AsRawFd;
    // SAFETY: setsockopt(2) reads `len` bytes of `filter`, which outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            filter.as_ptr().cast(),
            (filter.len() * 4) as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(socket)
}

impl Prober {
    /// Sends one echo request to `to`.
    pub fn send(&mut self, to: IpAddr) -> io::Result<()> {
        let v6 = to.is_ipv6();
        let slot = if v6 { &mut self.v6 } else { &mut self.v4 };
        let socket = match slot {
            Some(s) => s,
            None => slot.insert(open(v6).map_err(|e| {
                io::Error::new(e.kind(), format!("opening a raw ICMP socket: {e}"))
            })?),
        };
        self.sequence = self.sequence.wrapping_add(1);
        socket
            .send_to(&echo(v6, self.sequence), &SocketAddr::new(to, 0).into())
            .map(|_| ())
            .map_err(|e| io::Error::new(e.kind(), format!("sending a probe to {to}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_echo_request_checks_out() {
        let p = echo(false, 7);
        assert_eq!(p[0], 8);
        assert_eq!(&p[6..8], &7u16.to_be_bytes());
        // A packet with its checksum in place sums to zero.
        assert_eq!(checksum(&p), 0);
        assert_eq!(checksum(&[0x45, 0x00, 0x00, 0x1c]), !0x451cu16);
    }
}
