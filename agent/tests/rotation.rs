//! Key rotation in the lab, measured: a TCP stream and a 100 pps ping run between a pod on
//! the rotating node and a pod on another node while the key changes. The stream must not
//! reset nor stall for 200 ms or more, the ping must lose at most 6 packets (twice what
//! docs/key-rotation.md claims); the figures are printed. Every rotation, and a crash in
//! the middle of one, is watched for clear pod traffic from before it begins until after
//! it ends. Afterwards: the node's device and published key agree, every other node
//! holds exactly one peer for it (the new key) and no peer without AllowedIPs, and every
//! pod reaches every other.

use std::time::Duration;

use weft_lab::lab::clear_watch::ClearWatch;
use weft_lab::lab::{in_ns, Lab, LabConfig, ETCD_IP};
use weft_lab::pinger::unix_ms;
use weft_lab::traffic::{Disruption, Probe};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// Whether every other node has each node's current key as its only entry for it, with
/// no peer without AllowedIPs left anywhere; if not, what differs.
fn one_peer_per_node(lab: &Lab) -> Result<(), String> {
    // One read of each device (`wg show … dump`: its own key, then a line a peer), not one
    // process per key: under the VM's emulation each costs 0.1 s of the agents' CPU.
    let mut own = Vec::new();
    let mut peers = Vec::new();
    for j in 0..lab.nodes.len() {
        let dump = lab
            .on_node(j, "wg show flannel-wg dump")
            .map_err(|e| e.to_string())?;
        let mut lines = dump.lines().map(|l| l.split('\t').collect::<Vec<_>>());
        own.push(lines.next().and_then(|f| f.get(1).map(|k| k.to_string())));
        // (key, AllowedIPs) of each peer: never the device's private key.
        let entries: Vec<(String, String)> = lines
            .filter_map(|f| Some((f.first()?.to_string(), f.get(3)?.to_string())))
            .collect();
        peers.push(entries);
    }
    for (j, entries) in peers.iter().enumerate() {
        let node = lab.nodes[j].index;
        let shown = || format!("{entries:?}");
        if entries.iter().any(|(_, allowed)| allowed == "(none)")
            || entries.len() != lab.nodes.len() - 1
        {
            return Err(format!("node {node}: {}", shown()));
        }
        for i in (0..lab.nodes.len()).filter(|i| *i != j) {
            let key = own[i].clone().unwrap_or_default();
            if !entries.iter().any(|(k, _)| *k == key) {
                return Err(format!(
                    "node {node} lacks node {}'s key {key}: {}",
                    i + 1,
                    shown()
                ));
            }
        }
    }
    Ok(())
}

pub fn assert_one_peer_per_node(lab: &Lab) {
    if let Err(e) = one_peer_per_node(lab) {
        panic!("{e}");
    }
}

/// Ends a measurement once the rotation is over on every node (each holds only the new
/// keys) and the measured pair answers again.
fn finish_when_switched(lab: &Lab, probe: Probe, from: usize, to: usize) -> Disruption {
    weft_lab::wait::until_or(
        "every node holding only the new keys",
        Duration::from_secs(15),
        || one_peer_per_node(lab).is_ok(),
        || lab.logs(),
    );
    let (a, b) = (&lab.nodes[from].pods[0], &lab.nodes[to].pods[0]);
    assert!(
        lab.ping(&a.ns, b.ip, Duration::from_secs(5)),
        "{}",
        lab.logs()
    );
    probe.finish().unwrap()
}

/// The bound next to the claim (docs/key-rotation.md: at most 3 pings lost at 100 pps, a
/// longest TCP stall under 0.1 s): twice each. Under the VM's emulated CPU, what
/// docs/reliability.md states for the VM: kernel devices lose at most 5 pings there (10),
/// the userspace device, the control, up to 44 (90: it is measured to compare with, not
/// claimed, and loses more when the machine is busy); a TCP stream stalls there up to
/// 0.66 s, one retransmission timeout after a lost segment or two (1 s). The control's
/// stall bound follows its loss bound: a hole of up to 90 pings (0.9 s) stalls a stream
/// for the hole and the retransmission back-off after it, whose timeouts double while the
/// hole lasts (retransmissions at 0.4, 1.2 and 2.8 s after the loss with the emulated RTT's
/// 0.4 s timeout), so 3 s. A 66-ping hole in CI's run of 2026-11-27 stalled one 1.08 s; a
/// 63-ping hole in a fresh-check of 2026-12-02 stalled one 2.12 s.
fn assert_bounded(lab: &Lab, what: &str, d: &Disruption) {
    println!("{what}: {d}");
    let kernel = lab.implementation(0) == Some("kernel");
    let (stall, lost) = weft_lab::wait::bound(
        (Duration::from_millis(200), 6),
        if kernel {
            (Duration::from_secs(1), 10)
        } else {
            (Duration::from_secs(3), 90)
        },
    );
    let ok = d.stream_error.is_none()
        && d.stream_bytes > 0
        && d.pings_sent >= 100
        && d.max_stall < stall
        && d.pings_lost <= lost;
    assert!(ok, "{what}: {d}\n{}", lab.logs());
}

/// Rotates node 0's key through its local agent while traffic runs to node 1.
fn rotate_one_locally(lab: &Lab) -> Disruption {
    let before = lab.wg_public_key(0).unwrap();
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    let probe = Probe::start(&a.ns, &b.ns, b.ip).unwrap();
    let watch = ClearWatch::start(lab).unwrap();
    let out = lab.on_node(0, &format!("{WEFT} keys rotate")).unwrap();
    println!("{out}");
    let d = finish_when_switched(lab, probe, 0, 1);
    let watched = watch.finish().unwrap();
    eprintln!("one-node rotation: {watched:?}, nothing in clear");
    let after = lab.wg_public_key(0).unwrap();
    assert_ne!(before, after, "the key did not change");
    assert!(out.contains(&after), "{out}");
    d
}

#[test]
fn one_node_rotates_its_key_through_the_local_agent_etcd() {
    let lab = Lab::start(LabConfig::wireguard(3, WEFT)).unwrap();
    lab.assert_all_pairs();
    let mut secrets = lab.private_keys();
    let d = rotate_one_locally(&lab);
    assert_bounded(&lab, "one-node rotation (etcd)", &d);
    assert_one_peer_per_node(&lab);
    lab.assert_all_pairs();
    // No private key, old or new, was written to any log.
    secrets.extend(lab.private_keys());
    assert_eq!(secrets.len(), 6);
    lab.assert_secrets_not_logged(&secrets);
}

/// `weft keys rotate --all` from the registry's namespace, with traffic from node 1 to
/// node 2 (both rotate).
fn rotate_all(lab: &Lab, registry_flags: &str) -> (String, Disruption) {
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    let before: Vec<String> = (0..lab.nodes.len())
        .map(|i| lab.wg_public_key(i).unwrap())
        .collect();
    let probe = Probe::start(&a.ns, &b.ns, b.ip).unwrap();
    let watch = ClearWatch::start(lab).unwrap();
    let out = in_ns(
        &format!("{}-etcd", lab.tag),
        &format!("{WEFT} keys rotate --all --timeout 30 {registry_flags}"),
    )
    .unwrap();
    println!("{out}");
    let d = finish_when_switched(lab, probe, 0, 1);
    let watched = watch.finish().unwrap();
    eprintln!("all-node rotation: {watched:?}, nothing in clear");
    for (i, old) in before.iter().enumerate() {
        assert_ne!(
            *old,
            lab.wg_public_key(i).unwrap(),
            "node {} kept its key",
            i + 1
        );
    }
    assert!(
        out.contains(&format!(
            "all {} node(s) use their new keys",
            lab.nodes.len()
        )),
        "{out}"
    );
    (out, d)
}

/// On an etcd prefix other than flannel's: `--all` must find the leases and write the
/// requests under the prefix the agents use.
#[test]
fn every_node_rotates_one_at_a_time_etcd() {
    let prefix = "/example.org/pod-network";
    let lab = Lab::start(LabConfig {
        etcd_prefix: prefix.into(),
        ..LabConfig::wireguard(3, WEFT)
    })
    .unwrap();
    lab.assert_all_pairs();
    let (_, d) = rotate_all(
        &lab,
        &format!("--etcd-endpoints=http://{ETCD_IP}:2379 --etcd-prefix={prefix}"),
    );
    assert_bounded(&lab, "all-node rotation (etcd)", &d);
    assert_one_peer_per_node(&lab);
    lab.assert_all_pairs();
}

/// With an annotation prefix other than flannel's, which `--all` must read too.
#[test]
fn rotation_on_the_kubernetes_registry_one_node_then_all() {
    let prefix = "net.example.org";
    let mut cfg = LabConfig::kube(3, WEFT);
    cfg.extra_args
        .push(format!("--kube-annotation-prefix={prefix}"));
    let lab = Lab::start(cfg).unwrap();
    lab.assert_all_pairs();
    let d = rotate_one_locally(&lab);
    assert_bounded(&lab, "one-node rotation (kube)", &d);
    assert_one_peer_per_node(&lab);
    let kubeconfig = lab.dir().join("kubeconfig");
    let (_, d) = rotate_all(
        &lab,
        &format!(
            "--kube-subnet-mgr --kubeconfig-file={} --kube-annotation-prefix={prefix}",
            kubeconfig.display()
        ),
    );
    assert_bounded(&lab, "all-node rotation (kube)", &d);
    assert_one_peer_per_node(&lab);
    // The announcement is gone from every Node; flannel's backend-data carries the keys.
    let api = lab.kube.as_ref().unwrap();
    for i in 0..3 {
        let node = api.node(&format!("n{}", i + 1)).unwrap();
        let ann = &node["metadata"]["annotations"];
        assert!(ann["weft.dev/next-key"].is_null(), "{ann}");
        let data: serde_json::Value =
            serde_json::from_str(ann[format!("{prefix}/backend-data")].as_str().unwrap()).unwrap();
        assert_eq!(data["PublicKey"], lab.wg_public_key(i).unwrap());
    }
    lab.assert_all_pairs();
}

#[test]
fn a_rotation_interrupted_by_a_crash_resumes_and_a_peer_that_missed_it_catches_up() {
    let mut lab = Lab::start(LabConfig::wireguard(3, WEFT)).unwrap();
    lab.assert_all_pairs();
    // Watched from before the crash until every node is back: nothing in clear.
    let watch = ClearWatch::start(&lab).unwrap();
    // Node 3 is down while node 1 rotates: it misses the announcement.
    lab.stop_agent(2, "TERM").unwrap();
    // Node 1's agent dies right after announcing, before its moment.
    let before = lab.wg_public_key(0).unwrap();
    lab.on_node(
        0,
        &format!("{WEFT} keys rotate --timeout 1 >/dev/null 2>&1 &"),
    )
    .unwrap();
    let announced = || {
        let text = lab.on_node(0, "cat /var/lib/weft/rotation.json").ok()?;
        serde_json::from_str::<serde_json::Value>(&text).ok()
    };
    // Announced means published where the peers read it: the agent writes rotation.json
    // first and publishes the key after (in the VM the test once killed it between the
    // two, so no peer ever saw the announcement and none could switch).
    let next = weft_lab::wait::found_or(
        "node 1's next key announced in the registry",
        Duration::from_secs(5),
        || {
            let next = announced()?;
            let published = lab.published_lease(0)?;
            (published["WeftNextKey"]["PublicKey"] == next["PublicKey"]).then_some(next)
        },
        || lab.logs(),
    );
    lab.stop_agent(0, "KILL").unwrap();
    // Past the moment (and the grace a silent rotating node gets), the other nodes switch
    // to the announced key; node 1's device still has the old one, so node 2 cannot reach
    // it.
    let next_key = next["PublicKey"].as_str().unwrap().to_string();
    let allowed = || lab.on_node(1, "wg show flannel-wg allowed-ips").unwrap();
    weft_lab::wait::until_or(
        "node 2 switching to node 1's announced key",
        Duration::from_secs(15),
        || (allowed().lines()).any(|l| l.starts_with(&next_key) && !l.contains("(none)")),
        || format!("{}\n{}", allowed(), lab.logs()),
    );
    assert_eq!(
        lab.wg_public_key(0).unwrap(),
        before,
        "node 1 switched before its agent was killed\n{}",
        lab.logs()
    );
    let (a, b) = (lab.nodes[1].pods[0].ns.clone(), lab.nodes[0].pods[0].ip);
    assert!(
        !lab.ping(&a, b, Duration::from_secs(2)),
        "node 2 still reaches node 1 on its old key\n{}",
        lab.logs()
    );
    let restarted = std::time::Instant::now();
    lab.start_agent(0).unwrap();
    // Twice the claim (docs/reliability.md: reachable within 0.5 s of the restart; in
    // the emulated VM, where the agent itself takes seconds to start, within 5 s).
    let within = weft_lab::wait::bound(Duration::from_secs(1), Duration::from_secs(10));
    assert!(
        lab.ping(&a, b, within),
        "node 1 unreachable {within:?} after its restart\n{}",
        lab.logs()
    );
    println!(
        "crash mid-rotation: node 1 reachable {:.2} s after its agent restarted",
        restarted.elapsed().as_secs_f64()
    );
    assert_eq!(
        lab.wg_public_key(0).unwrap(),
        next["PublicKey"].as_str().unwrap(),
        "node 1 did not resume its rotation\n{}",
        lab.logs()
    );
    // Node 3 returns and learns node 1's key from the registry. Until then its device
    // may still reach node 1 on the session of the old key (node 1 keeps it for a while):
    // the pair counts as back once node 3 holds the new key and reaches node 1.
    lab.start_agent(2).unwrap();
    let back = std::time::Instant::now();
    weft_lab::wait::until_or(
        "node 3 holding node 1's new key",
        Duration::from_secs(10),
        || one_peer_per_node(&lab).is_ok(),
        || format!("{:?}\n{}", one_peer_per_node(&lab), lab.logs()),
    );
    let (c, a) = (&lab.nodes[2].pods[0], &lab.nodes[0].pods[0]);
    assert!(
        lab.ping(&c.ns, a.ip, Duration::from_secs(10)),
        "{}",
        lab.logs()
    );
    println!(
        "missed announcement: node 3 holds node 1's new key and reaches it {:.2} s after its agent restarted",
        back.elapsed().as_secs_f64()
    );
    lab.assert_all_pairs();
    let watched = watch.finish().unwrap();
    eprintln!("crash mid-rotation: {watched:?}, nothing in clear");
}

fn psk_everywhere(lab: &Lab, psk: &str) -> bool {
    (0..lab.nodes.len()).all(|i| {
        let keys = lab.on_node(i, "wg show flannel-wg preshared-keys").unwrap();
        keys.lines().count() == lab.nodes.len() - 1 && keys.lines().all(|l| l.ends_with(psk))
    })
}

fn wait_psk(lab: &Lab, psk: &str) {
    weft_lab::wait::until_or(
        &format!("PSK {psk} on every device"),
        Duration::from_secs(15),
        || psk_everywhere(lab, psk),
        || {
            let devices: Vec<String> = (0..lab.nodes.len())
                .map(|i| {
                    let keys = lab.on_node(i, "wg show flannel-wg preshared-keys");
                    format!("node {}: {}", i + 1, keys.unwrap_or_else(|e| e.to_string()))
                })
                .collect();
            format!("{}\n{}", devices.join("\n"), lab.logs())
        },
    );
}

fn genpsk() -> String {
    weft_crypto::PresharedKey::generate()
        .unwrap()
        .to_base64_secret()
}

/// With traffic from node 1 to node 2, `announce(next, switch_at_ms)` announces the next
/// PSK; returns the disruption once every device has it.
fn rotate_psk(lab: &Lab, announce: impl FnOnce(&str, u128)) -> Disruption {
    let next = genpsk();
    let (a, b) = (&lab.nodes[0].pods[0], &lab.nodes[1].pods[0]);
    let watch = ClearWatch::start(lab).unwrap();
    let probe = Probe::start(&a.ns, &b.ns, b.ip).unwrap();
    // The moment is 5 s ahead: no read of the devices that ended a second before it may
    // find the new PSK. (One read of every device takes seconds under emulation: what
    // it finds is as of its end at the latest, so it is judged by when it ended.)
    let at = unix_ms() + 5000;
    announce(&next, at);
    loop {
        let found = psk_everywhere(lab, &next);
        if unix_ms() + 1000 >= at {
            break;
        }
        assert!(!found, "the PSK changed before its moment");
    }
    wait_psk(lab, &next);
    assert!(
        lab.ping(&a.ns, b.ip, Duration::from_secs(5)),
        "{}",
        lab.logs()
    );
    let d = probe.finish().unwrap();
    let watched = watch.finish().unwrap();
    eprintln!("PSK rotation: {watched:?}, nothing in clear");
    d
}

#[test]
fn the_psk_rotates_without_restarts_etcd() {
    // The lab's etcd speaks plain HTTP: the agents must be told to accept the PSK in clear.
    // Classical pairs: each device's PSK is then the cluster PSK itself, which is what this
    // test reads (with `PostQuantum` it is combined with each pair's own: `post_quantum`).
    let mut cfg = LabConfig::wireguard(3, WEFT).backend_key("PostQuantum", false.into());
    cfg.extra_args.push("--etcd-insecure".into());
    let lab = Lab::start(cfg).unwrap();
    let key = "/coreos.com/network/weft/psk";
    let first = genpsk();
    lab.etcd()
        .etcdctl(&["put", key, &format!(r#"{{"PSK": "{first}"}}"#)])
        .unwrap();
    wait_psk(&lab, &first);
    lab.assert_all_pairs();
    let d = rotate_psk(&lab, |next, at| {
        let value = format!(r#"{{"PSK": "{first}", "NextPSK": "{next}", "SwitchAt": {at}}}"#);
        lab.etcd().etcdctl(&["put", key, &value]).unwrap();
    });
    assert_bounded(&lab, "PSK rotation (etcd)", &d);
    lab.assert_all_pairs();
    // Neither PSK nor any private key was written to any log.
    let next = lab.on_node(0, "wg show flannel-wg preshared-keys").unwrap();
    let mut secrets = lab.private_keys();
    secrets.push(first);
    secrets.extend(next.split_whitespace().skip(1).take(1).map(str::to_string));
    assert_eq!(secrets.len(), 5, "{next}");
    lab.assert_secrets_not_logged(&secrets);
}

#[test]
fn the_psk_rotates_without_restarts_from_a_mounted_secret() {
    // The lab's nodes share one directory, as every pod mounts the same Secret.
    let secret = tempfile::tempdir().unwrap();
    let write = |name: &str, value: &str| {
        let tmp = secret.path().join(format!(".{name}"));
        std::fs::write(&tmp, value).unwrap();
        std::fs::rename(&tmp, secret.path().join(name)).unwrap();
    };
    let first = genpsk();
    write("psk", &first);
    // Classical pairs, as above.
    let mut cfg = LabConfig::kube(3, WEFT).backend_key("PostQuantum", false.into());
    cfg.extra_args
        .push(format!("--psk-dir={}", secret.path().display()));
    let lab = Lab::start(cfg).unwrap();
    wait_psk(&lab, &first);
    lab.assert_all_pairs();
    let d = rotate_psk(&lab, |next, at| {
        write("next-psk", next);
        write("switch-at", &at.to_string());
    });
    assert_bounded(&lab, "PSK rotation (Secret)", &d);
    lab.assert_all_pairs();
}

#[test]
fn a_reboot_keeps_the_key_and_only_a_rotation_changes_it() {
    let mut lab = Lab::start(LabConfig::wireguard(2, WEFT)).unwrap();
    lab.assert_all_pairs();
    let before = lab.wg_public_key(0).unwrap();
    // A reboot: the agent and its device gone, a fresh /run; /var/lib/weft stays.
    lab.stop_agent(0, "TERM").unwrap();
    lab.on_node(0, "ip link del flannel-wg").unwrap();
    let run = lab.nodes[0].dir.join("run");
    std::fs::remove_dir_all(&run).unwrap();
    std::fs::create_dir_all(&run).unwrap();
    lab.start_agent(0).unwrap();
    let (a, b) = (&lab.nodes[1].pods[0], &lab.nodes[0].pods[0]);
    assert!(
        lab.ping(&a.ns, b.ip, Duration::from_secs(15)),
        "{}",
        lab.logs()
    );
    assert_eq!(
        lab.wg_public_key(0).unwrap(),
        before,
        "a reboot changed the key"
    );
    assert_one_peer_per_node(&lab);
}
