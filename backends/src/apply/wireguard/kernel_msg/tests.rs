//! The message builder without a kernel: large peer sets split within the budget, every
//! peer exactly once and in order, own settings only in the first message (a new private
//! key alone in the last, after every peer's PSK), oversized
//! AllowedIPs continued with append semantics, and every message round-trips through the
//! wire encoding.

use netlink_packet_core::{Emitable, ParseableParametrized};
use netlink_packet_generic::GenlHeader;
use netlink_packet_wireguard::{
    WireguardAttribute, WireguardMessage, WireguardPeerAttribute, WireguardPeerFlags,
};

use super::*;
use crate::apply::wireguard::diff::{diff_device, DeviceChange, PeerChange};
use crate::apply::wireguard::WgDevice;
use crate::model::{PeerSpec, TunnelSpec};

fn key(i: u32) -> PrivateKey {
    let mut b = [7u8; 32];
    b[..4].copy_from_slice(&i.to_be_bytes());
    PrivateKey::from_bytes(b)
}

fn peer(i: u32) -> PeerSpec {
    PeerSpec {
        node: format!("node-{i}"),
        public_key: key(i).public_key(),
        endpoint: format!("198.51.{}.{}:51820", i / 250, i % 250 + 1)
            .parse()
            .unwrap(),
        allowed_ips: vec![format!("10.{}.{}.0/24", 100 + i / 256, i % 256)
            .parse()
            .unwrap()],
        keepalive: 25,
        psk: None,
        via: Default::default(),
    }
}

fn peer_keys(msgs: &[WireguardMessage]) -> Vec<[u8; 32]> {
    let mut keys = Vec::new();
    for m in msgs {
        for a in &m.attributes {
            if let WireguardAttribute::Peers(ps) = a {
                for p in ps {
                    for pa in &p.0 {
                        if let WireguardPeerAttribute::PublicKey(k) = pa {
                            keys.push(*k);
                        }
                    }
                }
            }
        }
    }
    keys
}

fn round_trip(m: &WireguardMessage) -> WireguardMessage {
    let mut buf = vec![0u8; m.buffer_len()];
    m.emit(&mut buf);
    WireguardMessage::parse_with_param(&buf, GenlHeader { cmd: 1, version: 1 }).unwrap()
}

#[test]
fn two_thousand_peers_split_within_budget_each_once_in_order() {
    let spec = TunnelSpec {
        device: "flannel-wg".into(),
        listen_port: 51820,
        mtu: 1420,
        addresses: vec![],
        peers: (0..2000).map(peer).collect(),
    };
    let own = key(u32::MAX);
    let change = diff_device(&spec, &own.public_key(), &WgDevice::default());
    let msgs = set_device_messages("flannel-wg", &change, &own, MESSAGE_BUDGET);
    assert!(
        msgs.len() > 1,
        "2000 peers should not fit one {MESSAGE_BUDGET}-byte message"
    );
    for (i, m) in msgs.iter().enumerate() {
        assert!(
            m.buffer_len() <= MESSAGE_BUDGET,
            "message {i} is {} bytes",
            m.buffer_len()
        );
        assert_eq!(
            m.attributes[0],
            WireguardAttribute::IfName("flannel-wg".into())
        );
        let has_key = m
            .attributes
            .iter()
            .any(|a| matches!(a, WireguardAttribute::PrivateKey(_)));
        assert_eq!(has_key, i == msgs.len() - 1, "private key in message {i}");
        assert_eq!(
            &round_trip(m),
            m,
            "message {i} does not survive its wire encoding"
        );
    }
    let want: Vec<[u8; 32]> = spec
        .peers
        .iter()
        .map(|p| *p.public_key.as_bytes())
        .collect();
    assert_eq!(peer_keys(&msgs), want);
    eprintln!(
        "2000 peers -> {} messages of at most {MESSAGE_BUDGET} bytes",
        msgs.len()
    );
}

#[test]
fn one_peer_with_too_many_allowed_ips_is_continued_as_append() {
    let mut big = peer(1);
    big.allowed_ips = (0..3000u32)
        .map(|i| format!("10.{}.{}.0/24", i / 256, i % 256).parse().unwrap())
        .collect();
    let change = DeviceChange {
        set_private_key: false,
        listen_port: None,
        peers: vec![PeerChange::Add(big.clone())],
    };
    let msgs = set_device_messages("flannel-wg", &change, &key(0), MESSAGE_BUDGET);
    assert!(msgs.len() > 1);
    let mut total = 0;
    for (i, m) in msgs.iter().enumerate() {
        assert!(m.buffer_len() <= MESSAGE_BUDGET);
        let WireguardAttribute::Peers(ps) = &m.attributes[1] else {
            panic!("no peers in message {i}")
        };
        let flags = ps[0]
            .0
            .iter()
            .find_map(|a| {
                if let WireguardPeerAttribute::Flags(f) = a {
                    Some(*f)
                } else {
                    None
                }
            })
            .unwrap();
        if i == 0 {
            assert!(
                flags.contains(WireguardPeerFlags::ReplaceAllowedIps)
                    && !flags.contains(WireguardPeerFlags::UpdateOnly)
            );
        } else {
            assert!(
                !flags.contains(WireguardPeerFlags::ReplaceAllowedIps)
                    && flags.contains(WireguardPeerFlags::UpdateOnly),
                "message {i}: {flags:?}"
            );
        }
        total += ps[0]
            .0
            .iter()
            .map(|a| {
                if let WireguardPeerAttribute::AllowedIps(v) = a {
                    v.len()
                } else {
                    0
                }
            })
            .sum::<usize>();
    }
    assert_eq!(total, 3000);
}

#[test]
fn updates_and_removals_carry_their_flags_and_only_changed_fields() {
    let moved = peer(2);
    let change = DeviceChange {
        set_private_key: false,
        listen_port: Some(51999),
        peers: vec![
            PeerChange::Update {
                spec: moved.clone(),
                fields: crate::apply::wireguard::diff::PeerFields {
                    endpoint: Some(moved.endpoint),
                    ..Default::default()
                },
            },
            PeerChange::Remove {
                key: key(3).public_key(),
            },
        ],
    };
    let msgs = set_device_messages("flannel-wg", &change, &key(0), MESSAGE_BUDGET);
    assert_eq!(msgs.len(), 1);
    assert!(msgs[0]
        .attributes
        .contains(&WireguardAttribute::ListenPort(51999)));
    let WireguardAttribute::Peers(ps) = msgs[0].attributes.last().unwrap() else {
        panic!()
    };
    assert_eq!(
        ps[0].0,
        vec![
            WireguardPeerAttribute::PublicKey(*moved.public_key.as_bytes()),
            WireguardPeerAttribute::Flags(WireguardPeerFlags::UpdateOnly),
            WireguardPeerAttribute::Endpoint(moved.endpoint),
        ]
    );
    assert_eq!(
        ps[1].0,
        vec![
            WireguardPeerAttribute::PublicKey(*key(3).public_key().as_bytes()),
            WireguardPeerAttribute::Flags(WireguardPeerFlags::RemoveMe),
        ]
    );
    let nothing = set_device_messages(
        "flannel-wg",
        &DeviceChange::default(),
        &key(0),
        MESSAGE_BUDGET,
    );
    assert!(nothing.is_empty(), "an empty change sends nothing");
}

/// A key switch that also changes the peers' PSKs (the new key's pairs are classical until
/// their post-quantum round): the PSKs in a first message, the new private key alone in a
/// last one, so no handshake under the new key can go out with a PSK of the old key's pair.
#[test]
fn a_new_private_key_comes_after_the_peers_psks() {
    let (a, b) = (peer(1), peer(2));
    let psk_removed = |spec: &PeerSpec| PeerChange::Update {
        spec: spec.clone(),
        fields: crate::apply::wireguard::diff::PeerFields {
            psk: Some(None),
            ..Default::default()
        },
    };
    let change = DeviceChange {
        set_private_key: true,
        listen_port: None,
        peers: vec![psk_removed(&a), psk_removed(&b)],
    };
    let new_key = key(9);
    let msgs = set_device_messages("flannel-wg", &change, &new_key, MESSAGE_BUDGET);
    assert_eq!(msgs.len(), 2, "{msgs:?}");
    assert!(!msgs[0]
        .attributes
        .iter()
        .any(|a| matches!(a, WireguardAttribute::PrivateKey(_))));
    assert_eq!(
        peer_keys(&msgs[..1]),
        vec![*a.public_key.as_bytes(), *b.public_key.as_bytes()]
    );
    assert_eq!(
        msgs[1].attributes,
        vec![
            WireguardAttribute::IfName("flannel-wg".into()),
            WireguardAttribute::PrivateKey(*new_key.as_bytes()),
        ]
    );
    // A key alone is one message.
    let alone = DeviceChange {
        set_private_key: true,
        ..Default::default()
    };
    assert_eq!(
        set_device_messages("flannel-wg", &alone, &new_key, MESSAGE_BUDGET).len(),
        1
    );
}
