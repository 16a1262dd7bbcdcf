//! UAPI encoding and parsing, checked against the text `wg` and userspace devices exchange.

use super::*;
use crate::apply::wireguard::diff::{diff_device, PeerFields};
use crate::model::TunnelSpec;

fn key(seed: u8) -> PrivateKey {
    PrivateKey::from_bytes([seed; 32])
}

fn peer(seed: u8, ip: &str, allowed: &str) -> PeerSpec {
    PeerSpec {
        node: format!("node-{seed}"),
        public_key: key(seed).public_key(),
        endpoint: ip.parse().unwrap(),
        allowed_ips: vec![allowed.parse().unwrap()],
        keepalive: 25,
        psk: None,
        via: Default::default(),
    }
}

#[test]
fn fresh_device_gets_key_first_then_port_then_peers() {
    let spec = TunnelSpec {
        device: "flannel-wg".into(),
        listen_port: 51820,
        mtu: 1420,
        addresses: vec![],
        peers: vec![peer(2, "198.51.100.2:51820", "10.244.2.0/24")],
    };
    let change = diff_device(&spec, &key(1).public_key(), &WgDevice::default());
    let requests = encode_set(&change, &key(1));
    let b = hex(key(2).public_key().as_bytes());
    assert_eq!(requests, [
        format!("set=1\nprivate_key={}\nlisten_port=51820\npublic_key={b}\nendpoint=198.51.100.2:51820\npersistent_keepalive_interval=25\nreplace_allowed_ips=true\nallowed_ip=10.244.2.0/24\n\n", hex(key(1).as_bytes())),
    ]);
}

#[test]
fn updates_in_place_and_every_peer_in_one_request() {
    let spec = peer(2, "203.0.113.2:51820", "10.244.2.0/24");
    let change = DeviceChange {
        set_private_key: false,
        listen_port: None,
        peers: vec![
            PeerChange::Update {
                spec: spec.clone(),
                fields: PeerFields {
                    endpoint: Some(spec.endpoint),
                    ..PeerFields::default()
                },
            },
            PeerChange::Remove {
                key: key(9).public_key(),
            },
        ],
    };
    let b = hex(key(2).public_key().as_bytes());
    let gone = hex(key(9).public_key().as_bytes());
    assert_eq!(
        encode_set(&change, &key(1)),
        [format!(
            "set=1\npublic_key={b}\nupdate_only=true\nendpoint=203.0.113.2:51820\npublic_key={gone}\nremove=true\n\n"
        )]
    );
    assert!(encode_set(&DeviceChange::default(), &key(1)).is_empty());
}

#[test]
fn parses_a_get_answer_and_the_diff_of_it_is_empty() {
    let b = hex(key(2).public_key().as_bytes());
    let answer = format!(
        "private_key={}\nlisten_port=51820\npublic_key={b}\nendpoint=198.51.100.2:51820\nlast_handshake_time_sec=1700000000\nlast_handshake_time_nsec=5\ntx_bytes=10\nrx_bytes=20\npersistent_keepalive_interval=25\nallowed_ip=10.244.2.0/24\nprotocol_version=1\nerrno=0\n\n",
        hex(key(1).as_bytes())
    );
    let device = parse_get(&answer).unwrap();
    assert_eq!(device.public_key, Some(key(1).public_key()));
    let p = &device.peers[&key(2).public_key()];
    assert_eq!((p.rx_bytes, p.tx_bytes, p.keepalive), (20, 10, 25));
    assert_eq!(p.last_handshake.map(|d| d.as_secs()), Some(1_700_000_000));
    let spec = TunnelSpec {
        device: "flannel-wg".into(),
        listen_port: 51820,
        mtu: 1420,
        addresses: vec![],
        peers: vec![peer(2, "198.51.100.2:51820", "10.244.2.0/24")],
    };
    assert!(diff_device(&spec, &key(1).public_key(), &device).is_empty());
}

#[test]
fn boringtun_style_and_errors() {
    let own = hex(key(1).public_key().as_bytes());
    let device = parse_get(&format!(
        "own_public_key={own}\nlisten_port=51820\nerrno=0\n"
    ))
    .unwrap();
    assert_eq!(device.public_key, Some(key(1).public_key()));
    assert_eq!(parse_get("errno=22\n"), Err(UapiError::Errno(22)));
    assert_eq!(
        parse_get("endpoint=1.2.3.4:5\n").unwrap_err().to_string(),
        "line 1: peer field before any public_key: \"endpoint=1.2.3.4:5\""
    );
    assert!(matches!(
        parse_get("public_key=zz\n"),
        Err(UapiError::Bad {
            problem: "not a hex key",
            ..
        })
    ));
    let no_key = parse_get(&format!("private_key={}\nerrno=0\n", "0".repeat(64))).unwrap();
    assert_eq!(
        no_key.public_key, None,
        "an all-zero private key means none is set"
    );
}
