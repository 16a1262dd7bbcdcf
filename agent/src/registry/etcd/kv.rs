//! flannel's etcd keys and values: `<prefix>/subnets/10.244.3.0-24` holding `LeaseAttrs`.

use ipnet::IpNet;
use weft_backends::model::{Lease, LeaseAttrs};

/// `10.244.3.0/24` → `10.244.3.0-24` (flannel's key form for one subnet).
pub fn subnet_key(subnet: &IpNet) -> String {
    format!("{}-{}", subnet.addr(), subnet.prefix_len())
}

/// A lease's key name, as flannel forms it (also the node's name): `10.244.3.0-24`,
/// `fd00:10:244:3::-64` (IPv6 only), or both joined by `&` (dual-stack).
pub fn lease_name(v4: Option<&IpNet>, v6: Option<&IpNet>) -> String {
    match (v4, v6) {
        (Some(a), Some(b)) => format!("{}&{}", subnet_key(a), subnet_key(b)),
        (Some(one), None) | (None, Some(one)) => subnet_key(one),
        (None, None) => String::new(),
    }
}

/// A lease's key name → its (IPv4, IPv6) subnets: one subnet of either family, or an
/// IPv4 and an IPv6 subnet joined by `&`.
pub fn parse_lease_name(name: &str) -> Option<(Option<IpNet>, Option<IpNet>)> {
    match name.split_once('&') {
        Some((a, b)) => match (parse_subnet_key(a)?, parse_subnet_key(b)?) {
            (v4 @ IpNet::V4(_), v6 @ IpNet::V6(_)) => Some((Some(v4), Some(v6))),
            _ => None,
        },
        None => match parse_subnet_key(name)? {
            v4 @ IpNet::V4(_) => Some((Some(v4), None)),
            v6 @ IpNet::V6(_) => Some((None, Some(v6))),
        },
    }
}

/// `<prefix>/weft/rotate/<node>`: where `weft keys rotate --all` asks `node` to rotate.
pub fn rotate_request_key(prefix: &str, node: &str) -> String {
    format!("{}/weft/rotate/{node}", prefix.trim_end_matches('/'))
}

/// `10.244.3.0-24` → `10.244.3.0/24`.
pub fn parse_subnet_key(name: &str) -> Option<IpNet> {
    let (addr, len) = name.rsplit_once('-')?;
    format!("{addr}/{len}")
        .parse::<IpNet>()
        .ok()
        .filter(|n| n.trunc() == *n)
}

/// The largest lease value weft reads (bytes); flannel's are under 300. A larger one is
/// refused before it is parsed, logged or kept.
pub const MAX_LEASE_BYTES: usize = 8192;

/// Why one stored lease could not be read. Logged naming the key; the lease is skipped.
#[derive(Debug, thiserror::Error)]
pub enum BadLease {
    #[error("key {key:?}: the name is not a subnet like 10.244.3.0-24 (or with IPv6, like 10.244.3.0-24&fd00:10:244:3::-64)")]
    Key { key: String },
    #[error("key {key}: the value is {got}, not a flannel lease object like {{\"PublicIP\":\"…\",\"BackendType\":\"…\"}}")]
    NotAnObject { key: String, got: String },
    #[error("key {key}: the value is {size} bytes, more than {MAX_LEASE_BYTES}")]
    TooLarge { key: String, size: usize },
    #[error(
        "key {key}: the value is not flannel lease JSON: {}",
        weft_backends::model::json_error(source)
    )]
    Value {
        key: String,
        #[source]
        source: serde_json::Error,
    },
}

/// Reads one stored lease as etcd returned it, with its create revision as the order it
/// was created in (of two leases claiming one key or MAC, the older keeps it).
pub fn lease_of(subnets_dir: &str, kv: &etcd_client::KeyValue) -> Result<Lease, BadLease> {
    let mut lease = parse_lease(subnets_dir, kv.key(), kv.value())?;
    lease.created = Some(kv.create_revision());
    Ok(lease)
}

/// Reads one stored lease. `full_key` is the whole etcd key; `subnets_dir` is
/// `<prefix>/subnets/`.
pub fn parse_lease(subnets_dir: &str, full_key: &[u8], value: &[u8]) -> Result<Lease, BadLease> {
    let full = String::from_utf8_lossy(full_key);
    let name = full.strip_prefix(subnets_dir).unwrap_or(&full);
    // The key as messages show it: a hostile key is not echoed whole.
    let key = weft_backends::model::clip(&full);
    let (v4, v6) = parse_lease_name(name).ok_or_else(|| BadLease::Key { key: key.clone() })?;
    if value.len() > MAX_LEASE_BYTES {
        return Err(BadLease::TooLarge {
            key,
            size: value.len(),
        });
    }
    let json: serde_json::Value =
        serde_json::from_slice(value).map_err(|source| BadLease::Value {
            key: key.clone(),
            source,
        })?;
    if !json.is_object() {
        return Err(BadLease::NotAnObject {
            key,
            got: json.to_string().chars().take(40).collect(),
        });
    }
    let attrs: LeaseAttrs =
        serde_json::from_value(json).map_err(|source| BadLease::Value { key, source })?;
    Ok(attrs.into_lease(name.to_string(), v4, v6))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_junk_is_refused() {
        let net: IpNet = "10.244.3.0/24".parse().unwrap();
        assert_eq!(subnet_key(&net), "10.244.3.0-24");
        assert_eq!(parse_subnet_key("10.244.3.0-24"), Some(net));
        assert_eq!(parse_subnet_key("10.244.3.7-24"), None, "host bits set");
        assert_eq!(parse_subnet_key("banana"), None);
        assert_eq!(
            parse_subnet_key("fd00::-64"),
            Some("fd00::/64".parse().unwrap())
        );
    }

    #[test]
    fn dual_stack_names_are_flannels() {
        let v4: IpNet = "10.244.1.0/24".parse().unwrap();
        let v6: IpNet = "fd00:10:244:1::/64".parse().unwrap();
        let name = lease_name(Some(&v4), Some(&v6));
        assert_eq!(name, "10.244.1.0-24&fd00:10:244:1::-64");
        assert_eq!(parse_lease_name(&name), Some((Some(v4), Some(v6))));
        assert_eq!(lease_name(None, Some(&v6)), "fd00:10:244:1::-64");
        assert_eq!(
            parse_lease_name("fd00:10:244:1::-64"),
            Some((None, Some(v6)))
        );
        assert_eq!(parse_lease_name("10.244.1.0-24"), Some((Some(v4), None)));
        for bad in [
            "fd00:10:244:1::-64&10.244.1.0-24",
            "10.244.1.0-24&10.244.2.0-24",
            "10.244.1.0-24&",
            "10.244.1.0-24&fd00::-64&fd01::-64",
        ] {
            assert_eq!(parse_lease_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn oversized_values_and_odd_keys_are_refused_without_echoing_them() {
        let huge = format!(
            r#"{{"PublicIP":"198.51.100.2","BackendType":"wireguard","BackendData":{{"PublicKey":"{}"}}}}"#,
            "A".repeat(1 << 20)
        );
        let err =
            parse_lease("/p/subnets/", b"/p/subnets/10.244.2.0-24", huge.as_bytes()).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("more than 8192"), "{text}");
        assert!(
            text.len() < 200,
            "the value is echoed: {} bytes",
            text.len()
        );
        // A key with a newline cannot forge a log line: it is quoted and escaped.
        let err = parse_lease("/p/subnets/", b"/p/subnets/x\nFORGED", b"{}").unwrap_err();
        assert!(!err.to_string().contains('\n'), "{err}");
    }

    #[test]
    fn reads_flannels_value() {
        let value = br#"{"PublicIP":"198.51.100.2","BackendType":"vxlan","BackendData":{"VtepMAC":"aa:bb:cc:dd:ee:ff","VNI":1}}"#;
        let lease = parse_lease(
            "/coreos.com/network/subnets/",
            b"/coreos.com/network/subnets/10.244.2.0-24",
            value,
        )
        .unwrap();
        assert_eq!(lease.node, "10.244.2.0-24");
        assert_eq!(lease.subnet, Some("10.244.2.0/24".parse().unwrap()));
        assert_eq!(lease.backend_type, "vxlan");
        let err = parse_lease("/p/subnets/", b"/p/subnets/10.244.2.0-24", b"{oops").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("key /p/subnets/10.244.2.0-24: the value is not flannel lease JSON"),
            "{err}"
        );
        let err = parse_lease("/p/subnets/", b"/p/subnets/10.244.2.0-24", b"[]").unwrap_err();
        assert!(
            err.to_string().starts_with(
                "key /p/subnets/10.244.2.0-24: the value is [], not a flannel lease object"
            ),
            "{err}"
        );
        let err = parse_lease(
            "/p/subnets/",
            b"/p/subnets/10.244.2.0-24",
            br#"{"PublicIP": 7}"#,
        )
        .unwrap_err();
        assert!(matches!(err, BadLease::Value { .. }), "{err}");
    }
}
