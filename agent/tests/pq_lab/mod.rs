//! What the post-quantum lab tests read: each pair's PSKs on the devices, the agents'
//! lines on rounds, `weft status`, and (ipsec) each node's outbound ESP states.

use std::collections::BTreeMap;
use std::time::Duration;

use weft_lab::lab::{Lab, LabConfig};
use weft_lab::wait::until_or;

pub const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// A lab of `nodes` with `PostQuantum`, its rounds every `period` (the agent's 2 minutes
/// when `None`).
pub fn config(nodes: usize, period: Option<Duration>) -> LabConfig {
    let mut cfg =
        LabConfig::wireguard(nodes, WEFT).backend_key("PostQuantum", serde_json::Value::Bool(true));
    // The tests watch the first rounds themselves (time to protection, hostile keys).
    cfg.settle = false;
    if let Some(p) = period {
        cfg.extra_args
            .push(format!("--post-quantum-period={}", p.as_secs()));
    }
    cfg
}

/// Each node's PSK by peer key, as its device shows it.
pub fn psks(lab: &Lab) -> Vec<BTreeMap<String, String>> {
    (0..lab.nodes.len())
        .map(|i| {
            lab.on_node(i, "wg show flannel-wg preshared-keys")
                .unwrap_or_default()
                .lines()
                .filter_map(|l| {
                    let mut cols = l.split_whitespace();
                    Some((cols.next()?.to_string(), cols.next()?.to_string()))
                })
                .collect()
        })
        .collect()
}

/// The pairs among `nodes`: each with one PSK on both its devices, no two the same; each
/// pair's PSK, or what differs.
pub fn agreed(lab: &Lab, nodes: &[usize]) -> Result<BTreeMap<(usize, usize), String>, String> {
    let mut out = BTreeMap::new();
    for (pair, psk) in each_pair(lab, nodes) {
        let psk = psk?;
        if out.values().any(|p| *p == psk) {
            return Err(format!("pair {pair:?} has another pair's PSK"));
        }
        out.insert(pair, psk);
    }
    Ok(out)
}

/// Each pair among `nodes` from one read of every device: its PSK if both its devices hold
/// the same post-quantum one, or what each holds.
pub fn each_pair(lab: &Lab, nodes: &[usize]) -> BTreeMap<(usize, usize), Result<String, String>> {
    let psks = psks(lab);
    let keys: BTreeMap<usize, String> = (nodes.iter())
        .map(|&i| (i, lab.wg_public_key(i).unwrap_or_default()))
        .collect();
    let mut out = BTreeMap::new();
    for (x, &i) in nodes.iter().enumerate() {
        for &j in &nodes[x + 1..] {
            let (a, b) = (psks[i].get(&keys[&j]), psks[j].get(&keys[&i]));
            let psk = match (a, b) {
                (Some(a), Some(b)) if a == b && a != "(none)" => Ok(a.clone()),
                _ => Err(format!("pair {i}-{j}: {a:?} on {i}, {b:?} on {j}")),
            };
            out.insert((i, j), psk);
        }
    }
    out
}

/// The agents' lines on rounds, PSKs and warnings (for a failure's message).
pub fn pq_lines(lab: &Lab) -> String {
    lab.logs()
        .lines()
        .filter(|l| {
            ["--- node", "post-quantum", "psk", "WARN"]
                .iter()
                .any(|m| l.contains(m))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

pub fn status(lab: &Lab, i: usize) -> String {
    lab.on_node(i, &format!("{WEFT} status"))
        .unwrap_or_default()
}

/// `weft status` follows at the pass the last round wakes: on each node of a 3-node lab,
/// both pairs protected.
pub fn status_follows(lab: &Lab) {
    for i in 0..lab.nodes.len() {
        until_or(
            "weft status: both of the node's pairs protected",
            Duration::from_secs(5),
            || status(lab, i).matches(": protected, secret").count() == 2,
            || status(lab, i),
        );
    }
}

/// Node `i`'s outbound ESP states, by destination: (SPI, key), from `ip xfrm state`. A
/// destination with two (the state left, in its grace after a switch) is left out.
pub fn esp_out(lab: &Lab, i: usize) -> BTreeMap<String, (u32, String)> {
    let text = weft_lab::lab::in_ns(&lab.nodes[i].ns, "ip xfrm state").unwrap_or_default();
    let own = lab.nodes[i].ip.to_string();
    let mut out: BTreeMap<String, Vec<(u32, String)>> = BTreeMap::new();
    let (mut dst, mut spi) = (None, None);
    for line in text.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["src", src, "dst", d, ..] => {
                dst = (*src == own).then(|| d.to_string());
                spi = None;
            }
            ["proto", "esp", "spi", hex, ..] => {
                spi = u32::from_str_radix(hex.trim_start_matches("0x"), 16).ok();
            }
            ["aead", _, key, ..] => {
                if let (Some(d), Some(s)) = (dst.take(), spi) {
                    out.entry(d).or_default().push((s, key.to_string()));
                }
            }
            _ => {}
        }
    }
    out.into_iter()
        .filter_map(|(d, mut states)| (states.len() == 1).then(|| (d, states.remove(0))))
        .collect()
}

/// Node `i`'s ESP epoch number, as it keeps it.
pub fn esp_epoch(lab: &Lab, i: usize) -> u64 {
    std::fs::read_to_string(lab.nodes[i].dir.join("lib/ipsec-epoch"))
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The post-quantum slot an outbound SPI from node `i` to node `j` names: its generation
/// byte less `i`'s epoch and twice `j`'s, over 4 (0: classical).
pub fn slot(lab: &Lab, i: usize, j: usize, spi: u32) -> u64 {
    let base = esp_epoch(lab, i) + 2 * esp_epoch(lab, j);
    (u64::from(spi & 0xff).wrapping_sub(base) & 0xff) / 4
}

/// Each pair's PSKs that both of its nodes were seen holding, in the order the first node
/// held them, from each node's PSKs by peer (`(node, peer)`).
pub fn held_by_both(
    held: &BTreeMap<(usize, usize), Vec<String>>,
) -> BTreeMap<(usize, usize), Vec<String>> {
    let mut out = BTreeMap::new();
    for (&(i, j), psks) in held.iter().filter(|((i, j), _)| i < j) {
        let other = held.get(&(j, i)).map(Vec::as_slice).unwrap_or_default();
        let both: Vec<String> = psks.iter().filter(|p| other.contains(p)).cloned().collect();
        if !both.is_empty() {
            out.insert((i, j), both);
        }
    }
    out
}

/// The lines of every agent's log about post-quantum rounds, ipsec and ESP, warnings and
/// peers added or removed, under each node's heading.
pub fn pq_logs(lab: &Lab) -> String {
    lab.logs()
        .lines()
        .filter(|l| {
            l.contains("--- node")
                || l.contains("post-quantum")
                || l.contains("ipsec")
                || l.contains("ESP")
                || l.contains("WARN")
                || l.contains("added")
                || l.contains("removed")
        })
        .collect::<Vec<_>>()
        .join("\n")
}
