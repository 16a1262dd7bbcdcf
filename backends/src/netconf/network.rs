//! The per-family keys: `Network`/`SubnetLen`/`SubnetMin`/`SubnetMax` and their IPv6
//! counterparts, with flannel's defaults and checks.

use std::net::IpAddr;

use ipnet::IpNet;

use super::error::ConfigError;
use super::fields::Fields;
use crate::model::net::{bits, to_u128};
use crate::model::PodNetwork;

pub(super) struct FamilyKeys {
    pub v6: bool,
    pub enable: &'static str,
    pub network: &'static str,
    pub subnet_len: &'static str,
    pub min: &'static str,
    pub max: &'static str,
    pub example: &'static str,
}

pub(super) const V4: FamilyKeys = FamilyKeys {
    v6: false,
    enable: "EnableIPv4",
    network: "Network",
    subnet_len: "SubnetLen",
    min: "SubnetMin",
    max: "SubnetMax",
    example: "10.244.0.0/16",
};

pub(super) const V6: FamilyKeys = FamilyKeys {
    v6: true,
    enable: "EnableIPv6",
    network: "IPv6Network",
    subnet_len: "IPv6SubnetLen",
    min: "IPv6SubnetMin",
    max: "IPv6SubnetMax",
    example: "fd00:10:244::/56",
};

fn family_name(v6: bool) -> &'static str {
    if v6 {
        "IPv6"
    } else {
        "IPv4"
    }
}

fn parse_cidr(f: &mut Fields<'_, '_>, keys: &FamilyKeys) -> Option<IpNet> {
    let text = f.string(keys.network)?;
    let net: IpNet = match text.trim().parse() {
        Ok(net) => net,
        Err(_) => {
            f.push(ConfigError::invalid(
                f.path(keys.network),
                format!("{text:?}"),
                format!(
                    "not a CIDR; expected an {} network such as \"{}\"",
                    family_name(keys.v6),
                    keys.example
                ),
            ));
            return None;
        }
    };
    if matches!(net, IpNet::V6(_)) != keys.v6 {
        let other = if keys.v6 { V4.network } else { V6.network };
        f.push(ConfigError::invalid(
            f.path(keys.network),
            format!("{text:?}"),
            format!(
                "an {} network, but `{}` takes {}; put it in `{other}` (and set `{}` to true)",
                family_name(!keys.v6),
                keys.network,
                family_name(keys.v6),
                if keys.v6 { V4.enable } else { V6.enable },
            ),
        ));
        return None;
    }
    Some(net.trunc())
}

fn parse_addr(f: &mut Fields<'_, '_>, key: &'static str, keys: &FamilyKeys) -> Option<IpAddr> {
    let text = f.string(key)?;
    match text.trim().parse::<IpAddr>() {
        Ok(addr) if addr.is_ipv6() == keys.v6 => Some(addr),
        Ok(_) | Err(_) => {
            f.push(ConfigError::invalid(
                f.path(key),
                format!("{text:?}"),
                format!(
                    "expected an {} address (a subnet's network address, no prefix)",
                    family_name(keys.v6)
                ),
            ));
            None
        }
    }
}

/// Parses one family's keys. `None` when the family is disabled or its keys are bad (the
/// errors are recorded); keys of a disabled family are still checked for typos.
pub(super) fn family(
    f: &mut Fields<'_, '_>,
    keys: FamilyKeys,
    enabled: bool,
) -> Option<PodNetwork> {
    let network = parse_cidr(f, &keys);
    let max_len = bits(if keys.v6 {
        IpAddr::V6(0.into())
    } else {
        IpAddr::V4(0.into())
    }) - 2;
    let subnet_len = f.integer(keys.subnet_len, 0, 128, "a prefix length");
    let min = parse_addr(f, keys.min, &keys);
    let max = parse_addr(f, keys.max, &keys);
    if !enabled {
        return None;
    }
    let Some(network) = network else {
        if f.get(keys.network).is_none() {
            f.push(ConfigError::Missing {
                key: f.path(keys.network),
                why: format!(
                    "`{}` is {}; give the pod network as a CIDR such as \"{}\"{}",
                    keys.enable,
                    if keys.v6 {
                        "true"
                    } else {
                        "true (the default)"
                    },
                    keys.example,
                    if keys.v6 {
                        ""
                    } else {
                        ", or set EnableIPv4 to false for an IPv6-only cluster"
                    },
                ),
            });
        }
        return None;
    };
    let mut pod = PodNetwork::with_defaults(network);
    if let Some(len) = subnet_len {
        let len = len as u8;
        let least = network.prefix_len() + 2;
        if len < least || len > max_len {
            f.push(ConfigError::invalid(
                f.path(keys.subnet_len),
                len,
                format!(
                    "valid for {} {network}: /{least} (so it holds at least four subnets) to /{max_len}",
                    keys.network
                ),
            ));
            return None;
        }
        pod.subnet_len = len;
        pod.reset_range();
    }
    let mut ok = true;
    for (key, addr, slot) in [
        (keys.min, min, &mut pod.subnet_min),
        (keys.max, max, &mut pod.subnet_max),
    ] {
        let Some(addr) = addr else { continue };
        let subnet = IpNet::new(addr, pod.subnet_len).map(|n| n.trunc());
        let problem = match subnet {
            _ if !network.contains(&addr) => Some(format!("outside {} {network}", keys.network)),
            Ok(s) if s.addr() != addr => Some(format!(
                "not the start of a /{} subnet; did you mean \"{}\"?",
                pod.subnet_len,
                s.addr()
            )),
            Ok(_) => None,
            Err(_) => Some("not a subnet address".into()),
        };
        match problem {
            Some(problem) => {
                f.push(ConfigError::invalid(
                    f.path(key),
                    format!("\"{addr}\""),
                    problem,
                ));
                ok = false;
            }
            None => *slot = addr,
        }
    }
    if ok && to_u128(pod.subnet_min) > to_u128(pod.subnet_max) {
        f.push(ConfigError::invalid(
            f.path(keys.min),
            format!("\"{}\"", pod.subnet_min),
            format!(
                "is above `{}` \"{}\": the range is reversed; swap them",
                keys.max, pod.subnet_max
            ),
        ));
        ok = false;
    }
    ok.then_some(pod)
}
