//! In-memory kernels for the reconcilers' tests: `FakeNetlink` holds links, addresses and
//! routes as the kernel would (a route is keyed by destination and metric, so the
//! fail-closed blackhole sits beside the unicast route to the same network); `FakeNft`
//! holds nftables tables as `nft -j list table` prints them. Both count writes, and a test
//! can delete or change anything behind the reconciler's back, as an operator would. No
//! root, no kernel: the real ones are exercised by the lab.

use std::collections::BTreeMap;

use ipnet::IpNet;
use serde_json::{json, Value};

use super::{ApplyError, Netlink, Nft, ObservedLink, ObservedRoute, RouteWrite, RTPROT_WEFT};
use crate::model::{Family, FAIL_CLOSED_METRIC};

#[derive(Debug, Default)]
pub struct FakeNetlink {
    pub links: BTreeMap<String, ObservedLink>,
    pub addresses: BTreeMap<u32, Vec<IpNet>>,
    /// By (destination, metric).
    pub routes: BTreeMap<(IpNet, u32), ObservedRoute>,
    writes: u64,
}

impl FakeNetlink {
    /// Adds a link (as a device reconciler or an operator would), down, MTU 1500.
    pub fn add_link(&mut self, name: &str, kind: &str) -> u32 {
        let index = self.links.values().map(|l| l.index).max().unwrap_or(1) + 1;
        self.links.insert(
            name.to_string(),
            ObservedLink {
                index,
                name: name.to_string(),
                mtu: 1500,
                up: false,
                kind: Some(kind.to_string()),
                mac: Vec::new(),
                vxlan: None,
            },
        );
        index
    }

    /// Deletes a link, and with it its addresses and the routes through it, as the kernel
    /// does.
    pub fn delete_link(&mut self, name: &str) {
        if let Some(l) = self.links.remove(name) {
            self.addresses.remove(&l.index);
            self.routes.retain(|_, r| r.oif != Some(l.index));
        }
    }

    fn unknown(op: &str, what: impl std::fmt::Display) -> ApplyError {
        ApplyError::Netlink {
            op: format!("{op} {what}"),
            source: std::io::Error::from_raw_os_error(libc_enodev()),
        }
    }
}

/// ENODEV, without a libc dependency here.
fn libc_enodev() -> i32 {
    19
}

impl Netlink for FakeNetlink {
    async fn link(&mut self, name: &str) -> Result<Option<ObservedLink>, ApplyError> {
        Ok(self.links.get(name).cloned())
    }

    async fn set_link(
        &mut self,
        link: &ObservedLink,
        mtu: u32,
        up: bool,
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        let l = self
            .links
            .get_mut(&link.name)
            .ok_or_else(|| Self::unknown("setting link", &link.name))?;
        l.mtu = mtu;
        l.up = up;
        Ok(())
    }

    async fn addresses(&mut self, link: &ObservedLink) -> Result<Vec<IpNet>, ApplyError> {
        Ok(self.addresses.get(&link.index).cloned().unwrap_or_default())
    }

    async fn add_address(&mut self, link: &ObservedLink, addr: IpNet) -> Result<(), ApplyError> {
        self.writes += 1;
        let list = self.addresses.entry(link.index).or_default();
        if list.contains(&addr) {
            return Err(ApplyError::Netlink {
                op: format!("adding address {addr} to {}", link.name),
                source: std::io::Error::from_raw_os_error(17),
            });
        }
        list.push(addr);
        Ok(())
    }

    async fn del_address(&mut self, link: &ObservedLink, addr: IpNet) -> Result<(), ApplyError> {
        self.writes += 1;
        if let Some(list) = self.addresses.get_mut(&link.index) {
            list.retain(|a| *a != addr);
        }
        Ok(())
    }

    async fn routes(&mut self, family: Family) -> Result<Vec<ObservedRoute>, ApplyError> {
        Ok(self
            .routes
            .values()
            .filter(|r| Family::of(&r.dst) == family)
            .cloned()
            .collect())
    }

    async fn put_route(&mut self, route: &RouteWrite) -> Result<(), ApplyError> {
        self.writes += 1;
        if !self.links.values().any(|l| l.index == route.oif) {
            return Err(Self::unknown("adding route", route.dst));
        }
        self.routes.insert(
            (route.dst, 0),
            ObservedRoute {
                dst: route.dst,
                oif: Some(route.oif),
                gateway: route.gateway,
                protocol: RTPROT_WEFT,
                blackhole: false,
                metric: 0,
            },
        );
        Ok(())
    }

    async fn put_blackhole(&mut self, dst: IpNet) -> Result<(), ApplyError> {
        self.writes += 1;
        self.routes.insert(
            (dst, FAIL_CLOSED_METRIC),
            ObservedRoute {
                dst,
                oif: None,
                gateway: None,
                protocol: RTPROT_WEFT,
                blackhole: true,
                metric: FAIL_CLOSED_METRIC,
            },
        );
        Ok(())
    }

    async fn del_route(&mut self, route: &ObservedRoute) -> Result<(), ApplyError> {
        self.writes += 1;
        self.routes.remove(&(route.dst, route.metric));
        Ok(())
    }

    fn writes(&self) -> u64 {
        self.writes
    }
}

/// nftables tables, as `nft -j list table` prints them. A batch replaces the tables it
/// names (weft's batches delete and recreate a table in one transaction).
#[derive(Debug, Default)]
pub struct FakeNft {
    /// By (family, table): the table's listing.
    pub tables: BTreeMap<(String, String), Value>,
    writes: u64,
}

impl Nft for FakeNft {
    async fn list(&mut self, family: Family, table: &str) -> Result<Option<Value>, ApplyError> {
        Ok(self
            .tables
            .get(&(family.nft().to_string(), table.to_string()))
            .cloned())
    }

    async fn apply(&mut self, _what: &str, batch: Value) -> Result<(), ApplyError> {
        self.writes += 1;
        let commands = batch["nftables"].as_array().cloned().unwrap_or_default();
        // The objects each table ends up with, in the order added.
        let mut built: BTreeMap<(String, String), Vec<Value>> = BTreeMap::new();
        for command in commands {
            let Some((verb, body)) = command.as_object().and_then(|o| o.iter().next()) else {
                continue;
            };
            let Some((kind, object)) = body.as_object().and_then(|o| o.iter().next()) else {
                continue;
            };
            let family = object["family"].as_str().unwrap_or_default().to_string();
            let table = match kind.as_str() {
                "table" => object["name"].as_str(),
                _ => object["table"].as_str(),
            }
            .unwrap_or_default()
            .to_string();
            let key = (family, table);
            match (verb.as_str(), kind.as_str()) {
                ("delete", "table") => {
                    self.tables.remove(&key);
                    built.remove(&key);
                }
                ("add", _) => built
                    .entry(key)
                    .or_default()
                    .push(json!({ kind.clone(): object })),
                _ => {}
            }
        }
        for ((family, table), objects) in built {
            let listing = self
                .tables
                .entry((family.clone(), table.clone()))
                .or_insert_with(|| json!({"nftables": [{"metainfo": {}}]}));
            if let Some(list) = listing["nftables"].as_array_mut() {
                list.extend(objects);
            }
        }
        Ok(())
    }

    fn writes(&self) -> u64 {
        self.writes
    }
}
