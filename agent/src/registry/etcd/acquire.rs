//! Claiming, renewing and republishing this node's lease: list, choose with the pure
//! allocator, then claim by a transaction that only succeeds if nobody got there first.

use std::hash::BuildHasher;
use std::net::IpAddr;

use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, PutOptions, Txn, TxnOp};
use tracing::{debug, info, warn};
use weft_backends::model::{allocate, Allocation, Lease, Taken};
use weft_backends::netconf::NetConf;

use super::kv::{self, lease_of};
use super::{EtcdRegistry, RegistryError};
use crate::registry::{AcquireRequest, LocalAttrs};

const MAX_ATTEMPTS: u32 = 8;

/// One lease as listed, with what a transaction compares against.
pub(crate) struct Stored {
    pub lease: Lease,
    pub mod_revision: i64,
}

pub(crate) struct Listed {
    pub leases: Vec<Stored>,
    /// The store's revision at the time of the listing; watch from the next one.
    pub revision: i64,
}

/// The end of the key range holding every key that starts with `prefix` (etcd's
/// `--prefix`): the prefix with its last byte below 0xff incremented.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

fn random_u128() -> u128 {
    // Only spreads nodes over the network; it need not be unpredictable.
    let state = std::collections::hash_map::RandomState::new();
    (u128::from(state.hash_one(1u8)) << 64) | u128::from(state.hash_one(2u8))
}

impl EtcdRegistry {
    /// Lists every lease under `<prefix>/subnets/`, `list_page` at a time, all pages at
    /// the revision of the first (one consistent listing, however large). A lease that
    /// cannot be read is logged, naming its key, and skipped; the rest are returned.
    pub(crate) async fn list(&self) -> Result<Listed, RegistryError> {
        let dir = self.cfg.subnets_dir();
        let end = prefix_end(dir.as_bytes());
        let mut client = self.client.clone();
        let mut from = dir.as_bytes().to_vec();
        let mut revision = 0;
        let mut leases = Vec::new();
        loop {
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(self.cfg.list_page);
            if revision != 0 {
                options = options.with_revision(revision);
            }
            let resp = self
                .call("listing", &dir, client.get(from.clone(), Some(options)))
                .await?;
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
            }
            for kv in resp.kvs() {
                match lease_of(&dir, kv) {
                    Ok(lease) => leases.push(Stored {
                        lease,
                        mod_revision: kv.mod_revision(),
                    }),
                    Err(e) => warn!(error = %e, "skipping unreadable lease"),
                }
            }
            match resp.kvs().last() {
                Some(last) if resp.more() => {
                    // The next page starts just after the last key.
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        Ok(Listed { leases, revision })
    }

    async fn lease_id(&mut self) -> Result<i64, RegistryError> {
        if let Some(id) = self.lease_id {
            return Ok(id);
        }
        let ttl = i64::try_from(self.cfg.lease_ttl.as_secs()).unwrap_or(i64::MAX);
        let mut client = self.client.clone();
        let id = self
            .call(
                "granting a lease for",
                "this node",
                client.lease_grant(ttl, None),
            )
            .await?
            .id();
        self.lease_id = Some(id);
        Ok(id)
    }

    pub(crate) async fn acquire_lease(
        &mut self,
        net: &NetConf,
        request: &AcquireRequest,
    ) -> Result<Lease, RegistryError> {
        if net.ipv6.is_some() {
            return Err(RegistryError::Ipv6Unsupported);
        }
        let Some(pod) = net.ipv4 else {
            return Err(RegistryError::Ipv6Unsupported);
        };
        let public_ip = request.attrs.public_ip.map(IpAddr::V4);
        let value = serde_json::to_vec(&request.attrs.to_lease_attrs()).unwrap_or_default();
        for attempt in 1..=MAX_ATTEMPTS {
            let listed = self.list().await?;
            let taken: Vec<Taken> = listed
                .leases
                .iter()
                .filter_map(|s| {
                    s.lease.subnet.map(|subnet| Taken {
                        subnet,
                        public_ip: s.lease.public_ip.map(IpAddr::V4),
                    })
                })
                .collect();
            let seed = self.cfg.alloc_seed.unwrap_or_else(random_u128);
            let choice = allocate(&pod, &taken, request.previous, public_ip, seed)?;
            let subnet = choice.subnet();
            let key = self.cfg.subnet_key(&subnet);
            let guard = match listed
                .leases
                .iter()
                .find(|s| s.lease.subnet == Some(subnet))
            {
                Some(s) => Compare::mod_revision(key.clone(), CompareOp::Equal, s.mod_revision),
                None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
            };
            let lease_id = self.lease_id().await?;
            let txn = Txn::new().when([guard]).and_then([TxnOp::put(
                key.clone(),
                value.clone(),
                Some(PutOptions::new().with_lease(lease_id)),
            )]);
            let mut client = self.client.clone();
            if self
                .call("claiming", &key, client.txn(txn))
                .await?
                .succeeded()
            {
                let how = match choice {
                    Allocation::Previous(_) => "this node's previous subnet",
                    Allocation::SamePublicIp(_) => "the lease already held for this public IP",
                    Allocation::Fresh(_) => "a free subnet",
                };
                info!(%subnet, %key, lease = format_args!("{lease_id:#x}"), "acquired {how}");
                self.wrote(&value);
                let lease = request.attrs.to_lease_attrs().into_lease(
                    kv::subnet_key(&subnet),
                    Some(subnet),
                    None,
                );
                self.held = Some((lease.clone(), request.clone()));
                return Ok(lease);
            }
            debug!(%subnet, attempt, "another node claimed the subnet first; choosing again");
        }
        Err(RegistryError::Contention {
            attempts: MAX_ATTEMPTS,
        })
    }

    /// Claims again after the lease was lost (deleted, expired): the same subnet if free.
    pub(crate) async fn reacquire(&mut self) -> Result<Lease, RegistryError> {
        let (Some((lease, request)), Some(net)) = (self.held.clone(), self.net.clone()) else {
            return Err(RegistryError::NotAcquired);
        };
        let request = AcquireRequest {
            previous: lease.subnet,
            ..request
        };
        // Our key is gone; so may be our etcd lease (etcd restored from a snapshot taken
        // before it was granted answers "requested lease not found" forever). A fresh one
        // is granted; the old, if it lives, holds nothing and expires.
        self.lease_id = None;
        self.acquire_lease(&net, &request).await
    }

    /// Keeps the etcd lease alive: one keep-alive round trip.
    pub(crate) async fn renew(&mut self) -> Result<(), RegistryError> {
        let key = self
            .held
            .as_ref()
            .map(|(l, _)| l.node.clone())
            .unwrap_or_default();
        let Some(id) = self.lease_id else {
            return Ok(());
        };
        let mut client = self.client.clone();
        let (mut keeper, mut stream) = self
            .call("renewing the lease of", &key, client.lease_keep_alive(id))
            .await?;
        self.call("renewing the lease of", &key, keeper.keep_alive())
            .await?;
        let resp = self
            .call("renewing the lease of", &key, stream.message())
            .await?;
        match resp {
            Some(r) if r.ttl() > 0 => {
                debug!(%key, ttl = r.ttl(), "lease renewed");
                Ok(())
            }
            _ => {
                self.lease_id = None;
                Err(RegistryError::LeaseExpired { lease: id, key })
            }
        }
    }

    /// A write of this node's `value` to `key` under etcd lease `id`, if `when` holds;
    /// remembered as ours (see `defend`).
    fn leased_put(&mut self, key: &str, value: Vec<u8>, id: i64, when: Compare) -> Txn {
        self.wrote(&value);
        Txn::new().when([when]).and_then([TxnOp::put(
            key,
            value,
            Some(PutOptions::new().with_lease(id)),
        )])
    }

    /// Remembers a value written to our lease (the last few).
    fn wrote(&mut self, value: &[u8]) {
        const KEEP: usize = 8;
        if self.written.len() == KEEP {
            self.written.remove(0);
        }
        self.written.push(value.to_vec());
    }

    /// Puts this node's value back over a put on its lease that this agent did not make
    /// (`kv`, as the watch saw it): another value, or the value without this node's etcd
    /// lease (it would never expire). Returns whether `kv` was such a foreign write. The
    /// write-back only lands if nothing wrote the key since `kv`.
    pub(crate) async fn defend(&mut self, kv: &KeyValue) -> Result<bool, RegistryError> {
        let (Some((_, request)), Some(id)) = (self.held.as_ref(), self.lease_id) else {
            return Ok(false);
        };
        if kv.lease() == id && self.written.iter().any(|v| v.as_slice() == kv.value()) {
            return Ok(false);
        }
        let ours = serde_json::to_vec(&request.attrs.to_lease_attrs()).unwrap_or_default();
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        warn!(
            key = ?key,
            foreign = ?String::from_utf8_lossy(kv.value()),
            foreign_lease = format_args!("{:#x}", kv.lease()),
            "someone else wrote this node's lease; writing this node's value back"
        );
        let unchanged = Compare::mod_revision(key.clone(), CompareOp::Equal, kv.mod_revision());
        let txn = self.leased_put(&key, ours, id, unchanged);
        let mut client = self.client.clone();
        self.call("writing back", &key, client.txn(txn)).await?;
        Ok(true)
    }

    /// Publishes new attributes on the lease we hold; re-acquires if it is no longer ours.
    pub(crate) async fn republish(&mut self, attrs: LocalAttrs) -> Result<Lease, RegistryError> {
        let (Some((lease, request)), Some(id)) = (self.held.clone(), self.lease_id) else {
            return Err(RegistryError::NotAcquired);
        };
        let request = request.with_attrs(attrs);
        let Some(subnet) = lease.subnet else {
            return self.reacquire().await;
        };
        let key = self.cfg.subnet_key(&subnet);
        let value = serde_json::to_vec(&request.attrs.to_lease_attrs()).unwrap_or_default();
        let still_ours = Compare::lease(key.clone(), CompareOp::Equal, id);
        let txn = self.leased_put(&key, value, id, still_ours);
        let mut client = self.client.clone();
        let updated = request.attrs.to_lease_attrs().into_lease(
            lease.node.clone(),
            lease.subnet,
            lease.subnet_v6,
        );
        self.held = Some((updated.clone(), request));
        if self
            .call("updating", &key, client.txn(txn))
            .await?
            .succeeded()
        {
            info!(%key, "published new attributes");
            return Ok(updated);
        }
        warn!(%key, "our lease is no longer ours; claiming again");
        self.reacquire().await
    }
}
