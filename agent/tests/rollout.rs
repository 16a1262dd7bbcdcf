//! A running cluster changes backend node by node, as a DaemonSet's rolling update does
//! (`Lab::roll_out`: the config changed, then each agent restarted in turn), with every
//! ordered pair of pods pinging at 10 pps throughout: no pair is down (longest gap and
//! loss within the README's bounds), a pair is in clear only while one of its ends
//! publishes no encrypting backend (the capture names each clear echo's pair), and the old
//! backend's devices are gone at the end. Both directions between vxlan and wireguard and
//! between host-gw and wireguard, a rollout stalled halfway for a minute, and a cluster
//! whose config refuses clear pairs.

use std::time::Duration;

use serde_json::json;
use weft_lab::lab::rollout::{Rollout, RolloutReport};
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::wait::bound;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// The README's bounds for a rollout: no pair silent longer than this, nor losing more
/// than this share of its pings. Under the VM's emulated CPU a restarting node's first
/// pass (its pod network sealed until then) takes 1-2.5 s: 2.0 s and 10.3 %, then 2.4 s
/// and 12.3 % were measured there (3 nodes, 5 s apart).
fn bounds() -> (Duration, f64) {
    bound(
        (Duration::from_secs(1), 0.02),
        (Duration::from_secs(4), 0.2),
    )
}

/// How long a node takes to read a peer's change and move their pair (the registry's
/// event, a pass): a clear echo of a pair whose ends both published an encrypting backend
/// for longer is a breach. Under the VM's emulated CPU a pass takes seconds: 4.1 s was
/// measured there once.
fn reaction() -> Duration {
    bound(Duration::from_millis(500), Duration::from_secs(6))
}

fn rollout(backend: serde_json::Value) -> Rollout {
    Rollout {
        backend,
        pace: Duration::from_secs(5),
        stall: None,
    }
}

/// The bounds every rollout meets, and fail closed.
fn check(what: &str, report: &RolloutReport) {
    println!("{what}: {report}");
    let unix = |t: &std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64()
    };
    let restarts: Vec<String> = report
        .restarts
        .iter()
        .map(|t| format!("{:.1}", unix(t)))
        .collect();
    println!("  restarts at {restarts:?}");
    for p in &report.pairs {
        let lost: Vec<String> = p.lost_at.iter().map(|t| format!("{t:.1}")).collect();
        println!(
            "  {} -> {}: {} of {} answered, longest gap {} ms, lost at {lost:?}",
            p.from,
            p.to,
            p.received,
            p.sent,
            p.longest_gap.as_millis()
        );
    }
    for ((from, to), (first, last)) in report.clear_pairs() {
        let span = last.duration_since(first).unwrap_or_default();
        println!("  in clear: {from} -> {to} for {:.1} s", span.as_secs_f64());
    }
    let (late, pair) = report.clear_lateness(reaction());
    assert!(
        late <= reaction(),
        "{what}: pair {pair:?} was in clear {} ms after both its ends published an encrypting backend",
        late.as_millis()
    );
    let (gap, loss) = bounds();
    assert!(
        report.longest_gap() <= gap,
        "{what}: a pair was silent {} ms",
        report.longest_gap().as_millis()
    );
    assert!(
        report.worst_loss() <= loss,
        "{what}: a pair lost {:.1} %",
        report.worst_loss() * 100.0
    );
}

#[test]
fn vxlan_and_wireguard_both_ways_with_a_stall_halfway_and_no_pair_down() {
    let mut lab = Lab::start(LabConfig::backend(4, WEFT, "vxlan", false)).unwrap();
    // Onto wireguard, stopped after two nodes for a minute: the cluster works meanwhile.
    let mut onto = rollout(json!({"Type": "wireguard"}));
    onto.stall = Some((2, Duration::from_secs(60)));
    let report = lab.roll_out(&onto, &["flannel.1"]).unwrap();
    check("vxlan -> wireguard, stalled for a minute", &report);
    // Every pair's both ends published WireGuard by the end: the last echoes are sealed.
    assert!(
        !report.clear_pairs().is_empty(),
        "pairs with an unmoved end were in clear"
    );
    // And back: encrypted until a pair's end stops publishing its key.
    let report = lab
        .roll_out(&rollout(json!({"Type": "vxlan"})), &["flannel-wg"])
        .unwrap();
    check("wireguard -> vxlan", &report);
}

#[test]
fn host_gw_and_wireguard_both_ways_with_no_pair_down() {
    let mut lab = Lab::start(LabConfig::backend(4, WEFT, "host-gw", false)).unwrap();
    let report = lab
        .roll_out(&rollout(json!({"Type": "wireguard"})), &[])
        .unwrap();
    check("host-gw -> wireguard", &report);
    let report = lab
        .roll_out(&rollout(json!({"Type": "host-gw"})), &["flannel-wg"])
        .unwrap();
    check("wireguard -> host-gw", &report);
}

/// Kernel ESP (ipsec) and kernel WireGuard, in the VM runner (`kernel_vm`): vxlan onto
/// wireguard within the rollout bounds, then wireguard onto ipsec, where no pair may be in
/// clear at any moment.
#[test]
#[ignore = "needs kernel ESP: run by kernel_vm"]
fn vxlan_to_wireguard_to_ipsec_never_in_clear_between_the_two() {
    let mut lab = Lab::start(LabConfig::backend(3, WEFT, "vxlan", false)).unwrap();
    let report = lab
        .roll_out(&rollout(json!({"Type": "wireguard"})), &["flannel.1"])
        .unwrap();
    check("vxlan -> wireguard", &report);
    // Onto ipsec: never in clear, and every pair back on ESP at the end. Not yet within
    // the rollout bounds: a pair's ESP states are made only when the pair moves (when its
    // second end retires WireGuard), and the VM took up to 7.7 s to carry it again; the
    // gap is printed and held under 15 s here.
    let report = lab
        .roll_out(&rollout(json!({"Type": "ipsec"})), &["flannel-wg"])
        .unwrap();
    println!("wireguard -> ipsec: {report}");
    assert!(
        report.clear.is_empty(),
        "wireguard -> ipsec: echoes in clear: {:?}",
        report.clear_pairs()
    );
    assert!(
        report.longest_gap() <= Duration::from_secs(15),
        "wireguard -> ipsec: a pair was silent {} ms",
        report.longest_gap().as_millis()
    );
}
