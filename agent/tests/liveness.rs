//! Every pair alive, or healed within seconds: on three nodes, a pod of node 0 pings a pod
//! of node 1 ten times a second while a fault is made on that pair only, and another pod
//! of node 0 pings node 2 beside it (`weft_lab::faults`). For each fault the agent names it
//! within 5 s (a dead pair with its cause, drift from the plan, a device at fault), pod
//! traffic is back within 10 s of the fault (of its end, for a firewall), and the pair to
//! node 2 loses nothing: a repair never disturbs another pair. A pair with no traffic is
//! never called dead nor repaired. Runs on the userspace device here and on kernel
//! WireGuard in the VM (`kernel_vm`); the device-process faults (stopped, a thread stalled,
//! sockets destroyed) are the userspace device's own. `scripts/bench liveness` measures the
//! same faults for BENCHMARKS.md.

use std::time::{Duration, SystemTime};

use weft_lab::faults::{endpoint_of, Fault, GROUPS};
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::netns::http_get;
use weft_lab::wait::{self, bound, until_or};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");
const PORT: u16 = 10267;

fn lab() -> Lab {
    let mut cfg = LabConfig::wireguard(3, WEFT);
    cfg.extra_args.push(format!("--healthz-port={PORT}"));
    // No periodic resync: these faults are the liveness watcher's to name and repair, and
    // a resync that comes right after one puts it back unnamed (a full pass takes 0.1–0.5
    // s in the VM, where one put the AllowedIPs fault back 1 s after it was made).
    cfg.extra_args.push("--resync-period=3600".into());
    Lab::start(cfg).unwrap()
}

/// The count of `/metrics`' series `weft_peer_repairs_total` with these labels on node `i`.
fn repairs(lab: &Lab, i: usize, cause: &str, step: &str) -> u64 {
    let node = &lab.nodes[i];
    let (code, body) = http_get(&node.ns, &format!("{}:{PORT}", node.ip), "/metrics");
    assert_eq!(code, 200, "{body}");
    let series = format!("weft_peer_repairs_total{{cause=\"{cause}\",step=\"{step}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
        .unwrap_or(0)
}

/// The targets: named within 5 s, traffic back within 10 s. Under the VM's emulation, 2×.
fn limits() -> (Duration, Duration) {
    bound(
        (Duration::from_secs(5), Duration::from_secs(10)),
        (Duration::from_secs(10), Duration::from_secs(20)),
    )
}

/// Waits until every pair is answered again and no pair is dead on any node.
fn settled(lab: &Lab) {
    lab.assert_all_pairs();
    until_or(
        "no pair dead on any node",
        Duration::from_secs(15),
        || (0..lab.nodes.len()).all(|i| !lab.status(i).contains("dead")),
        || lab.logs(),
    );
}

/// Makes each fault of `group` in turn on one lab, each measured against the targets, and
/// checks what each left behind.
fn run_group(group: &[Fault]) {
    let lab = lab();
    lab.assert_all_pairs();
    let kernel = lab.implementation(1) == Some("kernel");
    for fault in group {
        if kernel && fault.userspace_only() {
            println!(
                "{}: the userspace device's own, skipped on kernel WireGuard",
                fault.name()
            );
            continue;
        }
        let m = fault
            .measure(&lab, limits())
            .unwrap_or_else(|e| panic!("{e:#}\n{}", lab.logs()));
        println!("{m}");
        assert_eq!(
            m.other_lost,
            0,
            "a repair disturbed the other pair\n{}",
            lab.logs()
        );
        after(&lab, *fault);
        settled(&lab);
    }
}

/// What must hold once a fault is repaired.
fn after(lab: &Lab, fault: Fault) {
    let log = |i: usize| std::fs::read_to_string(lab.nodes[i].agent_log()).unwrap_or_default();
    let ip1 = lab.nodes[1].ip;
    match fault {
        Fault::WrongEndpoint | Fault::WrongPort | Fault::BothWrong | Fault::StaleNat => {
            assert!(
                log(0).contains("roamed endpoint unanswered")
                    && log(0).contains("re-apply the peer"),
                "{}: the cause or the repair step is not logged\n{}",
                fault.name(),
                log(0)
            );
            assert_eq!(endpoint_of(lab, 0, 1).unwrap(), format!("{ip1}:51820"));
            assert!(repairs(lab, 0, "roamed endpoint unanswered", "reapply") >= 1);
        }
        Fault::AllowedIps | Fault::KeyReplaced | Fault::ListenPort => {
            let on = fault.named().0;
            until_or(
                &format!("{}: the device as planned", fault.name()),
                Duration::from_secs(5),
                || {
                    lab.on_node(on, "wg show flannel-wg dump").is_ok_and(|d| {
                        d.lines().count() == 3 && !d.contains("10.244.250.") && !d.contains("51999")
                    })
                },
                || lab.logs(),
            );
            let cause = match fault {
                Fault::AllowedIps => "allowed ips changed",
                Fault::KeyReplaced => "key mismatch",
                _ => "listen port changed",
            };
            assert!(repairs(lab, on, cause, "pass") >= 1, "{cause}");
        }
        Fault::Firewall => {
            // Every step was tried, then a pause said in the log: no repair loop, and one
            // dead pair never re-creates the device.
            let log = log(0);
            assert!(log.contains("re-handshake"), "{log}");
            assert!(log.contains("the fault is outside this node"), "{log}");
            let steps = log
                .lines()
                .filter(|l| l.contains("repairing a dead pair"))
                .count();
            assert!(steps <= 6, "{steps} repairs in 20 s: a loop\n{log}");
            assert!(!log.contains("re-creating the device"), "{log}");
            assert!(repairs(lab, 0, "endpoint unanswered", "rehandshake") >= 1);
        }
        Fault::DeviceStopped | Fault::ThreadStalled | Fault::SocketsDestroyed => {
            // The faulty process was replaced by one new one.
            until_or(
                "one device process on node 1",
                Duration::from_secs(5),
                || lab.device_pids(1).len() == 1,
                || lab.logs(),
            );
            if fault == Fault::DeviceStopped {
                assert!(repairs(lab, 1, "device not answering", "recreate") >= 1);
            }
        }
    }
}

#[test]
fn idle_pairs_are_never_dead_and_endpoint_faults_heal_in_seconds() {
    let lab = lab();
    lab.assert_all_pairs();
    // Idle for more than twice the dead verdict's window: nothing called dead, nothing
    // repaired, and the doctor's check passes on every node.
    let since = SystemTime::now();
    let quiet = || {
        lab.nodes.iter().all(|node| {
            [
                "pair dead",
                "repairing a dead pair",
                "differs from the plan",
            ]
            .iter()
            .all(|needle| node.logged_since(needle, since).is_none())
        })
    };
    wait::throughout_or(
        "no idle pair called dead, repaired or found drifted",
        Duration::from_secs(8),
        quiet,
        || lab.logs(),
    );
    for i in 0..lab.nodes.len() {
        let doctor = lab
            .on_node(i, &format!("{WEFT} doctor"))
            .unwrap_or_default();
        assert!(doctor.contains("PASS  pairs alive"), "{doctor}");
    }
    drop(lab);
    run_group(GROUPS[0]);
}

#[test]
fn drift_on_the_device_is_put_back_at_once() {
    run_group(GROUPS[1]);
}

#[test]
fn a_firewall_is_named_while_it_lasts_and_traffic_is_back_once_it_ends() {
    run_group(GROUPS[2]);
}

#[test]
fn a_device_that_stops_stalls_or_loses_its_sockets_is_made_again() {
    run_group(GROUPS[3]);
}
