//! Releasing attachments that nothing holds any more, so their pod addresses come back:
//! - GC (CNI 1.1): every attachment of the network that is not in the runtime's
//!   `cni.dev/valid-attachments`. A delegate that speaks 1.1.0 gets the GC itself (it and
//!   its IPAM release what they hold); an older one gets a DEL per attachment, without a
//!   network namespace, which releases its IPAM reservation the same way.
//! - Earlier boots: an attachment recorded in another boot than this one belongs to a
//!   container that is gone with that boot. They are released before each ADD and GC, so
//!   a node whose runtime never sent DEL (a crash, an unclean reboot) does not run out of
//!   addresses.

use std::path::Path;

use serde_json::{json, Value};

use super::attachments::{self, Saved};
use super::conf::{delegate_conf, PluginConf, SubnetEnv};
use super::{delegate, valid_container_id, version, CniError};

/// The key of the runtime's list in GC's config.
pub const VALID_ATTACHMENTS: &str = "cni.dev/valid-attachments";

/// The longest list taken (a node holds at most a few hundred pods).
const MAX_VALID: usize = 100_000;

/// One attachment the runtime still holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Valid {
    pub container_id: String,
    pub ifname: String,
}

/// The runtime's list, every entry checked: a bad entry is an error naming it, and then
/// nothing is released.
pub fn valid_attachments(doc: &Value) -> Result<Vec<Valid>, CniError> {
    let Some(list) = doc.get(VALID_ATTACHMENTS) else {
        return Err(CniError::config(format!(
            "GC needs `{VALID_ATTACHMENTS}` (the attachments still in use); nothing was released"
        )));
    };
    let Some(list) = list.as_array() else {
        return Err(CniError::config(format!(
            "`{VALID_ATTACHMENTS}` must be a list, not {}; nothing was released",
            weft_backends::model::clip(&list.to_string())
        )));
    };
    if list.len() > MAX_VALID {
        return Err(CniError::config(format!(
            "`{VALID_ATTACHMENTS}` has {} entries, more than {MAX_VALID}; nothing was released",
            list.len()
        )));
    }
    list.iter()
        .enumerate()
        .map(|(i, entry)| {
            let field = |k: &str| entry.get(k).and_then(Value::as_str);
            match (field("containerID"), field("ifname")) {
                (Some(id), Some(ifname)) if valid_container_id(id) && !ifname.is_empty() => {
                    Ok(Valid {
                        container_id: id.to_string(),
                        ifname: ifname.to_string(),
                    })
                }
                _ => Err(CniError::config(format!(
                    "`{VALID_ATTACHMENTS}[{i}]` must be {{\"containerID\": <a container ID>, \
                     \"ifname\": <an interface>}}, not {}; nothing was released",
                    weft_backends::model::clip(&entry.to_string())
                ))),
            }
        })
        .collect()
}

/// Whether the runtime still holds `saved`. Without a record its interface is unknown,
/// and its container ID alone keeps it.
fn held(saved: &Saved, valid: &[Valid]) -> bool {
    valid.iter().any(|v| {
        v.container_id == saved.container_id
            && saved.record.as_ref().is_none_or(|r| r.ifname == v.ifname)
    })
}

/// The interface DEL names for an attachment saved without a record: the one every
/// Kubernetes pod has.
const DEFAULT_IFNAME: &str = "eth0";

/// Releases one attachment: the delegate's DEL without a namespace, then its saved state.
/// On failure the state stays, to be released next time.
pub fn release(data_dir: &Path, saved: &Saved, cni_path: &str) -> Result<(), CniError> {
    let ifname = saved
        .record
        .as_ref()
        .map_or(DEFAULT_IFNAME, |r| r.ifname.as_str());
    delegate::release(&saved.delegate, cni_path, &saved.container_id, ifname).map_err(|e| {
        CniError {
            msg: format!("releasing attachment {}: {}", saved.container_id, e.msg),
            ..e
        }
    })?;
    attachments::remove(data_dir, &saved.container_id)
}

/// What a release pass did.
#[derive(Debug, Default)]
pub struct Released {
    pub ids: Vec<String>,
    pub failed: Vec<CniError>,
}

/// Applies `act` to every attachment of `network` that `stale` picks, under the data
/// directory's lock; one failure does not stop the others.
fn for_each_stale(
    data_dir: &Path,
    network: &str,
    stale: impl Fn(&Saved) -> bool,
    act: impl Fn(&Saved) -> Result<(), CniError>,
) -> Result<Released, CniError> {
    let _lock = attachments::lock(data_dir)?;
    let (saved, _) = attachments::list(data_dir);
    let mut done = Released::default();
    for s in saved.iter().filter(|s| s.network() == network && stale(s)) {
        match act(s) {
            Ok(()) => done.ids.push(s.container_id.clone()),
            Err(e) => done.failed.push(e),
        }
    }
    Ok(done)
}

/// Releases every attachment of `network` that `stale` picks.
fn release_where(
    data_dir: &Path,
    network: &str,
    cni_path: &str,
    stale: impl Fn(&Saved) -> bool,
) -> Result<Released, CniError> {
    for_each_stale(data_dir, network, stale, |s| release(data_dir, s, cni_path))
}

/// Releases the network's attachments from earlier boots.
pub fn release_earlier_boots(conf: &PluginConf, cni_path: &str) -> Result<Released, CniError> {
    let boot = attachments::boot_id();
    release_where(&conf.data_dir, &conf.name, cni_path, |s| {
        s.from_earlier_boot(&boot)
    })
}

/// GC: releases every attachment of the network the runtime no longer holds.
pub fn gc(conf: &PluginConf, doc: &Value, cni_path: &str) -> Result<Released, CniError> {
    let valid = valid_attachments(doc)?;
    let boot = attachments::boot_id();
    let stale = |s: &Saved| !held(s, &valid) || s.from_earlier_boot(&boot);
    if let Some(d) = gc_delegate(conf, cni_path)? {
        // The delegate releases its own; what is left of ours is forgotten.
        let mut call = d;
        call[VALID_ATTACHMENTS] = json!(valid
            .iter()
            .map(|v| json!({"containerID": v.container_id, "ifname": v.ifname}))
            .collect::<Vec<_>>());
        delegate::run("GC", &call, cni_path)?;
        return for_each_stale(&conf.data_dir, &conf.name, stale, |s| {
            attachments::remove(&conf.data_dir, &s.container_id)
        });
    }
    release_where(&conf.data_dir, &conf.name, cni_path, stale)
}

/// The delegate config to send GC to, when the delegate and its IPAM speak 1.1.0; `None`
/// when either does not, or when there is no subnet.env to build it from (then each
/// attachment gets a DEL with the config it was added with).
fn gc_delegate(conf: &PluginConf, cni_path: &str) -> Result<Option<Value>, CniError> {
    let Ok(env) = SubnetEnv::load(&conf.subnet_file) else {
        return Ok(None);
    };
    let mut d = delegate_conf(conf, &env)?;
    let plugins = super::delegate_plugins(&d, cni_path)?;
    let mut lists = Vec::new();
    for plugin in &plugins {
        lists.push(version::plugin_versions(plugin, &conf.data_dir)?);
    }
    if version::negotiate(version::CURRENT, &lists).as_deref() != Some(version::STATUS_AND_GC) {
        return Ok(None);
    }
    d["cniVersion"] = json!(version::STATUS_AND_GC);
    Ok(Some(d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::attachments::Record;

    #[test]
    fn a_bad_entry_in_the_list_is_named_and_nothing_is_released() {
        let ok = json!({VALID_ATTACHMENTS: [{"containerID": "c1", "ifname": "eth0"}]});
        assert_eq!(
            valid_attachments(&ok).unwrap(),
            [Valid {
                container_id: "c1".into(),
                ifname: "eth0".into()
            }]
        );
        for (doc, says) in [
            (json!({}), "GC needs"),
            (json!({VALID_ATTACHMENTS: "c1"}), "must be a list"),
            (
                json!({VALID_ATTACHMENTS: [{"containerID": "c1", "ifname": "eth0"}, {"containerID": "../x", "ifname": "eth0"}]}),
                "[1]",
            ),
            (json!({VALID_ATTACHMENTS: [{"containerID": "c1"}]}), "[0]"),
        ] {
            let e = valid_attachments(&doc).unwrap_err();
            assert_eq!(e.code, 7);
            assert!(
                e.msg.contains(says) && e.msg.contains("nothing was released"),
                "{}",
                e.msg
            );
        }
    }

    #[test]
    fn an_attachment_is_held_by_its_container_and_interface() {
        let valid = [Valid {
            container_id: "c1".into(),
            ifname: "eth0".into(),
        }];
        let saved = |id: &str, ifname: Option<&str>| Saved {
            container_id: id.into(),
            delegate: json!({}),
            record: ifname.map(|i| Record {
                ifname: i.into(),
                netns: String::new(),
                boot: "b".into(),
            }),
        };
        assert!(held(&saved("c1", Some("eth0")), &valid));
        assert!(!held(&saved("c1", Some("net1")), &valid));
        assert!(!held(&saved("c2", Some("eth0")), &valid));
        // Interface unknown: the container ID is enough.
        assert!(held(&saved("c1", None), &valid));
    }

    /// A delegate that speaks 1.1.0 (containernetworking-plugins 1.5 on; Debian's are
    /// older, so a script stands in): it gets one GC with the runtime's list, and
    /// weft-cni forgets the attachments outside it.
    #[test]
    fn a_delegate_that_speaks_1_1_gets_the_gc_itself() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let calls = dir.path().join("calls");
        let plugin = bin.join("bridge");
        std::fs::write(
            &plugin,
            format!(
                "#!/bin/sh\nif [ \"$CNI_COMMAND\" = VERSION ]; then echo '{{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[\"1.0.0\",\"1.1.0\"]}}'; exit 0; fi\n{{ echo \"$CNI_COMMAND\"; cat; echo; }} >> {}\n",
                calls.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let env = dir.path().join("subnet.env");
        std::fs::write(&env, "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.3.1/24\nFLANNEL_MTU=1420\nFLANNEL_IPMASQ=true\n").unwrap();
        let data = dir.path().join("data");
        let stdin = json!({"cniVersion": "1.1.0", "name": "cbr0", "type": "flannel",
            "subnetFile": env, "dataDir": data,
            VALID_ATTACHMENTS: [{"containerID": "c1", "ifname": "eth0"}]});
        let conf = PluginConf::parse(stdin.to_string().as_bytes()).unwrap();
        let record = Record {
            ifname: "eth0".into(),
            netns: String::new(),
            boot: attachments::boot_id(),
        };
        for id in ["c1", "c2"] {
            attachments::save(
                &data,
                id,
                &json!({"name": "cbr0", "type": "bridge"}),
                &record,
            )
            .unwrap();
        }
        let done = gc(&conf, &stdin, &bin.display().to_string()).unwrap();
        assert_eq!(done.ids, ["c2"]);
        assert!(done.failed.is_empty());
        assert!(data.join("c1").exists() && !data.join("c2").exists());
        let log = std::fs::read_to_string(&calls).unwrap();
        let mut lines = log.lines();
        assert_eq!(lines.next(), Some("GC"), "{log}");
        let sent: Value = serde_json::from_str(lines.next().unwrap()).unwrap();
        assert_eq!(sent["cniVersion"], json!("1.1.0"));
        assert_eq!(
            sent[VALID_ATTACHMENTS],
            json!([{"containerID": "c1", "ifname": "eth0"}])
        );
        assert_eq!(
            sent["ipam"]["ranges"],
            json!([[{"subnet": "10.244.3.0/24"}]])
        );
        assert!(!log.contains("DEL"), "{log}");
    }
}
