//! TCP transfers between pods over the WireGuard mesh at the sizes where segmentation and
//! coalescing have edges (one byte; a pod MSS less one, exactly, and plus one; an MTU's
//! worth; 64 KiB around its edge; several MiB that go through TSO, UDP GSO/GRO and
//! coalescing), both ways, each arriving with the SHA-256 it was sent with. On a host
//! without kernel WireGuard this is the userspace device's packet loop.

use std::time::Duration;

use weft_lab::lab::{Lab, LabConfig};
use weft_lab::live_demo::transfer;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// The pod MTU over WireGuard (1420) less the IPv4 and TCP headers with timestamps.
const MSS: u64 = 1420 - 20 - 32;

#[test]
fn transfers_at_mtu_edges_arrive_intact_both_ways() {
    let lab = Lab::start(LabConfig::wireguard(2, WEFT)).unwrap();
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    assert!(
        lab.ping(&a.ns, b.ip, Duration::from_secs(10)),
        "{}",
        lab.logs()
    );
    let sizes = [
        1,
        MSS - 1,
        MSS,
        MSS + 1,
        1420,
        2 * MSS + 1,
        65_535,
        65_536,
        65_537,
        (8 << 20) + 7,
    ];
    for (from, to) in [(a, b), (b, a)] {
        for bytes in sizes {
            let (_, intact) = transfer(&from.ns, &to.ns, to.ip, bytes).unwrap();
            assert!(
                intact,
                "{bytes} bytes {} -> {} arrived with a different SHA-256",
                from.ip, to.ip
            );
        }
    }
}
