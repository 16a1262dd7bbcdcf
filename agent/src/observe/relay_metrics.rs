//! `/metrics` for pair paths across zones: each WireGuard pair's path, and on a gateway
//! what its relay carries (from the snapshot, like the rest of `/metrics`).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::observe::snapshot::Snapshot;

type Labels = Vec<(&'static str, String)>;

/// Each WireGuard pair's path (`direct`, `relay` with its gateway, or `none`) and, on a
/// gateway, what its relay carries: bytes per pair, datagrams, routes, drops by reason.
pub(super) fn register(registry: &mut Registry, snapshot: &Snapshot) {
    let path: Family<Labels, Gauge> = Family::default();
    for p in &snapshot.peers {
        let Some(words) = p.path.as_deref() else {
            continue;
        };
        let (kind, gateway) = match words {
            "direct" => ("direct", String::new()),
            w if w.starts_with("via ") => ("relay", w["via ".len()..].to_string()),
            _ => ("none", String::new()),
        };
        path.get_or_create(&vec![
            ("node", p.node.clone()),
            ("path", kind.to_string()),
            ("gateway", gateway),
        ])
        .set(1);
    }
    registry.register(
        "peer_path",
        "How the pair is carried: path=direct, path=relay through gateway, or path=none (the two nodes cannot reach each other and no gateway can carry them)",
        path,
    );
    let Some(relay) = &snapshot.relay else {
        return;
    };
    let gateway = snapshot.node.clone();
    let pairs: Family<Labels, Counter> = Family::default();
    for p in &relay.pairs {
        pairs
            .get_or_create(&vec![
                ("gateway", gateway.clone()),
                ("from", p.from.clone()),
                ("to", p.to.clone()),
            ])
            .inc_by(p.bytes);
    }
    registry.register(
        "relay_bytes",
        "Bytes this gateway's relay carried from one node to another (WireGuard datagrams, never decrypted)",
        pairs,
    );
    let dropped: Family<Labels, Counter> = Family::default();
    for (reason, n) in &relay.dropped {
        dropped
            .get_or_create(&vec![("reason", reason.clone())])
            .inc_by(*n);
    }
    registry.register(
        "relay_dropped_datagrams",
        "Datagrams the relay dropped, by reason",
        dropped,
    );
    let datagrams: Counter = Counter::default();
    datagrams.inc_by(relay.datagrams);
    registry.register("relay_datagrams", "Datagrams the relay carried", datagrams);
    let routes: Gauge = Gauge::default();
    routes.set(i64::try_from(relay.routes).unwrap_or(i64::MAX));
    registry.register("relay_routes", "Pair routes the relay holds", routes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::snapshot::{PeerInfo, RelayInfo, RelayedPair};

    #[test]
    fn each_pair_has_its_path_and_a_gateway_counts_what_it_carried() {
        let peer = |node: &str, path: &str| PeerInfo {
            node: node.into(),
            path: Some(path.into()),
            ..PeerInfo::default()
        };
        let snapshot = Snapshot {
            node: "g1".into(),
            peers: vec![
                peer("a", "direct"),
                peer("b", "via g2"),
                peer("c", "no path: a and c cannot reach each other"),
            ],
            relay: Some(RelayInfo {
                routes: 3,
                datagrams: 9,
                dropped: vec![("limited".into(), 2)],
                pairs: vec![RelayedPair {
                    from: "x".into(),
                    to: "y".into(),
                    bytes: 4096,
                }],
                ..RelayInfo::default()
            }),
            ..Snapshot::default()
        };
        let mut registry = Registry::with_prefix("weft");
        register(&mut registry, &snapshot);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for want in [
            r#"weft_peer_path{node="a",path="direct",gateway=""} 1"#,
            r#"weft_peer_path{node="b",path="relay",gateway="g2"} 1"#,
            r#"weft_peer_path{node="c",path="none",gateway=""} 1"#,
            r#"weft_relay_bytes_total{gateway="g1",from="x",to="y"} 4096"#,
            r#"weft_relay_dropped_datagrams_total{reason="limited"} 2"#,
            "weft_relay_routes 3",
            "weft_relay_datagrams_total 9",
        ] {
            assert!(text.contains(want), "{want} not in:\n{text}");
        }
    }
}
