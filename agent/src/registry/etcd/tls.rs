//! TLS to etcd, as flanneld's `--etcd-cafile`, `--etcd-certfile` and `--etcd-keyfile`:
//! the CA that signed etcd's certificate, and this node's client certificate and key for
//! an etcd that requires one (`--client-cert-auth`). And what etcd's TLS and auth
//! failures mean, said plainly: the transport's own errors name neither the file nor the
//! fix.

use std::path::{Path, PathBuf};

use etcd_client::{Certificate, Identity, TlsOptions};

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
