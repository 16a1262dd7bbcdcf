//! Subnet allocation inside a `PodNetwork`. Pure: the caller passes in the leases it
//! listed and the random number; nothing here reads a clock, a registry or an RNG.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;

use super::PodNetwork;

/// A subnet already leased by some node, and the public IP it was leased for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    pub subnet: IpNet,
    pub public_ip: Option<IpAddr>,
}

/// The subnet chosen, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// The node's previous subnet (free, or already held for this node's public IP).
    Previous(IpNet),
    /// A lease that already exists for this node's public IP: take it over.
    SamePublicIp(IpNet),
    /// A free subnet picked at random.
    Fresh(IpNet),
}

impl Allocation {
    pub fn subnet(self) -> IpNet {
        match self {
            Allocation::Previous(s) | Allocation::SamePublicIp(s) | Allocation::Fresh(s) => s,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("network {network} is exhausted: all {count} /{subnet_len} subnets from {min} to {max} are leased; widen Network, SubnetMin/SubnetMax or SubnetLen, or delete stale leases")]
pub struct Exhausted {
    pub network: IpNet,
    pub subnet_len: u8,
    pub min: IpAddr,
    pub max: IpAddr,
    pub count: u128,
}

/// Chooses a subnet for a node: its previous subnet if it is in range and not held by
/// another public IP; else a lease already held by its public IP; else the free subnet
/// found by probing forward (wrapping) from a random start. `random` is any number; it is
/// reduced into the range.
pub fn allocate(
    net: &PodNetwork,
    taken: &[Taken],
    previous: Option<IpNet>,
    public_ip: Option<IpAddr>,
    random: u128,
) -> Result<Allocation, Exhausted> {
    let mine = |t: &Taken| public_ip.is_some() && t.public_ip == public_ip;
    if let Some(prev) = previous.filter(|p| net.in_range(p)) {
        let holder = taken
            .iter()
            .find(|t| t.subnet.contains(&prev) || prev.contains(&t.subnet));
        if holder.is_none_or(|t| mine(t) && t.subnet == prev) {
            return Ok(Allocation::Previous(prev));
        }
    }
    if let Some(t) = taken.iter().find(|t| mine(t) && net.in_range(&t.subnet)) {
        return Ok(Allocation::SamePublicIp(t.subnet));
    }
    let (lo, hi) = net.index_range();
    let count = hi - lo + 1;
    // Leases of our subnet length map to one index; any other shape is checked by overlap.
    let mut used = BTreeSet::new();
    let mut odd = Vec::new();
    for t in taken {
        match net.index_of(&t.subnet) {
            Some(i) => {
                used.insert(i);
            }
            None => odd.push(t.subnet),
        }
    }
    let start = random % count;
    let mut probe = start;
    loop {
        let index = lo + probe;
        let subnet = net.subnet_by_index(index);
        if !used.contains(&index)
            && !odd
                .iter()
                .any(|o| o.contains(&subnet) || subnet.contains(o))
        {
            return Ok(Allocation::Fresh(subnet));
        }
        probe = (probe + 1) % count;
        if probe == start {
            return Err(Exhausted {
                network: net.network,
                subnet_len: net.subnet_len,
                min: net.subnet_min,
                max: net.subnet_max,
                count,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(network: &str, len: u8) -> PodNetwork {
        let mut p = PodNetwork::with_defaults(network.parse().unwrap());
        p.subnet_len = len;
        p.reset_range();
        p
    }

    fn taken(subnet: &str, ip: &str) -> Taken {
        Taken {
            subnet: subnet.parse().unwrap(),
            public_ip: Some(ip.parse().unwrap()),
        }
    }

    fn net(s: &str) -> Option<IpNet> {
        Some(s.parse().unwrap())
    }

    const ME: &str = "198.51.100.7";

    #[test]
    fn table() {
        let p = pod("10.244.0.0/16", 24);
        let a = taken("10.244.1.0/24", "198.51.100.1");
        let mine = taken("10.244.9.0/24", ME);
        let cases: Vec<(&str, Vec<Taken>, Option<IpNet>, Allocation)> = vec![
            (
                "previous free",
                vec![a],
                net("10.244.5.0/24"),
                Allocation::Previous("10.244.5.0/24".parse().unwrap()),
            ),
            (
                "previous held by my ip",
                vec![a, mine],
                net("10.244.9.0/24"),
                Allocation::Previous("10.244.9.0/24".parse().unwrap()),
            ),
            (
                "previous taken by another: my ip's lease",
                vec![a, mine],
                net("10.244.1.0/24"),
                Allocation::SamePublicIp("10.244.9.0/24".parse().unwrap()),
            ),
            (
                "previous out of range (first subnet)",
                vec![mine],
                net("10.244.0.0/24"),
                Allocation::SamePublicIp("10.244.9.0/24".parse().unwrap()),
            ),
            (
                "previous wrong length",
                vec![mine],
                net("10.244.5.0/25"),
                Allocation::SamePublicIp("10.244.9.0/24".parse().unwrap()),
            ),
            (
                "no previous: my ip's lease",
                vec![a, mine],
                None,
                Allocation::SamePublicIp("10.244.9.0/24".parse().unwrap()),
            ),
            (
                "fresh: probes past taken",
                vec![a],
                None,
                Allocation::Fresh("10.244.2.0/24".parse().unwrap()),
            ),
        ];
        for (name, taken, previous, want) in cases {
            // random = 0 starts the probe at SubnetMin (10.244.1.0).
            let got = allocate(&p, &taken, previous, Some(ME.parse().unwrap()), 0).unwrap();
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn random_start_wraps_and_respects_odd_shapes() {
        let p = pod("10.244.0.0/22", 24); // subnets .1, .2, .3 (the first is skipped)
        let odd = Taken {
            subnet: "10.244.2.0/23".parse().unwrap(),
            public_ip: None,
        };
        let got = allocate(&p, &[odd], None, None, 1).unwrap();
        assert_eq!(got, Allocation::Fresh("10.244.1.0/24".parse().unwrap()));
    }

    #[test]
    fn exhaustion_is_a_clear_error() {
        let p = pod("10.244.0.0/22", 24);
        let all: Vec<_> = (1..4)
            .map(|i| taken(&format!("10.244.{i}.0/24"), "198.51.100.1"))
            .collect();
        let err = allocate(&p, &all, None, Some(ME.parse().unwrap()), 12345).unwrap_err();
        assert_eq!(
            err.to_string(),
            "network 10.244.0.0/22 is exhausted: all 3 /24 subnets from 10.244.1.0 to 10.244.3.0 are leased; widen Network, SubnetMin/SubnetMax or SubnetLen, or delete stale leases"
        );
    }

    #[test]
    fn ipv6_fresh_allocation_is_spread_by_random() {
        let p = pod("fd00:10:244::/48", 64);
        let a = allocate(&p, &[], None, None, 0).unwrap().subnet();
        let b = allocate(&p, &[], None, None, 40_000).unwrap().subnet();
        assert_eq!(a.to_string(), "fd00:10:244:1::/64");
        assert_eq!(b.to_string(), "fd00:10:244:9c41::/64");
        assert!(p.in_range(&b));
    }

    #[test]
    fn every_allocation_stays_in_range_and_distinct() {
        let p = pod("10.244.0.0/20", 24);
        let mut held: Vec<Taken> = Vec::new();
        for r in [7u128, 7, 7, 1 << 100, 3, 0, 99, 5, 5, 5, 5, 5, 5, 5, 5] {
            let s = allocate(&p, &held, None, None, r).unwrap().subnet();
            assert!(p.in_range(&s), "{s}");
            assert!(held.iter().all(|t| t.subnet != s), "{s} twice");
            held.push(Taken {
                subnet: s,
                public_ip: None,
            });
        }
        assert!(allocate(&p, &held, None, None, 1).is_err());
    }
}
