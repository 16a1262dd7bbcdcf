//! The etcd registry, in flannel's layout (docs/architecture.md): the config at `<prefix>/config`,
//! one key per node at `<prefix>/subnets/<subnet>` bound to an etcd lease (TTL 24 h,
//! renewed before expiry). In etcd mode a node is named by its subnet key.

mod acquire;
mod follow;
pub mod kv;
pub mod tls;

use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions};
use ipnet::IpNet;
use weft_backends::model::{Exhausted, Lease};
use weft_backends::netconf::{self, ConfigErrors, NetConf};

use super::tls_link;
use super::{AcquireRequest, FollowLinks, Registry};
use crate::backoff::Backoff;

/// The flags that say how to reach etcd (`--etcd-username`, `--etcd-password`,
/// `--etcd-insecure`, `--etcd-cafile`, `--etcd-certfile`, `--etcd-keyfile`).
pub struct EtcdAccess<'a> {
    pub username: &'a str,
    pub password: &'a str,
    pub insecure: bool,
    pub cafile: &'a str,
    pub certfile: &'a str,
    pub keyfile: &'a str,
}

/// How to reach etcd and how to hold the lease.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub prefix: String,
    /// `(user, password)` for etcd's auth.
    pub auth: Option<(String, String)>,
    /// TLS files (`--etcd-cafile`, `--etcd-certfile`, `--etcd-keyfile`).
    pub tls: tls::EtcdTls,
    /// Secrets may go to endpoints that are not https:// (`--etcd-insecure`).
    pub insecure: bool,
    pub lease_ttl: Duration,
    /// Renew this long before the lease would expire.
    pub renew_margin: Duration,
    /// Deadline for one unary request (get, put, txn, grant).
    pub request_timeout: Duration,
    pub backoff: Backoff,
    /// Leases per request when listing (etcd answers at most 4 MiB per response by
    /// default; 1000 leases of flannel's size are about 300 KiB).
    pub list_page: i64,
    /// Fixes the "random" start of the subnet search. Tests use it to make two nodes race
    /// for the same subnet; production leaves it `None`.
    pub alloc_seed: Option<u128>,
}

impl EtcdConfig {
    pub fn new(endpoints: Vec<String>, prefix: impl Into<String>) -> Self {
        EtcdConfig {
            endpoints,
            prefix: prefix.into().trim_end_matches('/').to_string(),
            auth: None,
            tls: tls::EtcdTls::default(),
            insecure: false,
            lease_ttl: Duration::from_secs(24 * 3600),
            renew_margin: Duration::from_secs(3600),
            request_timeout: Duration::from_secs(5),
            backoff: Backoff::default(),
            list_page: 1000,
            alloc_seed: None,
        }
    }

    /// With the access flags the agent and `weft keys rotate --all` share: auth when
    /// `username` is set, TLS files where given (empty: not given), `--etcd-insecure`.
    pub fn with_access(mut self, a: EtcdAccess<'_>) -> Self {
        if !a.username.is_empty() {
            self.auth = Some((a.username.to_string(), a.password.to_string()));
        }
        let path = |p: &str| (!p.is_empty()).then(|| std::path::PathBuf::from(p));
        self.tls = tls::EtcdTls {
            ca: path(a.cafile),
            cert: path(a.certfile),
            key: path(a.keyfile),
        };
        self.insecure = a.insecure;
        self
    }

    /// How the client speaks to these endpoints.
    pub fn tls_use(&self) -> tls::TlsUse {
        if !self.clear_endpoints().is_empty() {
            tls::TlsUse::None
        } else if self.tls.cert.is_some() {
            tls::TlsUse::ClientCert
        } else {
            tls::TlsUse::ServerOnly
        }
    }

    pub fn config_key(&self) -> String {
        format!("{}/config", self.prefix)
    }

    pub fn subnets_dir(&self) -> String {
        format!("{}/subnets/", self.prefix)
    }

    /// The etcd key of the lease holding these subnets (`kv::lease_name`).
    pub fn lease_key(&self, v4: Option<&IpNet>, v6: Option<&IpNet>) -> String {
        format!("{}{}", self.subnets_dir(), kv::lease_name(v4, v6))
    }

    /// The endpoints that carry requests in clear: every one that is not `https://`.
    pub fn clear_endpoints(&self) -> Vec<&str> {
        self.endpoints
            .iter()
            .map(String::as_str)
            .filter(|e| !e.to_ascii_lowercase().starts_with("https://"))
            .collect()
    }

    /// Refuses to send `what` (a secret) to clear endpoints, unless `insecure`.
    pub fn refuse_in_clear(&self, what: impl Into<String>) -> Result<(), RegistryError> {
        let clear = self.clear_endpoints();
        if self.insecure || clear.is_empty() {
            return Ok(());
        }
        Err(RegistryError::SecretInClear {
            what: what.into(),
            endpoints: clear.join(","),
        })
    }

    /// `<prefix>/weft/psk`: the cluster's PSK, with an announced next one.
    pub fn psk_key(&self) -> String {
        format!("{}/weft/psk", self.prefix)
    }

    /// Time between renewals: the TTL less the margin, at least a second.
    pub fn renew_every(&self) -> Duration {
        self.lease_ttl
            .saturating_sub(self.renew_margin)
            .max(Duration::from_secs(1))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("etcd at {endpoints}: {op} {key}: {}", tls::explain(.source, *.tls))]
    Etcd {
        endpoints: String,
        op: &'static str,
        key: String,
        /// How the client spoke to etcd (what a refused handshake means).
        tls: tls::TlsUse,
        #[source]
        source: etcd_client::Error,
    },
    #[error("etcd at {endpoints}: {op} {key}: no answer within {timeout:?}")]
    Timeout {
        endpoints: String,
        op: &'static str,
        key: String,
        timeout: Duration,
    },
    #[error("etcd has no network config at {key}; write one, e.g. `etcdctl put {key} '{{\"Network\": \"10.244.0.0/16\", \"Backend\": {{\"Type\": \"wireguard\"}}}}'`")]
    NoConfig { key: String },
    #[error("this node holds no lease yet: acquire one first")]
    NotAcquired,
    #[error("the network config at {key} is invalid: {errors}")]
    BadConfig { key: String, errors: ConfigErrors },
    #[error(transparent)]
    Exhausted(#[from] Exhausted),
    #[error(
        "could not claim a subnet after {attempts} attempts: the leases it replaces kept changing"
    )]
    Contention { attempts: u32 },
    #[error("the etcd lease {lease:#x} holding {key} has expired")]
    LeaseExpired { lease: i64, key: String },
    #[error("{what} would cross the network in clear: etcd endpoint(s) {endpoints} are not https://; use https:// endpoints, or --etcd-insecure to accept that anyone on the path can read it")]
    SecretInClear { what: String, endpoints: String },
    #[error("etcd TLS: {0}")]
    Tls(#[from] tls::TlsError),
}

pub struct EtcdRegistry {
    cfg: EtcdConfig,
    client: Client,
    /// Our etcd lease id, once granted.
    lease_id: Option<i64>,
    /// Our lease and what it publishes, once acquired.
    held: Option<(Lease, AcquireRequest)>,
    net: Option<NetConf>,
    /// The last rotation request passed on to the agent.
    last_rotate: Option<String>,
    /// The values this agent wrote to its lease, newest last (a few): a put on the lease
    /// with another value, or without our etcd lease, was written by someone else.
    written: Vec<Vec<u8>>,
}

impl EtcdRegistry {
    /// Connects to etcd. The connection is made lazily by the client; an unreachable etcd
    /// shows up as an error from the first request, which the caller retries.
    pub async fn connect(cfg: EtcdConfig) -> Result<Self, RegistryError> {
        if cfg.auth.is_some() {
            cfg.refuse_in_clear("the etcd password")?;
        }
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
            .with_keep_alive_while_idle(true);
        if let Some((user, password)) = &cfg.auth {
            options = options.with_user(user.clone(), password.clone());
        }
        if let Some(tls) = cfg.tls.options(&cfg.endpoints)? {
            tls_link::provider();
            options = options.with_tls(tls);
        }
        let client = Client::connect(&cfg.endpoints, Some(options))
            .await
            .map_err(|source| RegistryError::Etcd {
                endpoints: cfg.endpoints.join(","),
                op: "connecting to",
                key: String::new(),
                tls: cfg.tls_use(),
                source,
            })?;
        Ok(EtcdRegistry {
            cfg,
            client,
            lease_id: None,
            held: None,
            net: None,
            last_rotate: None,
            written: Vec::new(),
        })
    }

    pub fn config(&self) -> &EtcdConfig {
        &self.cfg
    }

    /// Asks `node` to rotate its key (`weft keys rotate --all`): writes request `id` to
    /// `<prefix>/weft/rotate/<node>`, which the node's agent watches.
    pub async fn request_rotation(&self, node: &str, id: &str) -> Result<(), RegistryError> {
        let key = kv::rotate_request_key(&self.cfg.prefix, node);
        let mut client = self.client.clone();
        self.call("writing", &key, client.put(key.clone(), id, None))
            .await
            .map(drop)
    }

    /// Whether secrets may be read from this etcd (https://, or `--etcd-insecure`).
    pub(crate) fn secrets_allowed(&self) -> bool {
        self.cfg.insecure || self.cfg.clear_endpoints().is_empty()
    }

    fn etcd_err(
        &self,
        op: &'static str,
        key: &str,
    ) -> impl FnOnce(etcd_client::Error) -> RegistryError {
        let (endpoints, key) = (self.cfg.endpoints.join(","), key.to_string());
        let tls = self.cfg.tls_use();
        move |source| RegistryError::Etcd {
            endpoints,
            op,
            key,
            tls,
            source,
        }
    }

    /// Runs one unary request under the request deadline.
    async fn call<T>(
        &self,
        op: &'static str,
        key: &str,
        fut: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, RegistryError> {
        match tokio::time::timeout(self.cfg.request_timeout, fut).await {
            Ok(result) => result.map_err(self.etcd_err(op, key)),
            Err(_) => Err(RegistryError::Timeout {
                endpoints: self.cfg.endpoints.join(","),
                op,
                key: key.to_string(),
                timeout: self.cfg.request_timeout,
            }),
        }
    }
}

impl Registry for EtcdRegistry {
    type Error = RegistryError;

    async fn net_conf(&mut self) -> Result<NetConf, RegistryError> {
        let key = self.cfg.config_key();
        let mut client = self.client.clone();
        let resp = self
            .call("reading", &key, client.get(key.clone(), None))
            .await?;
        let kv = resp
            .kvs()
            .first()
            .ok_or_else(|| RegistryError::NoConfig { key: key.clone() })?;
        let text = String::from_utf8_lossy(kv.value());
        let net =
            netconf::parse(&text).map_err(|errors| RegistryError::BadConfig { key, errors })?;
        self.net = Some(net.clone());
        Ok(net)
    }

    async fn acquire(
        &mut self,
        net: &NetConf,
        request: &AcquireRequest,
    ) -> Result<Lease, RegistryError> {
        self.acquire_lease(net, request).await
    }

    /// A `Backend.PSK` in the network config, or the cluster PSK at `<prefix>/weft/psk`,
    /// with endpoints that are not https:// and no `--etcd-insecure`. The PSK key is only
    /// asked whether it exists, never read.
    async fn secrets_in_clear(
        &mut self,
        net: &NetConf,
    ) -> Result<Option<RegistryError>, RegistryError> {
        if self.secrets_allowed() {
            return Ok(None);
        }
        if matches!(&net.backend, netconf::Backend::Wireguard(w) if w.psk.is_some()) {
            let what = format!("the PSK in the network config {}", self.cfg.config_key());
            return Ok(self.cfg.refuse_in_clear(what).err());
        }
        let key = self.cfg.psk_key();
        let mut client = self.client.clone();
        let found = self
            .call(
                "looking for",
                &key,
                client.get(key.clone(), Some(GetOptions::new().with_count_only())),
            )
            .await?
            .count();
        if found > 0 {
            return Ok(self
                .cfg
                .refuse_in_clear(format!("the cluster PSK at {key}"))
                .err());
        }
        Ok(None)
    }

    async fn follow(self, links: FollowLinks) {
        follow::run(self, links).await
    }
}
