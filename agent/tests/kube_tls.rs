//! The agent's link to the Kubernetes API server is post-quantum where the server offers
//! it: the agent's own client (kube on rustls with aws-lc-rs), read from a kubeconfig with
//! the server's CA, talks to the test API server through a rustls TLS front that records
//! the key exchange group of every handshake. Offered hybrid X25519MLKEM768, every
//! handshake agrees it; offered X25519 only (a server before Go 1.24), the client still
//! connects, with X25519. And the line the agent logs at start names the group the server
//! agreed, learned by its own handshake with kube's TLS configuration.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::kube::Api;
use k8s_openapi::api::core::v1::Node;
use rustls::NamedGroup;
use weft::registry::kube;
use weft::registry::tls_link;
use weft_lab::kube_api::{KubeApi, TOKEN};
use weft_lab::pki::Pki;
use weft_lab::tls_front::{Offer, TlsFront};

/// A kubeconfig for `url` with the test CA and the test API server's token.
fn kubeconfig(dir: &std::path::Path, url: &str, ca: &std::path::Path) -> String {
    let path = dir.join(format!("kubeconfig-{}", url.replace([':', '/'], "_")));
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: {url}\n    certificate-authority: {ca}\nusers:\n- name: lab\n  user:\n    token: {TOKEN}\ncontexts:\n- name: lab\n  context:\n    cluster: lab\n    user: lab\ncurrent-context: lab\n",
        ca = ca.display()
    );
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// Lists nodes through the agent's client to the front at `url`; the front's groups after.
async fn list_nodes(front: &TlsFront, kubeconfig: &str) -> Vec<NamedGroup> {
    let client = kube::client(kubeconfig, "").await.unwrap();
    let nodes: Api<Node> = Api::all(client);
    let listed = nodes.list(&Default::default()).await.unwrap();
    let names: Vec<_> = listed
        .items
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    assert_eq!(names, ["node-a"]);
    front.groups()
}

/// A tracing writer the test reads back.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

// One thread: the subscriber below is this thread's, and the report's task runs here too.
#[tokio::test]
async fn the_api_server_link_agrees_x25519mlkem768_where_offered_and_x25519_where_not() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let pki = Pki::new().unwrap();
    let api = KubeApi::start(None, IpAddr::V4(Ipv4Addr::LOCALHOST), 0).unwrap();
    api.add_node("node-a", &["10.244.1.0/24"]);

    for (offer, want) in [
        (Offer::PostQuantum, NamedGroup::X25519MLKEM768),
        (Offer::Classical, NamedGroup::X25519),
    ] {
        let front = TlsFront::start(&pki, api.addr, offer, &[]).unwrap();
        let config = kubeconfig(pki.dir(), &front.url(), &pki.file("ca.pem"));

        let groups = list_nodes(&front, &config).await;
        println!("{offer:?} server: the client's handshakes agreed {groups:?}");
        assert!(!groups.is_empty(), "{offer:?}: no handshake recorded");
        assert!(groups.iter().all(|g| *g == want), "{offer:?}: {groups:?}");

        // What the agent learns and logs at start, from kube's own TLS configuration.
        let link = kube::link(&kube::config(&config, "").await.unwrap()).unwrap();
        let agreed = tls_link::agreed(&link, Duration::from_secs(5))
            .await
            .expect("an https:// link")
            .unwrap();
        assert_eq!(agreed, want, "{offer:?}");

        tls_link::report(vec![link]);
        let line = format!(
            "group={want:?} post_quantum={}",
            want == NamedGroup::X25519MLKEM768
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !captured.text().contains(&line) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{offer:?}: no log line with {line:?} in:\n{}",
                captured.text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let logged = captured.text();
        let logged = logged
            .lines()
            .find(|l| l.contains(&line))
            .unwrap_or_default();
        println!("{offer:?} server: the agent logs: {logged}");
        assert!(logged.contains("link=\"kubernetes\""), "{logged}");
        assert!(logged.contains(&front.url()), "{logged}");
    }
}
