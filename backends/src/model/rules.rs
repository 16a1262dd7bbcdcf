//! The host's side of the desired state: the address family of a rule set, the nftables
//! masquerade and forward rules, and `/run/flannel/subnet.env`. Each has a form a person
//! can read in a log or the demo.

use std::fmt;

use ipnet::IpNet;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    pub fn of(net: &IpNet) -> Self {
        match net {
            IpNet::V4(_) => Family::Ipv4,
            IpNet::V6(_) => Family::Ipv6,
        }
    }
    /// nftables family keyword (`ip`, `ip6`).
    pub fn nft(self) -> &'static str {
        match self {
            Family::Ipv4 => "ip",
            Family::Ipv6 => "ip6",
        }
    }
}

/// An address match in a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Match {
    In(IpNet),
    NotIn(IpNet),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NatRule {
    /// kube-proxy marks packets it will masquerade itself.
    ReturnIfMarked {
        mark: u32,
    },
    Return {
        src: Match,
        dst: Match,
    },
    Masquerade {
        src: Match,
        dst: Match,
        fully_random: bool,
    },
}

/// Accept forwarded traffic matching `src` or `dst` (one of the two is set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardRule {
    pub src: Option<IpNet>,
    pub dst: Option<IpNet>,
}

/// One nftables table (`ip flannel-ipv4` / `ip6 flannel-ipv6`): the postrouting NAT chain
/// and the forward chain, in order (docs/architecture.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasqueradeTable {
    pub family: Family,
    pub table: &'static str,
    pub postrouting: Vec<NatRule>,
    pub forward: Vec<ForwardRule>,
}

/// `/run/flannel/subnet.env` content (docs/architecture.md).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SubnetEnv {
    pub network: Option<IpNet>,
    /// This node's subnet with the gateway (first host) address: `10.244.3.1/24`.
    pub subnet: Option<IpNet>,
    pub ipv6_network: Option<IpNet>,
    pub ipv6_subnet: Option<IpNet>,
    pub mtu: u32,
    pub ipmasq: bool,
}

impl SubnetEnv {
    /// The file's text, in flannel's key order.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut line = |k: &str, v: &dyn fmt::Display| out.push_str(&format!("{k}={v}\n"));
        if let (Some(n), Some(s)) = (self.network, self.subnet) {
            line("FLANNEL_NETWORK", &n);
            line("FLANNEL_SUBNET", &s);
        }
        if let (Some(n), Some(s)) = (self.ipv6_network, self.ipv6_subnet) {
            line("FLANNEL_IPV6_NETWORK", &n);
            line("FLANNEL_IPV6_SUBNET", &s);
        }
        line("FLANNEL_MTU", &self.mtu);
        line("FLANNEL_IPMASQ", &self.ipmasq);
        out
    }
}

impl fmt::Display for Match {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Match::In(n) => write!(f, "{n}"),
            Match::NotIn(n) => write!(f, "!= {n}"),
        }
    }
}

impl MasqueradeTable {
    /// The rules as nft statements, for logs and the demo.
    pub fn lines(&self) -> Vec<String> {
        let fam = self.family.nft();
        let mut out = Vec::new();
        for rule in &self.postrouting {
            out.push(match rule {
                NatRule::ReturnIfMarked { mark } => {
                    format!("postrouting: meta mark & {mark:#x} == {mark:#x} return")
                }
                NatRule::Return { src, dst } => {
                    format!("postrouting: {fam} saddr {src} {fam} daddr {dst} return")
                }
                NatRule::Masquerade {
                    src,
                    dst,
                    fully_random,
                } => format!(
                    "postrouting: {fam} saddr {src} {fam} daddr {dst} masquerade{}",
                    if *fully_random { " fully-random" } else { "" }
                ),
            });
        }
        for rule in &self.forward {
            match (rule.src, rule.dst) {
                (Some(s), _) => out.push(format!("forward: {fam} saddr {s} accept")),
                (_, Some(d)) => out.push(format!("forward: {fam} daddr {d} accept")),
                (None, None) => {}
            }
        }
        out
    }
}
