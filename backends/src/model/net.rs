//! The pod network of one address family: `Network`, `SubnetLen`, `SubnetMin`, `SubnetMax`.
//!
//! Family-generic: addresses are handled as `u128` offsets so IPv4 and IPv6 share one code
//! path for validation and allocation. Pure: no I/O.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// One family's pod network and the range node subnets are allocated from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodNetwork {
    /// The whole pod network (`Network` / `IPv6Network`), host bits cleared.
    pub network: IpNet,
    /// Prefix length of one node's subnet.
    pub subnet_len: u8,
    /// First subnet that may be handed out (its network address).
    pub subnet_min: IpAddr,
    /// Last subnet that may be handed out (its network address).
    pub subnet_max: IpAddr,
}

pub(crate) fn bits(addr: IpAddr) -> u8 {
    match addr {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

pub(crate) fn to_u128(addr: IpAddr) -> u128 {
    match addr {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// The address of the same family as `like` with numeric value `n` (truncated to fit).
pub(crate) fn from_u128(like: IpAddr, n: u128) -> IpAddr {
    match like {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::from(n as u32)),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(n)),
    }
}

impl PodNetwork {
    /// flannel's defaults: `SubnetLen` 24 (v4) / 64 (v6) unless the network is too small for
    /// that, in which case one bit longer than the network; the first subnet is skipped
    /// (its network address would clash with the whole network's) and the last is included.
    pub fn with_defaults(network: IpNet) -> Self {
        let network = network.trunc();
        let default_len = if bits(network.addr()) == 32 { 24 } else { 64 };
        let subnet_len = if network.prefix_len() < default_len {
            default_len
        } else {
            (network.prefix_len() + 1).min(bits(network.addr()))
        };
        let mut net = PodNetwork {
            network,
            subnet_len,
            subnet_min: network.addr(),
            subnet_max: network.addr(),
        };
        net.reset_range();
        net
    }

    /// Sets `subnet_min`/`subnet_max` to flannel's defaults for the current `subnet_len`.
    pub fn reset_range(&mut self) {
        let base = to_u128(self.network.addr());
        let size = self.subnet_size();
        let count = self.subnet_count_in_network();
        self.subnet_min = from_u128(self.network.addr(), base + size.min(size * (count - 1)));
        self.subnet_max = from_u128(self.network.addr(), base + size * (count - 1));
    }

    /// Number of addresses in one node subnet.
    pub fn subnet_size(&self) -> u128 {
        1u128 << (bits(self.network.addr()) - self.subnet_len)
    }

    fn subnet_count_in_network(&self) -> u128 {
        1u128 << (self.subnet_len - self.network.prefix_len())
    }

    /// The node subnet starting at `addr`.
    pub fn subnet_at(&self, addr: IpAddr) -> IpNet {
        IpNet::new(addr, self.subnet_len)
            .map(|n| n.trunc())
            .unwrap_or(self.network)
    }

    /// Index of the subnet range `[subnet_min, subnet_max]`: `(first, last)` as offsets from
    /// the network address, in units of one subnet.
    pub fn index_range(&self) -> (u128, u128) {
        let base = to_u128(self.network.addr());
        let size = self.subnet_size();
        (
            (to_u128(self.subnet_min) - base) / size,
            (to_u128(self.subnet_max) - base) / size,
        )
    }

    /// The subnet with index `i` (see `index_range`).
    pub fn subnet_by_index(&self, i: u128) -> IpNet {
        let base = to_u128(self.network.addr());
        self.subnet_at(from_u128(
            self.network.addr(),
            base + i * self.subnet_size(),
        ))
    }

    /// Index of `subnet` if it is one of this network's node subnets (right length, inside).
    pub fn index_of(&self, subnet: &IpNet) -> Option<u128> {
        (subnet.prefix_len() == self.subnet_len && self.network.contains(subnet)).then(|| {
            (to_u128(subnet.network()) - to_u128(self.network.addr())) / self.subnet_size()
        })
    }

    /// Whether `subnet` may be handed out: a node subnet between min and max.
    pub fn in_range(&self, subnet: &IpNet) -> bool {
        let (lo, hi) = self.index_range();
        self.index_of(subnet)
            .is_some_and(|i| (lo..=hi).contains(&i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn flannel_defaults() {
        let cases = [
            ("10.244.0.0/16", 24, "10.244.1.0", "10.244.255.0"),
            ("10.0.0.0/8", 24, "10.0.1.0", "10.255.255.0"),
            ("192.168.0.0/24", 25, "192.168.0.128", "192.168.0.128"),
            ("fd00:10::/48", 64, "fd00:10:0:1::", "fd00:10:0:ffff::"),
        ];
        for (network, len, min, max) in cases {
            let p = PodNetwork::with_defaults(net(network));
            assert_eq!(p.subnet_len, len, "{network}");
            assert_eq!(p.subnet_min.to_string(), min, "{network}");
            assert_eq!(p.subnet_max.to_string(), max, "{network}");
        }
    }

    #[test]
    fn index_round_trip() {
        let p = PodNetwork::with_defaults(net("10.244.0.0/16"));
        assert_eq!(p.index_range(), (1, 255));
        assert_eq!(p.subnet_by_index(3), net("10.244.3.0/24"));
        assert_eq!(p.index_of(&net("10.244.3.0/24")), Some(3));
        assert_eq!(p.index_of(&net("10.245.3.0/24")), None);
        assert_eq!(p.index_of(&net("10.244.3.0/25")), None);
        assert!(!p.in_range(&net("10.244.0.0/24")));
        assert!(p.in_range(&net("10.244.255.0/24")));
    }
}
