//! One node's wall clock jumping an hour ahead, then an hour behind, while its agent runs
//! (an LD_PRELOAD library moves the agent's CLOCK_REALTIME; its monotonic clock and the
//! other nodes' clocks stay true). Key rotations by that node and by the others switch
//! with no more loss than with true clocks (no premature switch), and the node's etcd
//! lease keeps being renewed.

use std::time::{Duration, Instant};

use weft_lab::clock::ClockOffset;
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::traffic::{Disruption, Probe};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// Rotates node `rotating`'s key with pod traffic from node 1 to node `to`.
fn rotate(lab: &Lab, rotating: usize, to: usize) -> Disruption {
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[to].pods[0]);
    let probe = Probe::start(&a.ns, &b.ns, b.ip).unwrap();
    let out = lab
        .on_node(rotating, &format!("{WEFT} keys rotate"))
        .unwrap();
    assert!(out.contains("switched to"), "{out}");
    // Ends once the measured pair answers again after the switch.
    assert!(
        lab.ping(&a.ns, b.ip, Duration::from_secs(5)),
        "{}",
        lab.logs()
    );
    probe.finish().unwrap()
}

fn assert_no_premature_switch(lab: &Lab, what: &str, d: &Disruption) {
    eprintln!("{what}: {d}");
    // As the rotation lab tests bound it with true clocks; a premature switch loses the
    // announcement's whole lead (3 s, 300 pings).
    assert!(
        d.stream_error.is_none() && d.pings_lost <= 15 && d.max_stall < Duration::from_millis(300),
        "{what}: {d}\n{}",
        lab.logs()
    );
}

/// Seconds left on node 1's etcd lease.
fn lease_remaining(lab: &Lab) -> u64 {
    let key = lab.lease_key(0).unwrap();
    let json = lab.etcd().etcdctl(&["get", &key, "-w", "json"]).unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let id = v["kvs"][0]["lease"].as_i64().unwrap();
    let out = lab
        .etcd()
        .etcdctl(&["lease", "timetolive", &format!("{id:x}")])
        .unwrap();
    out.split("remaining(")
        .nth(1)
        .and_then(|r| r.split('s').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{out}"))
}

#[test]
fn a_node_whose_clock_jumps_an_hour_either_way_switches_keys_on_time_and_renews() {
    let scratch = tempfile::tempdir().unwrap();
    let clock = ClockOffset::build(scratch.path()).unwrap();
    let mut cfg = LabConfig::wireguard(3, WEFT);
    for (name, value) in clock.env() {
        cfg.agent_env.push((0, name, value));
    }
    // A lease renewed every minute (24 h lease, 1439 min margin), to see renewals here.
    cfg.extra_args
        .push("--subnet-lease-renew-margin=1439".into());
    let lab = Lab::start(cfg).unwrap();
    lab.assert_all_pairs();
    let started = Instant::now();

    for (offset, label) in [(3600, "an hour ahead"), (-3600, "an hour behind")] {
        clock.set(offset).unwrap();
        let d = rotate(&lab, 1, 1);
        assert_no_premature_switch(&lab, &format!("node 2 rotates, node 1 {label}"), &d);
        let d = rotate(&lab, 0, 2);
        assert_no_premature_switch(&lab, &format!("node 1 {label} rotates"), &d);
        lab.assert_all_pairs();
    }
    let log = std::fs::read_to_string(lab.nodes[0].agent_log()).unwrap();
    // The agent's own log shows its clock an hour ahead at some point.
    let times: Vec<_> = log.lines().filter_map(weft_lab::bench::log_time).collect();
    let first = times[0];
    assert!(
        times.iter().any(|t| t
            .duration_since(first)
            .is_ok_and(|d| d > Duration::from_secs(3000))),
        "the agent's clock did not move"
    );

    // The lease is renewed on the monotonic clock: within the minute, whatever the wall
    // clock says.
    let before = lease_remaining(&lab);
    weft_lab::wait::until_or(
        "node 1's lease renewed",
        (started + Duration::from_secs(75)).saturating_duration_since(Instant::now()),
        || lease_remaining(&lab) > before,
        || lab.logs(),
    );
    eprintln!("node 1's lease renewed with its clock an hour behind");
}
