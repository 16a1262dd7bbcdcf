//! The userspace WireGuard device (boringtun, in-process) in a fresh network namespace:
//! configured per peer through its UAPI socket, read back by the real `wg show`, a second
//! pass needing no change, peer updates and removals applied without touching the others,
//! and a device deleted behind its back started again.

use weft_backends::apply::wireguard::diff::diff_device;
use weft_backends::apply::wireguard::uapi::encode_set;
use weft_backends::apply::wireguard::userspace::Userspace;
use weft_backends::model::{PeerSpec, TunnelSpec};
use weft_crypto::PrivateKey;
use weft_lab::netns::{in_new_netns, sh, sh_async};

fn peer(node: &str, seed: u8, endpoint: &str, allowed: &str) -> PeerSpec {
    PeerSpec {
        node: node.into(),
        public_key: PrivateKey::from_bytes([seed; 32]).public_key(),
        endpoint: endpoint.parse().unwrap(),
        allowed_ips: vec![allowed.parse().unwrap()],
        keepalive: 25,
        psk: None,
        via: Default::default(),
    }
}

/// `wg show <dev> dump` peer lines as (public key, endpoint, allowed IPs, keepalive).
async fn wg_peers(dev: &str) -> Vec<(String, String, String, String)> {
    sh_async(&format!("wg show {dev} dump"))
        .await
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            (
                f[0].to_string(),
                f[2].to_string(),
                f[3].to_string(),
                f[7].to_string(),
            )
        })
        .collect()
}

#[test]
fn configured_per_peer_and_readable_by_wg() {
    in_new_netns(|| async {
        let dev = "wgt-peers"; // the UAPI socket directory is shared: one name per test
        let key = PrivateKey::generate().unwrap();
        let mut us = Userspace::default();
        assert!(us.ensure(dev).unwrap(), "started");
        assert!(!us.ensure(dev).unwrap(), "already running");

        let (mut b, c) = (
            peer("node-b", 2, "198.51.100.2:51820", "10.244.2.0/24"),
            peer("node-c", 3, "198.51.100.3:51820", "10.244.3.0/24"),
        );
        b.psk = Some(weft_crypto::PresharedKey::generate().unwrap());
        let mut spec = TunnelSpec {
            device: dev.into(),
            listen_port: 51820,
            mtu: 1420,
            addresses: vec![],
            peers: vec![b.clone(), c.clone()],
        };
        let change = diff_device(&spec, &key.public_key(), &us.get(dev).await.unwrap());
        us.set(dev, &encode_set(&change, &key)).await.unwrap();

        let header = sh_async(&format!("wg show {dev} dump")).await;
        let first: Vec<&str> = header.lines().next().unwrap().split('\t').collect();
        assert_eq!(first[2], "51820", "{header}");
        // boringtun reports its own key as a non-standard `own_public_key`; weft's socket
        // answers in the standard form, so `wg` shows the interface's public key.
        assert_eq!(first[1], key.public_key().to_base64(), "{header}");
        assert_eq!(
            us.get(dev).await.unwrap().public_key,
            Some(key.public_key())
        );
        let mut want = vec![
            (
                b.public_key.to_base64(),
                "198.51.100.2:51820".to_string(),
                "10.244.2.0/24".to_string(),
                "25".to_string(),
            ),
            (
                c.public_key.to_base64(),
                "198.51.100.3:51820".to_string(),
                "10.244.3.0/24".to_string(),
                "25".to_string(),
            ),
        ];
        want.sort();
        let mut got = wg_peers(dev).await;
        got.sort();
        assert_eq!(got, want);
        // b's PSK is set, and does not leak onto c (boringtun's parser would carry it over
        // if both were sent in one request).
        let psks: Vec<(String, String)> = sh_async(&format!("wg show {dev} preshared-keys"))
            .await
            .lines()
            .map(|l| {
                let (k, v) = l.split_once('\t').unwrap();
                (k.to_string(), v.to_string())
            })
            .collect();
        assert!(
            psks.contains(&(
                b.public_key.to_base64(),
                b.psk.as_ref().unwrap().to_base64_secret()
            )),
            "{psks:?}"
        );
        assert!(
            psks.contains(&(c.public_key.to_base64(), "(none)".to_string())),
            "{psks:?}"
        );

        // Steady state: nothing to change, so nothing is written.
        let writes = us.writes();
        assert!(diff_device(&spec, &key.public_key(), &us.get(dev).await.unwrap()).is_empty());
        assert_eq!(us.writes(), writes);

        // c moves, b leaves: only those two are touched (boringtun gets c as remove + add).
        spec.peers = vec![peer("node-c", 3, "203.0.113.3:51820", "10.244.3.0/24")];
        let change = diff_device(&spec, &key.public_key(), &us.get(dev).await.unwrap());
        assert_eq!(change.peers.len(), 2, "{:?}", change.peers);
        us.set(dev, &encode_set(&change, &key)).await.unwrap();
        let got = wg_peers(dev).await;
        assert_eq!(got.len(), 1);
        assert_eq!(
            (got[0].0.as_str(), got[0].1.as_str()),
            (c.public_key.to_base64().as_str(), "203.0.113.3:51820")
        );
        assert!(diff_device(&spec, &key.public_key(), &us.get(dev).await.unwrap()).is_empty());
    });
}

#[test]
fn a_deleted_device_is_started_again() {
    in_new_netns(|| async {
        let dev = "wgt-heal";
        let mut us = Userspace::default();
        us.ensure(dev).unwrap();
        assert!(sh("ip -o link show").contains(dev));
        sh(&format!("ip link del {dev}"));
        assert!(!us.running(dev));
        assert!(us.ensure(dev).unwrap(), "started again");
        assert!(sh("ip -o link show").contains(dev));
        let fresh = us.get(dev).await.unwrap();
        assert_eq!(
            fresh.public_key, None,
            "a new device needs its key again; the reconciler sends it"
        );
    });
}
