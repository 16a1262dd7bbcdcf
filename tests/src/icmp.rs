//! One ICMP echo from inside a named network namespace, sent and awaited by the test
//! process itself on a raw socket: what `ping -c 1 -W 1` proves (a request out, its reply
//! back through the real network), without starting a process. Under the VM's emulation
//! each `ping` costs about 0.1 s of CPU to start, and the lab pings every pod pair often.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use weft::liveness::probe::echo_request;

const REPLY_V4: u8 = 0;
const REPLY_V6: u8 = 129;
const PAYLOAD: &[u8; 16] = b"weft-lab echo...";

/// Each echo's identifier, so concurrent echoes (and other pings in the namespace) are told
/// apart: a raw socket receives every ICMP message of its namespace.
static NEXT_ID: AtomicU16 = AtomicU16::new(1);

/// Sends one echo request to `to` from namespace `ns` and waits up to `timeout` for its
/// reply. `Ok(false)`: no reply in time, or the request could not be sent (no route yet,
/// say); `Err`: the namespace or the socket could not be had.
pub fn echo(ns: &str, to: IpAddr, timeout: Duration) -> io::Result<bool> {
    let salt = (std::process::id() as u16).wrapping_mul(7919);
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed) ^ salt;
    match crate::netns::in_named_netns(ns, move || echo_here(to, id, timeout)).join() {
        Ok(Ok(answered)) => answered,
        Ok(Err(e)) => Err(e),
        Err(_) => Err(io::Error::other("the echo thread panicked")),
    }
}

/// `echo` in this thread's network namespace.
fn echo_here(to: IpAddr, id: u16, timeout: Duration) -> io::Result<bool> {
    let (domain, protocol) = match to {
        IpAddr::V4(_) => (libc::AF_INET, libc::IPPROTO_ICMP),
        IpAddr::V6(_) => (libc::AF_INET6, libc::IPPROTO_ICMPV6),
    };
    // SAFETY: socket(2) with constant arguments; the fd is owned at once.
    let fd = unsafe { libc::socket(domain, libc::SOCK_RAW | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd that nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let request = echo_request(to.is_ipv6(), id, 1, PAYLOAD);
    let (address, length) = socket_address(to);
    // SAFETY: sendto(2) with a buffer and an address that outlive the call.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
            (&address as *const libc::sockaddr_storage).cast(),
            length,
        )
    };
    if sent < 0 {
        return Ok(false);
    }
    let deadline = Instant::now() + timeout;
    let mut buffer = [0u8; 1500];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !readable(&socket, left)? {
            return Ok(false);
        }
        // SAFETY: an all-zero sockaddr_storage is valid (family unspecified).
        let mut from: libc::sockaddr_storage = unsafe { zeroed() };
        let mut from_length = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: recvfrom(2) into buffers that outlive the call, their sizes given.
        let got = unsafe {
            libc::recvfrom(
                socket.as_raw_fd(),
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                libc::MSG_DONTWAIT,
                (&mut from as *mut libc::sockaddr_storage).cast(),
                &mut from_length,
            )
        };
        let Ok(got) = usize::try_from(got) else {
            continue;
        };
        if peer_of(&from) == Some(to) && is_reply(to, &buffer[..got], id) {
            return Ok(true);
        }
    }
}

/// Whether `socket` has a message within `wait`.
fn readable(socket: &OwnedFd, wait: Duration) -> io::Result<bool> {
    let mut poll = libc::pollfd {
        fd: socket.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = wait.as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: poll(2) on one pollfd that outlives the call.
    match unsafe { libc::poll(&mut poll, 1, millis) } {
        n if n > 0 => Ok(true),
        0 => Ok(false),
        _ => match io::Error::last_os_error() {
            e if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            e => Err(e),
        },
    }
}

/// Whether `message` is the reply to echo `id`: an IPv4 raw socket's message starts with
/// the IP header, an IPv6 one's with the ICMPv6 header.
fn is_reply(to: IpAddr, message: &[u8], id: u16) -> bool {
    let (icmp, reply) = match to {
        IpAddr::V4(_) => {
            let header = usize::from(message.first().map_or(0, |b| b & 0x0f)) * 4;
            (message.get(header..).unwrap_or_default(), REPLY_V4)
        }
        IpAddr::V6(_) => (message, REPLY_V6),
    };
    icmp.len() >= 8 && icmp[0] == reply && icmp[4..6] == id.to_be_bytes()
}

fn socket_address(to: IpAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_storage is valid; the family's fields are set below.
    let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
    let length = match to {
        IpAddr::V4(a) => {
            let sin = (&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>();
            // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_in.
            unsafe {
                (*sin).sin_family = libc::AF_INET as libc::sa_family_t;
                (*sin).sin_addr.s_addr = u32::from_ne_bytes(a.octets());
            }
            size_of::<libc::sockaddr_in>()
        }
        IpAddr::V6(a) => {
            let sin6 = (&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>();
            // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_in6.
            unsafe {
                (*sin6).sin6_family = libc::AF_INET6 as libc::sa_family_t;
                (*sin6).sin6_addr.s6_addr = a.octets();
            }
            size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, length as libc::socklen_t)
}

/// The address a message came from.
fn peer_of(from: &libc::sockaddr_storage) -> Option<IpAddr> {
    match i32::from(from.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin =
                unsafe { &*(from as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()).into())
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6 =
                unsafe { &*(from as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Some(Ipv6Addr::from(sin6.sin6_addr.s6_addr).into())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_is_the_internet_checksum() {
        use weft::liveness::probe::checksum;
        // RFC 1071's example: 0001 f203 f4f5 f6f7 sums to ddf2, complemented 220d.
        assert_eq!(
            checksum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            0x220d
        );
        // A request with its checksum in place sums to zero.
        assert_eq!(checksum(&echo_request(false, 0x1234, 1, PAYLOAD)), 0);
    }

    #[test]
    fn a_reply_is_told_from_a_request_and_from_another_echo() {
        let mut ip = vec![0x45u8; 1];
        ip.extend_from_slice(&[0; 19]);
        let mut reply = echo_request(false, 7, 1, PAYLOAD);
        reply[0] = REPLY_V4;
        let to: IpAddr = Ipv4Addr::LOCALHOST.into();
        assert!(is_reply(to, &[ip.clone(), reply.clone()].concat(), 7));
        assert!(!is_reply(to, &[ip.clone(), reply].concat(), 8));
        assert!(!is_reply(
            to,
            &[ip, echo_request(false, 7, 1, PAYLOAD)].concat(),
            7
        ));
    }

    #[test]
    fn echoes_are_answered_in_a_namespace_and_an_unrouted_address_is_not() {
        let ns = format!("wicmp{}", std::process::id());
        let run = |args: &[&str]| std::process::Command::new("ip").args(args).status();
        assert!(run(&["netns", "add", &ns]).unwrap().success(), "needs root");
        run(&["-n", &ns, "link", "set", "lo", "up"]).unwrap();
        let answered = echo(&ns, Ipv4Addr::LOCALHOST.into(), Duration::from_secs(1));
        let answered6 = echo(&ns, Ipv6Addr::LOCALHOST.into(), Duration::from_secs(1));
        let unrouted = echo(
            &ns,
            Ipv4Addr::new(192, 0, 2, 1).into(),
            Duration::from_millis(200),
        );
        run(&["netns", "del", &ns]).unwrap();
        assert!(answered.unwrap());
        assert!(answered6.unwrap());
        assert!(!unrouted.unwrap());
    }
}
