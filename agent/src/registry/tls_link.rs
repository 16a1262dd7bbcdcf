//! The TLS of the control plane's links (the Kubernetes API server, each etcd endpoint):
//! which crypto provider rustls uses, and which key exchange group each link agreed.
//!
//! rustls runs on aws-lc-rs, whose client offers hybrid X25519MLKEM768 first (with an
//! X25519 share alongside, so a classical server needs no extra round trip): a server that
//! offers ML-KEM agrees the hybrid, a classical one X25519. The Kubernetes client
//! (hyper-rustls) and the etcd client (tonic) keep their connections to themselves, so the
//! agent learns the group by one handshake of its own at start, to the same address with
//! the same provider and trust (for Kubernetes the very `ClientConfig` kube builds), and
//! says it in one log line per link. That handshake sends no request.

use std::sync::Arc;
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, NamedGroup};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::{info, warn};

/// How long the start-up handshake may take before the agent gives up learning the group
/// (the link itself is retried by its registry, not here).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The process's rustls provider: the one installed, else aws-lc-rs, installed now. rustls
/// picks a provider by itself only when exactly one is compiled in, and panics otherwise;
/// the binary installs this first thing, and every client of the agent calls it before it
/// builds a TLS configuration, so no path depends on that guess.
pub fn provider() -> Arc<CryptoProvider> {
    if let Some(installed) = CryptoProvider::get_default() {
        return installed.clone();
    }
    // Err only when another thread installed one in between: that one is the default.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
}

/// Whether `group` includes ML-KEM (a hybrid or ML-KEM alone): a recording of the link
/// cannot be decrypted later by breaking the elliptic curve alone.
pub fn is_post_quantum(group: NamedGroup) -> bool {
    matches!(
        group,
        NamedGroup::X25519MLKEM768
            | NamedGroup::secp256r1MLKEM768
            | NamedGroup::MLKEM512
            | NamedGroup::MLKEM768
            | NamedGroup::MLKEM1024
    )
}

/// One link of the agent to its control plane.
#[derive(Clone)]
pub struct Link {
    /// `kubernetes` or `etcd`.
    pub kind: &'static str,
    /// The server as the operator gave it (URL or endpoint).
    pub server: String,
    pub transport: Transport,
}

#[derive(Clone)]
pub enum Transport {
    /// Plain HTTP: no TLS at all.
    Clear,
    /// Through a proxy, which a handshake of the agent's own would not take.
    Proxied { proxy: String },
    Tls {
        host: String,
        port: u16,
        server_name: ServerName<'static>,
        config: Arc<ClientConfig>,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("connecting to {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS handshake with {addr}: {source}")]
    Handshake {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{addr}: no TLS handshake within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
    #[error("{addr}: the handshake agreed no key exchange group (TLS 1.2 without ECDHE)")]
    NoGroup { addr: String },
}

/// The key exchange group a TLS handshake with `host:port` agrees, then closes the
/// connection (close_notify, no request).
pub async fn key_exchange_group(
    host: &str,
    port: u16,
    server_name: ServerName<'static>,
    config: Arc<ClientConfig>,
    timeout: Duration,
) -> Result<NamedGroup, LinkError> {
    let addr = match host.contains(':') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    };
    let handshake = async {
        let tcp = TcpStream::connect((host, port))
            .await
            .map_err(|source| LinkError::Connect {
                addr: addr.clone(),
                source,
            })?;
        let mut tls = tokio_rustls::TlsConnector::from(config)
            .connect(server_name, tcp)
            .await
            .map_err(|source| LinkError::Handshake {
                addr: addr.clone(),
                source,
            })?;
        let group = tls.get_ref().1.negotiated_key_exchange_group();
        let _ = tls.shutdown().await;
        group
            .map(|g| g.name())
            .ok_or_else(|| LinkError::NoGroup { addr: addr.clone() })
    };
    tokio::time::timeout(timeout, handshake)
        .await
        .unwrap_or_else(|_| {
            Err(LinkError::Timeout {
                addr: addr.clone(),
                timeout,
            })
        })
}

/// What `link` agrees: `None` for a clear or proxied link.
pub async fn agreed(link: &Link, timeout: Duration) -> Option<Result<NamedGroup, LinkError>> {
    match &link.transport {
        Transport::Clear | Transport::Proxied { .. } => None,
        Transport::Tls {
            host,
            port,
            server_name,
            config,
        } => Some(
            key_exchange_group(host, *port, server_name.clone(), config.clone(), timeout).await,
        ),
    }
}

/// Learns each link's group in the background and logs one line per link.
pub fn report(links: Vec<Link>) {
    tokio::spawn(async move {
        for link in links {
            if let Transport::Proxied { proxy } = &link.transport {
                info!(link = link.kind, server = %link.server, %proxy, "control-plane link through a proxy: its TLS key exchange group is not learned");
                continue;
            }
            match agreed(&link, HANDSHAKE_TIMEOUT).await {
                None => {
                    info!(link = link.kind, server = %link.server, "control-plane link without TLS: in clear")
                }
                Some(Ok(group)) => info!(
                    link = link.kind,
                    server = %link.server,
                    group = ?group,
                    post_quantum = is_post_quantum(group),
                    "control-plane link: TLS key exchange"
                ),
                Some(Err(e)) => warn!(
                    link = link.kind,
                    server = %link.server,
                    error = %e,
                    "control-plane link: could not learn its TLS key exchange group"
                ),
            }
        }
    });
}

/// `host` and `port` of an endpoint URL such as `https://10.0.0.5:2379` or
/// `https://[fd00::5]:2379/`; `default_port` when it names none.
pub fn host_port(url: &str, default_port: u16) -> Option<(String, u16)> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => {
            let (host, after) = v6.split_once(']')?;
            (host, after.strip_prefix(':'))
        }
        None => match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        },
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default_port,
    };
    (!host.is_empty()).then(|| (host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_and_port_of_endpoints() {
        let cases = [
            ("https://10.0.0.5:2379", Some(("10.0.0.5", 2379))),
            ("https://etcd.example:2379/", Some(("etcd.example", 2379))),
            ("https://[fd00::5]:2379", Some(("fd00::5", 2379))),
            ("https://[fd00::5]", Some(("fd00::5", 443))),
            ("https://api.example", Some(("api.example", 443))),
            (
                "https://user@api.example:6443/path",
                Some(("api.example", 6443)),
            ),
            ("10.0.0.5:2379", Some(("10.0.0.5", 2379))),
            ("https://:2379", None),
            ("https://host:port", None),
        ];
        for (url, want) in cases {
            let got = host_port(url, 443);
            let want = want.map(|(h, p)| (h.to_string(), p));
            assert_eq!(got, want, "{url}");
        }
    }

    #[test]
    fn only_ml_kem_groups_are_post_quantum() {
        assert!(is_post_quantum(NamedGroup::X25519MLKEM768));
        assert!(is_post_quantum(NamedGroup::secp256r1MLKEM768));
        assert!(!is_post_quantum(NamedGroup::X25519));
        assert!(!is_post_quantum(NamedGroup::secp256r1));
    }

    #[test]
    fn the_provider_offers_the_hybrid_first() {
        let groups: Vec<_> = provider().kx_groups.iter().map(|g| g.name()).collect();
        assert_eq!(
            groups.first(),
            Some(&NamedGroup::X25519MLKEM768),
            "{groups:?}"
        );
        assert!(groups.contains(&NamedGroup::X25519), "{groups:?}");
    }
}
