//! A TLS server in front of a plain one, for tests of the agent's TLS links: rustls on
//! aws-lc-rs with the test PKI's server certificate (`server.pem`, for 127.0.0.1 and
//! localhost), which records the key exchange group of every handshake it completes and
//! passes the decrypted bytes both ways to a plain backend (the test API server, an etcd
//! without TLS). What it offers is the test's choice: aws-lc-rs's groups with hybrid
//! X25519MLKEM768 first, as the Kubernetes API server and etcd built with Go 1.24 or later
//! do, or classical X25519 only, as older servers do.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use rustls::crypto::aws_lc_rs;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{NamedGroup, ServerConfig};
use tokio::sync::oneshot;

use crate::pki::Pki;

/// The key exchange groups the front offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    /// aws-lc-rs's defaults: X25519MLKEM768, X25519, P-256, P-384.
    PostQuantum,
    /// X25519 only.
    Classical,
}

pub struct TlsFront {
    pub addr: SocketAddr,
    groups: Arc<Mutex<Vec<NamedGroup>>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn server_config(pki: &Pki, offer: Offer, alpn: &[&[u8]]) -> anyhow::Result<ServerConfig> {
    let mut provider = aws_lc_rs::default_provider();
    if offer == Offer::Classical {
        provider.kx_groups = vec![aws_lc_rs::kx_group::X25519];
    }
    let offered: Vec<_> = provider.kx_groups.iter().map(|g| g.name()).collect();
    anyhow::ensure!(
        (offer == Offer::PostQuantum) == offered.contains(&NamedGroup::X25519MLKEM768),
        "the front would offer {offered:?} for {offer:?}"
    );
    let chain = CertificateDer::pem_file_iter(pki.file("server.pem"))
        .context("server.pem")?
        .collect::<Result<Vec<_>, _>>()
        .context("server.pem")?;
    let key = PrivateKeyDer::from_pem_file(pki.file("server-key.pem")).context("server-key.pem")?;
    let mut config = ServerConfig::builder_with_provider(Arc::new(provider))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

impl TlsFront {
    /// Listens on 127.0.0.1 (a free port) and passes each connection on to `backend`.
    /// `alpn`: the protocols to agree (gRPC clients insist on `h2`; empty for none).
    pub fn start(
        pki: &Pki,
        backend: SocketAddr,
        offer: Offer,
        alpn: &[&[u8]],
    ) -> anyhow::Result<TlsFront> {
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_config(pki, offer, alpn)?));
        let listener =
            std::net::TcpListener::bind("127.0.0.1:0").context("binding the TLS front")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let groups = Arc::new(Mutex::new(Vec::new()));
        let seen = groups.clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let serve = async {
                    loop {
                        let Ok((tcp, _)) = listener.accept().await else {
                            continue;
                        };
                        let (acceptor, seen) = (acceptor.clone(), seen.clone());
                        tokio::spawn(async move {
                            let Ok(mut tls) = acceptor.accept(tcp).await else {
                                return;
                            };
                            if let Some(group) = tls.get_ref().1.negotiated_key_exchange_group() {
                                seen.lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .push(group.name());
                            }
                            let Ok(mut plain) = tokio::net::TcpStream::connect(backend).await
                            else {
                                return;
                            };
                            let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                        });
                    }
                };
                tokio::select! {
                    _ = serve => {}
                    _ = stopped => {}
                }
            });
        });
        Ok(TlsFront {
            addr,
            groups,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// `https://<addr>`.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// The group of every handshake completed so far, oldest first.
    pub fn groups(&self) -> Vec<NamedGroup> {
        self.groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
