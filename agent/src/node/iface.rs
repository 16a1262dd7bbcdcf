//! The address this node advertises to its peers, chosen as flanneld chooses it:
//! `--public-ip`; else the first `--iface` (an interface name or one of its addresses)
//! that exists; else the first interface whose name or address matches an
//! `--iface-regex`; else the source address of the route to `--iface-can-reach`; else the
//! source address of the default route. (`local_ip` is the same choice without
//! `--public-ip`: the internal address when `--public-ip` names an external one.)

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, UdpSocket};

use anyhow::{bail, Context};
use regex::Regex;

use crate::cli::AgentArgs;

/// One IPv4 address of one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfaceAddr {
    pub name: String,
    pub addr: Ipv4Addr,
}

/// The IPv4 addresses of every interface in this network namespace, in the kernel's order.
pub fn interfaces() -> std::io::Result<Vec<IfaceAddr>> {
    Ok(addresses()?
        .into_iter()
        .filter_map(|(name, addr)| match addr {
            IpAddr::V4(addr) => Some(IfaceAddr { name, addr }),
            IpAddr::V6(_) => None,
        })
        .collect())
}

/// Every interface's addresses of both families, in the kernel's order.
fn addresses() -> std::io::Result<Vec<(String, IpAddr)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs(3) fills `head` with a list we free below with freeifaddrs(3).
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr whose family says how to read it.
        let addr = match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
            libc::AF_INET => {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        out.push((name, addr));
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The IPv6 address to advertise: `--public-ipv6`, else the first global IPv6 address of
/// the interface holding `local` (the chosen IPv4 address), as flanneld takes it.
/// `None` when that interface has none.
pub fn public_ipv6(args: &AgentArgs, local: Ipv4Addr) -> anyhow::Result<Option<Ipv6Addr>> {
    if args.public_ipv6.is_some() {
        return Ok(args.public_ipv6);
    }
    let all = addresses().context("listing the interfaces")?;
    let Some((iface, _)) = all.iter().find(|(_, a)| *a == IpAddr::V4(local)) else {
        return Ok(None);
    };
    Ok(all.iter().find_map(|(name, addr)| match addr {
        IpAddr::V6(a) if name == iface && is_global_v6(a) => Some(*a),
        _ => None,
    }))
}

/// Not link-local (fe80::/10), loopback, unspecified or multicast.
fn is_global_v6(a: &Ipv6Addr) -> bool {
    !(a.is_loopback()
        || a.is_unspecified()
        || a.is_multicast()
        || (a.segments()[0] & 0xffc0) == 0xfe80)
}

/// The address `--iface` / `--iface-regex` pick among `all`, if any flag is given:
/// `Ok(None)` when none is. An error says what was asked and what exists.
pub fn select(
    all: &[IfaceAddr],
    iface: &[String],
    regexes: &[Regex],
) -> Result<Option<Ipv4Addr>, String> {
    for wanted in iface {
        let by_addr = wanted.parse::<Ipv4Addr>().ok();
        if let Some(a) = all
            .iter()
            .find(|a| Some(a.addr) == by_addr || a.name == *wanted)
        {
            return Ok(Some(a.addr));
        }
    }
    for re in regexes {
        if let Some(a) = all
            .iter()
            .find(|a| re.is_match(&a.name) || re.is_match(&a.addr.to_string()))
        {
            return Ok(Some(a.addr));
        }
    }
    if iface.is_empty() && regexes.is_empty() {
        return Ok(None);
    }
    let have: Vec<String> = all
        .iter()
        .map(|a| format!("{} {}", a.name, a.addr))
        .collect();
    Err(format!(
        "no interface matches --iface {iface:?} / --iface-regex {:?}; this node has: {}",
        regexes.iter().map(Regex::as_str).collect::<Vec<_>>(),
        have.join(", ")
    ))
}

/// The source address the kernel uses towards `target` (a UDP `connect` sends nothing).
fn source_towards(target: IpAddr) -> anyhow::Result<Ipv4Addr> {
    let socket = UdpSocket::bind("0.0.0.0:0").context("opening a UDP socket")?;
    socket
        .connect((target, 9))
        .with_context(|| format!("finding the route to {target}"))?;
    match socket.local_addr()?.ip() {
        IpAddr::V4(ip) if !ip.is_unspecified() => Ok(ip),
        other => bail!("the route to {target} has source address {other}"),
    }
}

/// The address to advertise; see the module doc.
pub fn public_ip(args: &AgentArgs) -> anyhow::Result<Ipv4Addr> {
    match args.public_ip {
        Some(ip) => Ok(ip),
        None => local_ip(args),
    }
}

/// The node's own address on the chosen interface, whatever `--public-ip` says: with
/// `--public-ip` set to another (an external, NATed) address, this is the internal one
/// that peers in the same zone use.
pub fn local_ip(args: &AgentArgs) -> anyhow::Result<Ipv4Addr> {
    let regexes = args
        .iface_regex
        .iter()
        .map(|r| Regex::new(r).with_context(|| format!("--iface-regex {r:?}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let all = interfaces().context("listing the interfaces")?;
    if let Some(ip) = select(&all, &args.iface, &regexes).map_err(anyhow::Error::msg)? {
        return Ok(ip);
    }
    if let Some(target) = args.iface_can_reach {
        return source_towards(target).with_context(|| format!("--iface-can-reach {target}"));
    }
    source_towards(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 1))).context(
        "using the default route's address (no default route?); give --public-ip or --iface",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<IfaceAddr> {
        [
            ("lo", "127.0.0.1"),
            ("eth0", "198.51.100.7"),
            ("ens5", "10.0.0.7"),
        ]
        .iter()
        .map(|(n, a)| IfaceAddr {
            name: n.to_string(),
            addr: a.parse().unwrap(),
        })
        .collect()
    }

    #[test]
    fn iface_by_name_or_address_first_match_wins() {
        let pick = |iface: &[&str]| {
            let iface: Vec<String> = iface.iter().map(ToString::to_string).collect();
            select(&all(), &iface, &[])
        };
        assert_eq!(pick(&["ens5"]), Ok(Some("10.0.0.7".parse().unwrap())));
        assert_eq!(
            pick(&["198.51.100.7"]),
            Ok(Some("198.51.100.7".parse().unwrap()))
        );
        assert_eq!(
            pick(&["wlan0", "eth0"]),
            Ok(Some("198.51.100.7".parse().unwrap()))
        );
        assert_eq!(pick(&[]), Ok(None));
        let err = pick(&["wlan0"]).unwrap_err();
        assert!(
            err.contains("\"wlan0\"") && err.contains("eth0 198.51.100.7"),
            "{err}"
        );
    }

    #[test]
    fn iface_regex_matches_names_or_addresses() {
        let re = |r: &str| vec![Regex::new(r).unwrap()];
        assert_eq!(
            select(&all(), &[], &re("^ens")),
            Ok(Some("10.0.0.7".parse().unwrap()))
        );
        assert_eq!(
            select(&all(), &[], &re(r"^198\.51\.")),
            Ok(Some("198.51.100.7".parse().unwrap()))
        );
        assert!(select(&all(), &[], &re("^nope$")).is_err());
        // --iface wins over --iface-regex.
        assert_eq!(
            select(&all(), &["eth0".into()], &re("^ens")),
            Ok(Some("198.51.100.7".parse().unwrap()))
        );
    }
}
