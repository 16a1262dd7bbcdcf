//! Every XFRM state installed on the lab's nodes, as `ip xfrm monitor` saw it (key material
//! included): started before the agents (`LabConfig::xfrm_record`), so it holds the whole
//! scenario. Proves that no (key, SPI, destination) was installed twice.

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::Context;

/// One state as installed: on which node, its destination, SPI and key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Installed {
    pub node: usize,
    pub dst: String,
    pub spi: String,
    pub key: String,
}

pub struct XfrmRecord {
    monitors: Vec<(usize, Child, PathBuf)>,
}

impl XfrmRecord {
    /// Starts `ip xfrm monitor` in each of `namespaces` (node index, namespace).
    pub fn start(dir: &std::path::Path, namespaces: &[(usize, String)]) -> anyhow::Result<Self> {
        let mut monitors = Vec::new();
        for (i, ns) in namespaces {
            let file = dir.join(format!("xfrm-monitor-{i}.log"));
            // SA events only: the replay-counter events of every state under traffic
            // (all of `ip xfrm monitor`'s default) overflow its socket on a slow machine,
            // and the kernel then drops state additions with them. Line-buffered, so the
            // record is complete when read.
            let child = Command::new("ip")
                .args([
                    "netns", "exec", ns, "stdbuf", "-oL", "ip", "xfrm", "monitor", "SA",
                ])
                .stdout(fs::File::create(&file)?)
                .stderr(Stdio::null())
                .spawn()
                .context("starting ip xfrm monitor")?;
            monitors.push((*i, child, file));
        }
        Ok(XfrmRecord { monitors })
    }

    /// Every state added so far, in order, on every node.
    pub fn installed(&self) -> Vec<Installed> {
        let mut out = Vec::new();
        for (node, _, file) in &self.monitors {
            let text = fs::read_to_string(file).unwrap_or_default();
            out.extend(parse(*node, &text));
        }
        out
    }
}

impl Drop for XfrmRecord {
    fn drop(&mut self) {
        for (_, child, _) in &mut self.monitors {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The added states in `ip xfrm monitor`'s text: a block starts `src A dst B` (deleted and
/// expired ones start with a word before it), then `proto esp spi 0x…`, then
/// `aead NAME 0xKEY ICV`.
fn parse(node: usize, text: &str) -> Vec<Installed> {
    let mut out = Vec::new();
    let mut current: Option<(String, Option<String>)> = None;
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if line.starts_with("src ") {
            current = words
                .iter()
                .position(|w| *w == "dst")
                .and_then(|i| words.get(i + 1))
                .map(|dst| (dst.to_string(), None));
        } else if !line.starts_with([' ', '\t']) {
            current = None;
        } else if let Some((dst, spi)) = current.as_mut() {
            if words.first() == Some(&"proto") {
                *spi = words
                    .iter()
                    .position(|w| *w == "spi")
                    .and_then(|i| words.get(i + 1))
                    .map(|s| s.to_string());
            } else if words.first() == Some(&"aead") {
                if let (Some(spi), Some(key)) = (spi.clone(), words.get(2)) {
                    out.push(Installed {
                        node,
                        dst: dst.clone(),
                        spi,
                        key: key.to_string(),
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn added_states_are_read_and_deleted_ones_are_not() {
        let text = "src 198.51.100.1 dst 198.51.100.2\n\tproto esp spi 0x80000107 reqid 0 mode tunnel\n\treplay-window 0 flag esn\n\taead rfc4106(gcm(aes)) 0xaabb 128\nDeleted src 198.51.100.1 dst 198.51.100.2\n\tproto esp spi 0x80000107 reqid 0 mode tunnel\n\taead rfc4106(gcm(aes)) 0xaabb 128\nsrc 0.0.0.0/0 dst 10.244.2.0/24\n\tdir out priority 0\n";
        let got = super::parse(1, text);
        assert_eq!(got.len(), 1);
        assert_eq!(
            (
                got[0].dst.as_str(),
                got[0].spi.as_str(),
                got[0].key.as_str()
            ),
            ("198.51.100.2", "0x80000107", "0xaabb")
        );
    }
}
