//! TLS to etcd, as flanneld's `--etcd-cafile`, `--etcd-certfile` and `--etcd-keyfile`:
//! the CA that signed etcd's certificate, and this node's client certificate and key for
//! an etcd that requires one (`--client-cert-auth`). And what etcd's TLS and auth
//! failures mean, said plainly: the transport's own errors name neither the file nor the
//! fix.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use etcd_client::{Certificate, Identity, TlsOptions};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};

use crate::registry::tls_link::{self, Link, Transport};

/// The TLS files given (paths as the flags gave them; empty when not given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {path}: {source}")]
    File {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{given} is given without {missing}: a client certificate needs both")]
    HalfIdentity {
        given: &'static str,
        missing: &'static str,
    },
    #[error("https:// etcd endpoints ({endpoints}) need --etcd-cafile, the CA that signed etcd's certificate")]
    NoCa { endpoints: String },
    #[error("{flag} is given but no etcd endpoint is https:// ({endpoints}): nothing would use it; use https:// endpoints")]
    NotHttps {
        flag: &'static str,
        endpoints: String,
    },
    #[error("{flag} {path}: {what}")]
    Pem {
        flag: &'static str,
        path: PathBuf,
        what: String,
    },
    #[error("etcd endpoint {endpoint:?}: {what}")]
    Endpoint { endpoint: String, what: String },
    #[error("TLS provider: {0}")]
    Provider(#[source] rustls::Error),
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::File {
        flag,
        path: path.to_path_buf(),
        source,
    })
}

impl EtcdTls {
    fn given(&self) -> Option<&'static str> {
        [
            (self.ca.is_some(), "--etcd-cafile"),
            (self.cert.is_some(), "--etcd-certfile"),
            (self.key.is_some(), "--etcd-keyfile"),
        ]
        .into_iter()
        .find_map(|(set, flag)| set.then_some(flag))
    }

    /// The client's TLS options for `endpoints`: `None` for plain http://.
    pub fn options(&self, endpoints: &[String]) -> Result<Option<TlsOptions>, TlsError> {
        let https = endpoints
            .iter()
            .any(|e| e.to_ascii_lowercase().starts_with("https://"));
        if !https {
            return match self.given() {
                Some(flag) => Err(TlsError::NotHttps {
                    flag,
                    endpoints: endpoints.join(","),
                }),
                None => Ok(None),
            };
        }
        let Some(ca) = &self.ca else {
            return Err(TlsError::NoCa {
                endpoints: endpoints.join(","),
            });
        };
        let mut options =
            TlsOptions::new().ca_certificate(Certificate::from_pem(read("--etcd-cafile", ca)?));
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let identity = Identity::from_pem(
                    read("--etcd-certfile", cert)?,
                    read("--etcd-keyfile", key)?,
                );
                options = options.identity(identity);
            }
            (Some(_), None) => {
                return Err(TlsError::HalfIdentity {
                    given: "--etcd-certfile",
                    missing: "--etcd-keyfile",
                })
            }
            (None, Some(_)) => {
                return Err(TlsError::HalfIdentity {
                    given: "--etcd-keyfile",
                    missing: "--etcd-certfile",
                })
            }
            (None, None) => {}
        }
        Ok(Some(options))
    }
}

impl EtcdTls {
    /// One link per endpoint, for [`tls_link::report`]: https:// ones with a rustls
    /// configuration of the same provider, CA, client certificate and ALPN (h2) as the
    /// etcd client's own.
    pub fn links(&self, endpoints: &[String]) -> Result<Vec<Link>, TlsError> {
        let config = match self.options(endpoints)? {
            Some(_) => Some(Arc::new(self.client_config()?)),
            None => None,
        };
        let mut links = Vec::new();
        for endpoint in endpoints {
            let lower = endpoint.to_ascii_lowercase();
            let tls = lower.starts_with("https://") || !lower.starts_with("http://");
            let transport = match (&config, tls) {
                (Some(config), true) => {
                    let bad = |what: &str| TlsError::Endpoint {
                        endpoint: endpoint.clone(),
                        what: what.to_string(),
                    };
                    let (host, port) = tls_link::host_port(endpoint, 2379)
                        .ok_or_else(|| bad("no host:port in it"))?;
                    let server_name = ServerName::try_from(host.clone())
                        .map_err(|e| bad(&format!("not a server name: {e}")))?;
                    Transport::Tls {
                        host,
                        port,
                        server_name,
                        config: config.clone(),
                    }
                }
                _ => Transport::Clear,
            };
            links.push(Link {
                kind: "etcd",
                server: endpoint.clone(),
                transport,
            });
        }
        Ok(links)
    }

    /// What the etcd client (tonic) builds from [`EtcdTls::options`], built here: the
    /// process's provider, the CA as the only root, the client certificate if given, h2.
    fn client_config(&self) -> Result<ClientConfig, TlsError> {
        let pem = |flag: &'static str, path: &Path, what: String| TlsError::Pem {
            flag,
            path: path.to_path_buf(),
            what,
        };
        let mut roots = RootCertStore::empty();
        if let Some(ca) = &self.ca {
            let bytes = read("--etcd-cafile", ca)?;
            for cert in CertificateDer::pem_slice_iter(&bytes) {
                let cert = cert.map_err(|e| pem("--etcd-cafile", ca, e.to_string()))?;
                roots
                    .add(cert)
                    .map_err(|e| pem("--etcd-cafile", ca, e.to_string()))?;
            }
        }
        let builder = ClientConfig::builder_with_provider(tls_link::provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Provider)?
            .with_root_certificates(roots);
        let mut config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let bytes = read("--etcd-certfile", cert)?;
                let chain = CertificateDer::pem_slice_iter(&bytes)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| pem("--etcd-certfile", cert, e.to_string()))?;
                let bytes = read("--etcd-keyfile", key)?;
                let private = PrivateKeyDer::from_pem_slice(&bytes)
                    .map_err(|e| pem("--etcd-keyfile", key, e.to_string()))?;
                builder
                    .with_client_auth_cert(chain, private)
                    .map_err(|e| pem("--etcd-keyfile", key, e.to_string()))?
            }
            _ => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// How this client speaks to etcd, for what a failure means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsUse {
    None,
    /// TLS, checking etcd's certificate only.
    ServerOnly,
    /// TLS with this node's client certificate.
    ClientCert,
}

/// `e` as an operator can act on it: what a TLS or auth failure means, then the
/// transport's own words. etcd answers a missing client certificate and a refused one
/// alike (sometimes only by closing the connection), so `tls` says which this was.
pub fn explain(e: &etcd_client::Error, tls: TlsUse) -> String {
    let client_cert = tls == TlsUse::ClientCert;
    let mut chain = format!("{e}");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        chain += &format!(": {s}");
        source = s.source();
    }
    let text = format!("{e:?} {chain}");
    let refused = if client_cert {
        "etcd refused this node's client certificate (--etcd-certfile): not signed by a CA etcd trusts, or expired"
    } else {
        "etcd requires a client certificate: give --etcd-certfile and --etcd-keyfile"
    };
    let meaning = [
        (
            "UnknownIssuer",
            "etcd's certificate is not signed by the CA in --etcd-cafile",
        ),
        (
            "NotValidForName",
            "etcd's certificate does not name the endpoint's host",
        ),
        ("Expired", "etcd's certificate has expired"),
        ("BadCertificate", refused),
        ("CertificateRequired", refused),
        ("certificate required", refused),
        (
            "invalid user ID or password",
            "etcd refused the user name or password (--etcd-username, --etcd-password)",
        ),
        (
            "user name is empty",
            "etcd has authentication enabled: give --etcd-username and --etcd-password",
        ),
    ]
    .into_iter()
    .find(|(marker, _)| text.contains(marker))
    .map(|(_, meaning)| meaning.to_string());
    // Closed at once under TLS: the alert that says why did not arrive first.
    let closed = [
        "connection closed",
        "operation was canceled",
        "broken pipe",
        "connection reset",
    ]
    .iter()
    .any(|m| text.contains(m));
    let meaning = meaning.or_else(|| {
        (tls != TlsUse::None && closed)
            .then(|| format!("etcd closed the connection at TLS setup; most likely {refused}"))
    });
    match meaning {
        Some(m) => format!("{m} ({chain})"),
        None => chain,
    }
}
