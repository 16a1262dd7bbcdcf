//! What a lab run must never write down: the nodes' private keys and the PSKs. A test
//! collects the secrets it made and checks every log the lab kept.

use std::fs;
use std::path::Path;

use super::Lab;

impl Lab {
    /// Every node's private key (base64) as its key file holds it now.
    pub fn private_keys(&self) -> Vec<String> {
        (0..self.nodes.len())
            .filter_map(|i| self.on_node(i, "cat /var/lib/weft/wireguard.key").ok())
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .collect()
    }

    /// Fails, naming the file and the line, if any of `secrets` appears in any log under
    /// the lab's directory (the agents with their device processes, tcpdump, etcd).
    pub fn assert_secrets_not_logged(&self, secrets: &[String]) {
        let mut logs = Vec::new();
        collect_logs(self.dir(), &mut logs);
        assert!(!logs.is_empty(), "no logs under {}", self.dir().display());
        for (file, text) in &logs {
            for secret in secrets.iter().filter(|s| !s.is_empty()) {
                if let Some(line) = text.lines().find(|l| l.contains(secret.as_str())) {
                    panic!("a secret was logged in {file}: {line}");
                }
            }
        }
    }
}

fn collect_logs(dir: &Path, out: &mut Vec<(String, String)>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect_logs(&path, out);
        } else if path.extension().is_some_and(|e| e == "log") {
            if let Ok(bytes) = fs::read(&path) {
                out.push((
                    path.display().to_string(),
                    String::from_utf8_lossy(&bytes).into_owned(),
                ));
            }
        }
    }
}
