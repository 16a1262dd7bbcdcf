//! nftables as the reconciler sees it, in memory.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::apply::{ApplyError, Nft};
use crate::model::Family;

/// nftables tables, as `nft -j list table` prints them. A batch replaces the tables it
/// names (weft's batches delete and recreate a table in one transaction).
#[derive(Debug, Default)]
pub struct FakeNft {
    /// By (family, table): the table's listing.
    pub tables: BTreeMap<(String, String), Value>,
    /// A table whose batches fail (as when the kernel refuses them).
    pub refuse: Option<String>,
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
        if let Some(refused) = &self.refuse {
            if batch.to_string().contains(&format!("\"{refused}\"")) {
                return Err(ApplyError::Io {
                    op: format!("{_what}: refused by the test"),
                    source: std::io::Error::from_raw_os_error(1),
                });
            }
        }
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
