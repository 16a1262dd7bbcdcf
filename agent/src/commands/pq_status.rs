//! `weft status`'s post-quantum lines: per pair, protected (and how old its secret is) or
//! classical (and why).

use std::time::{Duration, SystemTime};

use crate::observe::snapshot::PqPairInfo;

/// A line per pair; nothing without `PostQuantum`.
pub fn lines(pairs: &[PqPairInfo], now: SystemTime) -> String {
    let mut out = String::new();
    if !pairs.is_empty() {
        out += "\npost-quantum (each pair's PSK from ML-KEM-768):\n";
    }
    for p in pairs {
        let what = match p.round_ms {
            Some(ms) => {
                let at = SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
                let age = now.duration_since(at).unwrap_or_default().as_secs();
                format!("protected, secret {age} s old ({} rounds)", p.rounds)
            }
            None => format!(
                "classical: {}",
                p.classical_because
                    .as_deref()
                    .unwrap_or("no round completed yet")
            ),
        };
        out += &format!("  {}: {what}\n", p.node);
        if let Some(why) = &p.last_refusal {
            out += &format!("    last refused: {why}\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protected_and_classical_pairs_say_what_they_are() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let pairs = [
            PqPairInfo {
                node: "node-b".into(),
                round_ms: Some(963_000),
                rounds: 3,
                classical_because: None,
                last_refusal: None,
            },
            PqPairInfo {
                node: "node-c".into(),
                round_ms: None,
                rounds: 0,
                classical_because: Some("it publishes no ML-KEM key".into()),
                last_refusal: Some("its authentication tag is wrong".into()),
            },
        ];
        let text = lines(&pairs, now);
        assert!(
            text.contains("node-b: protected, secret 37 s old (3 rounds)"),
            "{text}"
        );
        assert!(
            text.contains("node-c: classical: it publishes no ML-KEM key"),
            "{text}"
        );
        assert!(
            text.contains("last refused: its authentication tag is wrong"),
            "{text}"
        );
        assert_eq!(lines(&[], now), "");
    }
}
