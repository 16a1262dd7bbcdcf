//! etcd over TLS and with authentication, against a real etcd: one started with TLS only
//! and `--client-cert-auth` (certificates made by the test), one with authentication
//! enabled. The agent's etcd client reads the config with the right files and
//! credentials; a wrong CA, a missing, foreign or expired client certificate, a missing
//! file and bad credentials are each one clear error saying which.
//!
//! And the link is post-quantum where the server offers it: Debian's etcd is built with a Go
//! that offers no ML-KEM, so a rustls TLS front (tests/src/tls_front.rs) stands before a
//! plain etcd and records the key exchange group of every handshake. Offered hybrid
//! X25519MLKEM768, the agent's etcd client agrees it; offered X25519 only, it still reads
//! the config, over X25519. The group the agent logs for each endpoint is the one the
//! server agreed.

use std::time::Duration;

use rustls::NamedGroup;
use weft::registry::etcd::tls::EtcdTls;
use weft::registry::tls_link;
use weft::registry::{EtcdConfig, EtcdRegistry, Registry};
use weft_lab::pki::Pki;
use weft_lab::tls_front::{Offer, TlsFront};
use weft_lab::Etcd;

const PREFIX: &str = "/coreos.com/network";
const CONFIG: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#;

fn config(endpoint: &str, tls: EtcdTls) -> EtcdConfig {
    let mut cfg = EtcdConfig::new(vec![endpoint.to_string()], PREFIX);
    cfg.tls = tls;
    cfg.request_timeout = Duration::from_secs(5);
    cfg
}

/// Reads the network config through a registry made with `cfg`: Ok, or the error's text.
async fn read_config(cfg: EtcdConfig) -> Result<(), String> {
    let mut registry = EtcdRegistry::connect(cfg)
        .await
        .map_err(|e| e.to_string())?;
    registry
        .net_conf()
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

fn files(pki: &Pki, ca: &str, client: Option<&str>) -> EtcdTls {
    EtcdTls {
        ca: Some(pki.file(ca)),
        cert: client.map(|c| pki.file(&format!("{c}.pem"))),
        key: client.map(|c| pki.file(&format!("{c}-key.pem"))),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_client_certificates_and_each_bad_part_named() {
    let pki = Pki::new().unwrap();
    let etcd = Etcd::start_tls(&pki).unwrap();
    etcd.etcdctl(&["put", &format!("{PREFIX}/config"), CONFIG])
        .unwrap();
    let endpoint = etcd.endpoint();
    assert!(endpoint.starts_with("https://"));

    read_config(config(&endpoint, files(&pki, "ca.pem", Some("client"))))
        .await
        .expect("the right CA and client certificate");
    let group = agreed(&endpoint, &files(&pki, "ca.pem", Some("client"))).await;
    println!("Debian's etcd over TLS agrees {group:?} with the agent");

    let cases = [
        (
            "wrong CA",
            files(&pki, "other-ca.pem", Some("client")),
            "etcd's certificate is not signed by the CA in --etcd-cafile",
        ),
        (
            "no client certificate",
            files(&pki, "ca.pem", None),
            "etcd requires a client certificate: give --etcd-certfile and --etcd-keyfile",
        ),
        (
            "a certificate of another CA",
            files(&pki, "ca.pem", Some("stranger")),
            "etcd refused this node's client certificate (--etcd-certfile)",
        ),
        (
            "an expired certificate",
            files(&pki, "ca.pem", Some("expired")),
            "etcd refused this node's client certificate (--etcd-certfile)",
        ),
    ];
    for (case, tls, want) in cases {
        let err = read_config(config(&endpoint, tls)).await.unwrap_err();
        println!("{case}: {err}");
        assert!(err.contains(want), "{case}: {err}");
        assert!(err.contains(&endpoint), "{case}: {err}");
    }

    // Files and flags that cannot work are refused before anything is sent.
    let mut missing = files(&pki, "ca.pem", Some("client"));
    missing.ca = Some("/nonexistent/ca.pem".into());
    let err = read_config(config(&endpoint, missing)).await.unwrap_err();
    assert!(
        err.starts_with("etcd TLS: --etcd-cafile /nonexistent/ca.pem: "),
        "{err}"
    );
    let mut half = files(&pki, "ca.pem", Some("client"));
    half.key = None;
    let err = read_config(config(&endpoint, half)).await.unwrap_err();
    assert_eq!(err, "etcd TLS: --etcd-certfile is given without --etcd-keyfile: a client certificate needs both");
    let err = read_config(config(&endpoint, EtcdTls::default()))
        .await
        .unwrap_err();
    assert!(err.contains("need --etcd-cafile"), "{err}");
    let plain = endpoint.replace("https://", "http://");
    let err = read_config(config(&plain, files(&pki, "ca.pem", None)))
        .await
        .unwrap_err();
    assert!(
        err.contains("--etcd-cafile is given but no etcd endpoint is https://"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_with_the_right_and_a_wrong_password() {
    let etcd = Etcd::start().unwrap();
    etcd.etcdctl(&["put", &format!("{PREFIX}/config"), CONFIG])
        .unwrap();
    etcd.etcdctl(&["user", "add", "root:rootpw"]).unwrap();
    etcd.etcdctl(&["user", "add", "weft:weftpw"]).unwrap();
    etcd.etcdctl(&["role", "add", "weft"]).unwrap();
    etcd.etcdctl(&[
        "role",
        "grant-permission",
        "weft",
        "--prefix=true",
        "readwrite",
        PREFIX,
    ])
    .unwrap();
    etcd.etcdctl(&["user", "grant-role", "weft", "weft"])
        .unwrap();
    etcd.etcdctl(&["auth", "enable"]).unwrap();

    let with = |user: &str, password: &str| {
        let mut cfg = config(&etcd.endpoint(), EtcdTls::default());
        if !user.is_empty() {
            cfg.auth = Some((user.to_string(), password.to_string()));
        }
        // The lab's etcd speaks plain HTTP.
        cfg.insecure = true;
        cfg
    };
    read_config(with("weft", "weftpw"))
        .await
        .expect("the right password");
    let err = read_config(with("weft", "wrong")).await.unwrap_err();
    println!("wrong password: {err}");
    assert!(
        err.contains("etcd refused the user name or password (--etcd-username, --etcd-password)"),
        "{err}"
    );
    let err = read_config(with("", "")).await.unwrap_err();
    println!("no credentials: {err}");
    assert!(err.contains("--etcd-username"), "{err}");
}

/// The group the agent learns (and logs) for `endpoint`, by its own handshake.
async fn agreed(endpoint: &str, tls: &EtcdTls) -> NamedGroup {
    let links = tls.links(&[endpoint.to_string()]).unwrap();
    assert_eq!(links.len(), 1);
    tls_link::agreed(&links[0], Duration::from_secs(5))
        .await
        .expect("an https:// endpoint")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_link_agrees_x25519mlkem768_where_offered_and_x25519_where_not() {
    let pki = Pki::new().unwrap();
    let etcd = Etcd::start().unwrap();
    etcd.etcdctl(&["put", &format!("{PREFIX}/config"), CONFIG])
        .unwrap();
    let backend = etcd
        .endpoint()
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    for (offer, want) in [
        (Offer::PostQuantum, NamedGroup::X25519MLKEM768),
        (Offer::Classical, NamedGroup::X25519),
    ] {
        // gRPC: the client insists on h2 by ALPN.
        let front = TlsFront::start(&pki, backend, offer, &[b"h2"]).unwrap();
        let tls = files(&pki, "ca.pem", None);
        read_config(config(&front.url(), tls.clone()))
            .await
            .unwrap_or_else(|e| panic!("{offer:?} server: {e}"));
        let groups = front.groups();
        println!("{offer:?} server: the etcd client's handshakes agreed {groups:?}");
        assert!(!groups.is_empty(), "{offer:?}: no handshake recorded");
        assert!(groups.iter().all(|g| *g == want), "{offer:?}: {groups:?}");
        assert_eq!(agreed(&front.url(), &tls).await, want, "{offer:?}");
    }
}
