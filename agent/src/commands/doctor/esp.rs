//! The ipsec check: every peer has both its ESP states in the kernel, traffic moves through
//! them (each peer is nudged with a datagram through the tunnel, which its kernel answers),
//! and the inbound states have dropped no replays and no packets failing the integrity check.

use std::collections::BTreeMap;
use std::time::Duration;

use weft_backends::apply::xfrm::EspPair;

use super::Check;
use crate::commands::status::esp_states;
use crate::observe::snapshot::Snapshot;

const NAME: &str = "esp states";

pub async fn esp(snapshot: &Snapshot) -> Check {
    let first = match esp_states(snapshot) {
        Ok(m) => m,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("reading XFRM: {e:#}"),
                "run as root on the node",
            )
        }
    };
    for p in snapshot.peers.iter().filter(|p| p.spi_in.is_some()) {
        super::probe::nudge(p);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    match esp_states(snapshot) {
        Ok(second) => verdict(&first, &second),
        Err(e) => Check::fail(
            NAME,
            format!("reading XFRM: {e:#}"),
            "run as root on the node",
        ),
    }
}

/// The verdict from two reads a second apart, around the nudge.
pub fn verdict(first: &BTreeMap<String, EspPair>, second: &BTreeMap<String, EspPair>) -> Check {
    if second.is_empty() {
        return Check::pass(NAME, "no ipsec peers");
    }
    let (mut missing, mut still, mut counted) = (Vec::new(), Vec::new(), Vec::new());
    for (node, now) in second {
        let (Some(inbound), Some(outbound)) = (&now.inbound, &now.outbound) else {
            let which = if now.inbound.is_none() {
                "inbound"
            } else {
                "outbound"
            };
            missing.push(format!("{node}: no {which} state"));
            continue;
        };
        let before = first.get(node);
        let moved = |now: u64, then: Option<u64>| then.is_some_and(|t| now > t);
        let sent = moved(
            outbound.bytes,
            before.and_then(|b| Some(b.outbound.as_ref()?.bytes)),
        );
        let got = moved(
            inbound.bytes,
            before.and_then(|b| Some(b.inbound.as_ref()?.bytes)),
        );
        if !sent || !got {
            still.push(format!(
                "{node}: {}",
                if sent {
                    "nothing received"
                } else {
                    "nothing sent"
                }
            ));
        }
        if inbound.replay_failed > 0 || inbound.integrity_failed > 0 {
            counted.push(format!(
                "{node}: {} replayed, {} failing the integrity check",
                inbound.replay_failed, inbound.integrity_failed
            ));
        }
    }
    if !missing.is_empty() {
        return Check::fail(
            NAME,
            missing.join("; "),
            "the agent restores them within 2 s under a new epoch: if they stay missing, look at its log (and at what else manages XFRM on this node)",
        );
    }
    if !still.is_empty() {
        return Check::fail(
            NAME,
            format!("no traffic through the states in 1 s: {}", still.join("; ")),
            "check that ESP (IP protocol 50, or UDP 4500 with UDPEncap) passes between the nodes, and that the peer runs ipsec with this node in its plan",
        );
    }
    if !counted.is_empty() {
        return Check::warn(
            NAME,
            counted.join("; "),
            "replays are dropped harmlessly but mean someone resends old packets; integrity failures mean packets were altered or keys disagree (look at both nodes' epochs in weft status)",
        );
    }
    Check::pass(
        NAME,
        format!("both states of the {} peers present and carrying traffic; no replays, no integrity failures", second.len()),
    )
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use weft_backends::apply::xfrm::{ObservedSa, SaSpec};

    use super::*;
    use crate::commands::doctor::Verdict;

    fn sa(bytes: u64, replay: u32) -> ObservedSa {
        ObservedSa {
            spec: SaSpec {
                src: Ipv4Addr::UNSPECIFIED,
                dst: Ipv4Addr::UNSPECIFIED,
                spi: 0x8000_0100,
                algorithm: String::new(),
                key: Default::default(),
                icv_bits: 128,
                udp_encap: false,
                if_id: 0,
                reqid: 1,
            },
            bytes,
            packets: 1,
            replay_failed: replay,
            integrity_failed: 0,
            replay_window: 1024,
            esn: true,
        }
    }

    fn pair(rx: u64, tx: u64, replay: u32) -> EspPair {
        EspPair {
            inbound: Some(sa(rx, replay)),
            outbound: Some(sa(tx, 0)),
        }
    }

    fn one(p: EspPair) -> BTreeMap<String, EspPair> {
        [("n2".to_string(), p)].into()
    }

    #[test]
    fn each_broken_part_gets_its_verdict() {
        let before = one(pair(100, 100, 0));
        let ok = verdict(&before, &one(pair(200, 200, 0)));
        assert_eq!(ok.verdict, Verdict::Pass, "{ok:?}");
        let gone = EspPair {
            inbound: None,
            ..pair(200, 200, 0)
        };
        let c = verdict(&before, &one(gone));
        assert_eq!(
            (c.verdict, c.detail.as_str()),
            (Verdict::Fail, "n2: no inbound state")
        );
        let c = verdict(&before, &one(pair(100, 200, 0)));
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(c.detail.ends_with("n2: nothing received"), "{}", c.detail);
        let c = verdict(&before, &one(pair(200, 200, 3)));
        assert_eq!(c.verdict, Verdict::Warn);
        assert_eq!(c.detail, "n2: 3 replayed, 0 failing the integrity check");
        assert_eq!(
            verdict(&BTreeMap::new(), &BTreeMap::new()).verdict,
            Verdict::Pass
        );
    }
}
