//! Certificates for TLS tests, made at run time: a CA, etcd's server certificate for
//! 127.0.0.1, a client certificate signed by the CA, one that has expired, and a second CA
//! that signed nothing etcd trusts. PEM files in a temporary directory.

use std::path::{Path, PathBuf};

use anyhow::Context;
use rcgen::{
    date_time_ymd, BasicConstraints, Certificate, CertificateParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair,
};

pub struct Pki {
    dir: tempfile::TempDir,
}

struct Ca {
    cert: Certificate,
    key: KeyPair,
}

fn ca(name: &str) -> anyhow::Result<Ca> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok(Ca { cert, key })
}

/// A leaf signed by `ca`, valid now unless `expired`.
fn leaf(
    ca: &Ca,
    name: &str,
    sans: Vec<String>,
    usage: ExtendedKeyUsagePurpose,
    expired: bool,
) -> anyhow::Result<(String, String)> {
    let mut params = CertificateParams::new(sans)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![usage];
    if expired {
        params.not_before = date_time_ymd(2020, 1, 1);
        params.not_after = date_time_ymd(2021, 1, 1);
    }
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &ca.cert, &ca.key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

impl Pki {
    pub fn new() -> anyhow::Result<Pki> {
        let dir = tempfile::Builder::new().prefix("weft-pki-").tempdir()?;
        let (trusted, other) = (ca("weft test CA")?, ca("another CA")?);
        let write = |name: &str, text: &str| -> anyhow::Result<()> {
            std::fs::write(dir.path().join(name), text).with_context(|| format!("writing {name}"))
        };
        write("ca.pem", &trusted.cert.pem())?;
        write("other-ca.pem", &other.cert.pem())?;
        let server_names = vec!["127.0.0.1".to_string(), "localhost".to_string()];
        let files = [
            (
                "server",
                &trusted,
                server_names,
                ExtendedKeyUsagePurpose::ServerAuth,
                false,
            ),
            (
                "client",
                &trusted,
                vec![],
                ExtendedKeyUsagePurpose::ClientAuth,
                false,
            ),
            (
                "expired",
                &trusted,
                vec![],
                ExtendedKeyUsagePurpose::ClientAuth,
                true,
            ),
            (
                "stranger",
                &other,
                vec![],
                ExtendedKeyUsagePurpose::ClientAuth,
                false,
            ),
        ];
        for (name, ca, sans, usage, expired) in files {
            let (cert, key) = leaf(ca, name, sans, usage, expired)?;
            write(&format!("{name}.pem"), &cert)?;
            write(&format!("{name}-key.pem"), &key)?;
        }
        Ok(Pki { dir })
    }

    /// `ca.pem`, `other-ca.pem`, `server.pem`, `server-key.pem`, `client.pem`,
    /// `client-key.pem`, `expired.pem`, `expired-key.pem`, `stranger.pem` (signed by the
    /// other CA), `stranger-key.pem`.
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}
