//! Claiming, renewing and republishing this node's lease: list, choose with the pure
//! allocator, then claim by a transaction that only succeeds if nobody got there first.

use std::hash::BuildHasher;
use std::net::IpAddr;

use ipnet::IpNet;

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse,
};
use tracing::{debug, info, warn};
use weft_backends::model::{allocate, Allocation, Exhausted, Lease, Taken};
use weft_backends::netconf::NetConf;

use super::kv::{self, lease_of};
use super::{EtcdRegistry, RegistryError};
use crate::registry::{AcquireRequest, LocalAttrs};

const MAX_ATTEMPTS: u32 = 8;

/// How a claiming transaction ended.
enum Claimed {
    Won(Box<Lease>),
    /// Another claim got there first: the leases created since the listing, and the
    /// revision they were read at.
    Lost {
        created: Vec<Stored>,
        revision: i64,
    },
}

/// The leases a failed claim's else-branch read (those created since its listing).
fn created_since(dir: &str, resp: &etcd_client::TxnResponse) -> Vec<Stored> {
    let mut out = Vec::new();
    for op in resp.op_responses() {
        let TxnOpResponse::Get(got) = op else {
            continue;
        };
        for kv in got.kvs() {
            match lease_of(dir, kv) {
                Ok(lease) => out.push(Stored {
                    lease,
                    mod_revision: kv.mod_revision(),
                }),
                Err(e) => warn!(error = %e, "skipping unreadable lease"),
            }
        }
    }
    out
}

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

    /// Claims subnets for this node: chooses from a listing, then claims by a transaction
    /// that holds only if no lease was created in the subnets directory since that
    /// listing (a lease's key names both of its subnets, so guarding the chosen key alone
    /// would let two nodes with different IPv4 but the same IPv6 subnet both win). When it
    /// fails, the same transaction returns the leases created since; the choice is made
    /// again with them, without listing again.
    pub(crate) async fn acquire_lease(
        &mut self,
        net: &NetConf,
        request: &AcquireRequest,
    ) -> Result<Lease, RegistryError> {
        let mut listed = self.list().await?;
        // A claim lost to leases created since the listing means other nodes got
        // subnets, which the network has finitely many of (choosing ends in `Exhausted`):
        // only losses without that progress count against the attempts.
        let (mut relists, mut lost) = (0, 0u64);
        loop {
            let seed = self.cfg.alloc_seed.unwrap_or_else(random_u128);
            let choice = choose(net, request, &listed.leases, seed)?;
            match self.claim(request, &listed, choice).await? {
                Claimed::Won(lease) => return Ok(*lease),
                Claimed::Lost { created, revision } if !created.is_empty() => {
                    lost += 1;
                    debug!(
                        lost,
                        created = created.len(),
                        "leases were created since the listing; choosing again"
                    );
                    // A key deleted and made again since is listed once, as it is now.
                    listed
                        .leases
                        .retain(|s| !created.iter().any(|c| c.lease.node == s.lease.node));
                    listed.leases.extend(created);
                    listed.revision = revision;
                }
                // Nothing new, so a lease this claim replaces changed: list again.
                Claimed::Lost { .. } if relists < MAX_ATTEMPTS => {
                    relists += 1;
                    listed = self.list().await?;
                }
                Claimed::Lost { .. } => {
                    return Err(RegistryError::Contention {
                        attempts: MAX_ATTEMPTS,
                    })
                }
            }
        }
    }

    /// One claiming transaction for `choice`, guarded against any lease created after
    /// `listed` and any change to the leases it replaces.
    async fn claim(
        &mut self,
        request: &AcquireRequest,
        listed: &Listed,
        choice: Choice,
    ) -> Result<Claimed, RegistryError> {
        let dir = self.cfg.subnets_dir();
        let name = kv::lease_name(choice.v4.as_ref(), choice.v6.as_ref());
        let key = format!("{dir}{name}");
        let mut guards = vec![
            Compare::create_revision(dir.clone(), CompareOp::Less, listed.revision + 1)
                .with_range(prefix_end(dir.as_bytes())),
            match listed.leases.iter().find(|s| s.lease.node == name) {
                Some(s) => Compare::mod_revision(key.clone(), CompareOp::Equal, s.mod_revision),
                None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
            },
        ];
        // This node's own leases of another shape over the chosen subnets (the config
        // gained or lost a family): replaced in the same transaction.
        let stale = overlapping(&listed.leases, &choice, &name);
        let mut ops = Vec::new();
        for s in &stale {
            let old = format!("{dir}{}", s.lease.node);
            guards.push(Compare::mod_revision(
                old.clone(),
                CompareOp::Equal,
                s.mod_revision,
            ));
            ops.push(TxnOp::delete(old, None));
        }
        let value = serde_json::to_vec(&request.attrs.to_lease_attrs()).unwrap_or_default();
        let lease_id = self.lease_id().await?;
        ops.push(TxnOp::put(
            key.clone(),
            value.clone(),
            Some(PutOptions::new().with_lease(lease_id)),
        ));
        let since = GetOptions::new()
            .with_range(prefix_end(dir.as_bytes()))
            .with_min_create_revision(listed.revision + 1);
        let txn = Txn::new()
            .when(guards)
            .and_then(ops)
            .or_else([TxnOp::get(dir.clone(), Some(since))]);
        let mut client = self.client.clone();
        let resp = self.call("claiming", &key, client.txn(txn)).await?;
        if !resp.succeeded() {
            return Ok(Claimed::Lost {
                created: created_since(&dir, &resp),
                revision: resp.header().map_or(listed.revision, |h| h.revision()),
            });
        }
        for s in &stale {
            info!(old = %s.lease.node, %key, "replaced this node's lease of another shape");
        }
        info!(%key, lease = format_args!("{lease_id:#x}"), "acquired {}", choice.how);
        self.wrote(&value);
        let lease = request
            .attrs
            .to_lease_attrs()
            .into_lease(name, choice.v4, choice.v6);
        self.held = Some((lease.clone(), request.clone()));
        Ok(Claimed::Won(Box::new(lease)))
    }

    /// Claims again after the lease was lost (deleted, expired): the same subnet if free.
    pub(crate) async fn reacquire(&mut self) -> Result<Lease, RegistryError> {
        let (Some((lease, request)), Some(net)) = (self.held.clone(), self.net.clone()) else {
            return Err(RegistryError::NotAcquired);
        };
        let request = AcquireRequest {
            previous: lease.subnet,
            previous_v6: lease.subnet_v6,
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
        if lease.subnet.is_none() && lease.subnet_v6.is_none() {
            return self.reacquire().await;
        }
        let key = self
            .cfg
            .lease_key(lease.subnet.as_ref(), lease.subnet_v6.as_ref());
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

/// The subnets chosen for this node, one per enabled family, and how.
#[derive(Debug, PartialEq)]
pub(crate) struct Choice {
    pub v4: Option<IpNet>,
    pub v6: Option<IpNet>,
    pub how: &'static str,
}

/// Chooses this node's subnets as flannel does, each family on its own: the previous
/// subnet, else the one already held for this node's public IP of that family, else a
/// free one at random. When a family finds a lease held for this node's public IP whose
/// shape is the one wanted, the node takes that lease whole (its key stays the same).
pub(crate) fn choose(
    net: &NetConf,
    request: &AcquireRequest,
    stored: &[Stored],
    seed: u128,
) -> Result<Choice, Exhausted> {
    let attrs = &request.attrs;
    let family = |v6: bool| -> Result<Option<Allocation>, Exhausted> {
        let pod = if v6 {
            net.ipv6.as_ref()
        } else {
            net.ipv4.as_ref()
        };
        let Some(pod) = pod else {
            return Ok(None);
        };
        let taken: Vec<Taken> = stored
            .iter()
            .filter_map(|s| {
                let l = &s.lease;
                let (subnet, public_ip) = if v6 {
                    (l.subnet_v6?, l.public_ipv6.map(IpAddr::V6))
                } else {
                    (l.subnet?, l.public_ip.map(IpAddr::V4))
                };
                Some(Taken { subnet, public_ip })
            })
            .collect();
        let (previous, public_ip, random) = if v6 {
            let ip = attrs.public_ipv6.map(IpAddr::V6);
            (request.previous_v6, ip, seed.rotate_left(64))
        } else {
            (request.previous, attrs.public_ip.map(IpAddr::V4), seed)
        };
        allocate(pod, &taken, previous, public_ip, random).map(Some)
    };
    let (v4, v6) = (family(false)?, family(true)?);
    let shaped = |l: &Lease| {
        l.subnet.is_some() == net.ipv4.is_some() && l.subnet_v6.is_some() == net.ipv6.is_some()
    };
    let held = |a: Option<Allocation>, pick: fn(&Lease) -> Option<IpNet>| match a {
        Some(Allocation::SamePublicIp(s)) => stored
            .iter()
            .map(|x| &x.lease)
            .find(|l| pick(l) == Some(s) && shaped(l)),
        _ => None,
    };
    if let Some(l) = held(v4, |l| l.subnet).or_else(|| held(v6, |l| l.subnet_v6)) {
        return Ok(Choice {
            v4: l.subnet,
            v6: l.subnet_v6,
            how: "the lease already held for this public IP",
        });
    }
    let how = match v4.or(v6) {
        Some(Allocation::Previous(_)) => "this node's previous subnet",
        Some(Allocation::SamePublicIp(_)) => "the subnet already held for this public IP",
        _ => "a free subnet",
    };
    Ok(Choice {
        v4: v4.map(Allocation::subnet),
        v6: v6.map(Allocation::subnet),
        how,
    })
}

/// The stored leases other than `name` that overlap a chosen subnet: this node's own of
/// another shape (`allocate` only hands out a held subnet to the public IP holding it).
fn overlapping<'a>(stored: &'a [Stored], choice: &Choice, name: &str) -> Vec<&'a Stored> {
    let chosen: Vec<IpNet> = choice.v4.iter().chain(choice.v6.iter()).copied().collect();
    stored
        .iter()
        .filter(|s| s.lease.node != name)
        .filter(|s| {
            s.lease
                .subnets()
                .any(|a| chosen.iter().any(|b| a.contains(b) || b.contains(&a)))
        })
        .collect()
}
