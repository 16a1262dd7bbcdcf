//! Pod addresses held for containers that are gone, as `weft doctor` reports them and
//! `weft cleanup --leaked-addresses` frees them:
//! - an attachment recorded in an earlier boot;
//! - an attachment whose network namespace is gone (its path's directory is there, the
//!   path is not: where the directory itself is not visible, as in a container without
//!   `/run/netns`, nothing is concluded);
//! - a host-local reservation of a network weft-cni serves that no attachment of
//!   weft-cni holds.
//!
//! Freeing an attachment is the delegate's DEL without a namespace (as GC does); freeing a
//! lone reservation removes host-local's file for it, which is what host-local's own
//! release does.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::attachments::{self, Saved};
use super::CniError;

/// One leaked reservation or attachment.
#[derive(Debug, Clone, PartialEq)]
pub struct Leak {
    pub network: String,
    pub container_id: String,
    /// The addresses host-local holds for it.
    pub addresses: Vec<String>,
    pub why: &'static str,
    /// The reservation files to remove when no attachment of weft-cni holds it.
    lone_files: Vec<PathBuf>,
}

/// host-local's directory for `network`: the delegate's `ipam.dataDir`, else
/// `networks/` beside weft-cni's data directory (`/var/lib/cni/networks` for
/// `/var/lib/cni/flannel`).
fn host_local_dir(data_dir: &Path, delegate: Option<&Value>, network: &str) -> PathBuf {
    let base = delegate
        .and_then(|d| d.pointer("/ipam/dataDir"))
        .and_then(Value::as_str)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            data_dir
                .parent()
                .unwrap_or(Path::new("/var/lib/cni"))
                .join("networks")
        });
    base.join(network)
}

/// host-local's reservations in `dir`: container ID → (address, file).
fn reservations(dir: &Path) -> BTreeMap<String, Vec<(String, PathBuf)>> {
    let mut by_container: BTreeMap<String, Vec<(String, PathBuf)>> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return by_container;
    };
    for entry in entries.flatten() {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if name.parse::<std::net::IpAddr>().is_err() {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        let id = text.lines().next().unwrap_or_default().trim().to_string();
        by_container
            .entry(id)
            .or_default()
            .push((name, entry.path()));
    }
    by_container
}

/// Why `saved` is held for nothing, if it is.
fn gone(saved: &Saved, boot: &str) -> Option<&'static str> {
    if saved.from_earlier_boot(boot) {
        return Some("made in an earlier boot");
    }
    let netns = Path::new(&saved.record.as_ref()?.netns);
    let dir = netns.parent()?;
    (!netns.as_os_str().is_empty() && dir.is_dir() && !netns.exists())
        .then_some("its network namespace is gone")
}

/// Every leak under `data_dir`, and how many attachments it holds in all.
pub fn find(data_dir: &Path) -> (Vec<Leak>, usize) {
    let (saved, _) = attachments::list(data_dir);
    let boot = attachments::boot_id();
    let mut networks: BTreeMap<String, Option<&Value>> = BTreeMap::new();
    for s in &saved {
        networks
            .entry(s.network().to_string())
            .or_insert(Some(&s.delegate));
    }
    let mut leaks = Vec::new();
    for (network, delegate) in &networks {
        let held = reservations(&host_local_dir(data_dir, *delegate, network));
        let ours: BTreeSet<&str> = saved
            .iter()
            .filter(|s| s.network() == network)
            .map(|s| s.container_id.as_str())
            .collect();
        for s in saved.iter().filter(|s| s.network() == network) {
            if let Some(why) = gone(s, &boot) {
                leaks.push(Leak {
                    network: network.clone(),
                    container_id: s.container_id.clone(),
                    addresses: held
                        .get(&s.container_id)
                        .map(|r| r.iter().map(|(a, _)| a.clone()).collect())
                        .unwrap_or_default(),
                    why,
                    lone_files: Vec::new(),
                });
            }
        }
        for (id, files) in held.iter().filter(|(id, _)| !ours.contains(id.as_str())) {
            leaks.push(Leak {
                network: network.clone(),
                container_id: id.clone(),
                addresses: files.iter().map(|(a, _)| a.clone()).collect(),
                why: "no attachment of weft-cni holds it",
                lone_files: files.iter().map(|(_, f)| f.clone()).collect(),
            });
        }
    }
    (leaks, saved.len())
}

/// Frees every leak found now; the freed ones, and an error for each that could not be.
pub fn free(data_dir: &Path, cni_path: &str) -> (Vec<Leak>, Vec<CniError>) {
    let mut freed = Vec::new();
    let mut failed = Vec::new();
    let _lock = match attachments::lock(data_dir) {
        Ok(l) => l,
        Err(e) => return (freed, vec![e]),
    };
    let (leaks, _) = find(data_dir);
    let (saved, _) = attachments::list(data_dir);
    for leak in leaks {
        let result = if leak.lone_files.is_empty() {
            match saved.iter().find(|s| s.container_id == leak.container_id) {
                Some(s) => super::gc::release(data_dir, s, cni_path),
                None => Ok(()),
            }
        } else {
            leak.lone_files
                .iter()
                .try_for_each(|f| attachments::remove_file(f))
        };
        match result {
            Ok(()) => freed.push(leak),
            Err(e) => failed.push(e),
        }
    }
    (freed, failed)
}

impl std::fmt::Display for Leak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addresses = match self.addresses.is_empty() {
            true => "no address".to_string(),
            false => self.addresses.join(", "),
        };
        write!(
            f,
            "{} on {} ({addresses}): {}",
            self.container_id, self.network, self.why
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::attachments::Record;
    use serde_json::json;

    #[test]
    fn earlier_boots_gone_namespaces_and_lone_reservations_are_leaks() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("flannel");
        let netns = dir.path().join("netns");
        std::fs::create_dir_all(&netns).unwrap();
        std::fs::write(netns.join("live"), "").unwrap();
        let conf = json!({"name": "cbr0", "type": "bridge"});
        let save = |id: &str, ns: &str, boot: String| {
            let record = Record {
                ifname: "eth0".into(),
                netns: netns.join(ns).display().to_string(),
                boot,
            };
            attachments::save(&data, id, &conf, &record).unwrap();
        };
        let now = attachments::boot_id();
        save("live", "live", now.clone());
        save("vanished", "vanished", now.clone());
        save("rebooted", "live", "another-boot".into());
        let hl = dir.path().join("networks/cbr0");
        std::fs::create_dir_all(&hl).unwrap();
        for (ip, id) in [
            ("10.244.3.2", "live"),
            ("10.244.3.3", "vanished"),
            ("10.244.3.4", "rebooted"),
            ("10.244.3.5", "stray"),
        ] {
            std::fs::write(hl.join(ip), format!("{id}\r\neth0")).unwrap();
        }
        std::fs::write(hl.join("last_reserved_ip.0"), "10.244.3.5").unwrap();
        let (leaks, held) = find(&data);
        assert_eq!(held, 3);
        let text: Vec<String> = leaks.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "rebooted on cbr0 (10.244.3.4): made in an earlier boot",
                "vanished on cbr0 (10.244.3.3): its network namespace is gone",
                "stray on cbr0 (10.244.3.5): no attachment of weft-cni holds it",
            ]
        );
        // A namespace directory that is not visible here proves nothing.
        std::fs::remove_file(netns.join("live")).unwrap();
        std::fs::remove_dir(&netns).unwrap();
        let (leaks, _) = find(&data);
        assert_eq!(leaks.len(), 2, "{leaks:?}");
    }
}
