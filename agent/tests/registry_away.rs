//! The registry away, in the lab: etcd down for 60 s, etcd wiped and restored from a
//! snapshot, and the Kubernetes API server answering 500s, hanging, or closing its watches
//! every few seconds. Throughout, pod traffic flows (a stream between every pair of nodes
//! counts its answers), the data plane is not written (every pass logs `writes=0`), and
//! `/readyz` says why the node is not ready. Afterwards a change in the registry reaches
//! the data plane within one resync.

use std::time::{Duration, Instant};

use weft_lab::kube_api::Fault;
use weft_lab::lab::clear_watch::ClearWatch;
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::netns::http_get;
use weft_lab::wait::{self, until, until_or};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");
const PORT: u16 = 10_251;
const RESYNC_S: u64 = 10;

fn config(mut cfg: LabConfig) -> LabConfig {
    cfg.extra_args.push(format!("--healthz-port={PORT}"));
    cfg.extra_args.push(format!("--resync-period={RESYNC_S}"));
    cfg
}

fn readyz(lab: &Lab, i: usize) -> (u16, String) {
    let node = &lab.nodes[i];
    http_get(&node.ns, &format!("{}:{PORT}", node.ip), "/readyz")
}

/// How many lines each agent's log has now.
fn log_marks(lab: &Lab) -> Vec<usize> {
    (0..lab.nodes.len())
        .map(|i| log(lab, i).lines().count())
        .collect()
}

fn log(lab: &Lab, i: usize) -> String {
    std::fs::read_to_string(lab.nodes[i].agent_log()).unwrap_or_default()
}

/// The data plane writes each agent logged after `marks`; panics unless every pass since
/// wrote nothing. Returns the number of passes seen.
fn assert_no_writes_since(lab: &Lab, marks: &[usize]) -> usize {
    let mut passes = 0;
    for (i, mark) in marks.iter().enumerate() {
        let text = log(lab, i);
        let lines: Vec<&str> = text.lines().collect();
        for (at, line) in lines
            .iter()
            .enumerate()
            .skip(*mark)
            .filter(|(_, l)| l.contains(" reconciled "))
        {
            passes += 1;
            assert!(
                line.contains(" writes=0 "),
                "node {} wrote to its data plane while the registry was away: {line}\nwhat it logged before:\n{}",
                i + 1,
                lines[at.saturating_sub(15)..at].join("\n")
            );
        }
    }
    passes
}

/// Adds a node and waits until every other node has it as a peer; returns how long.
fn join_and_time(lab: &mut Lab) -> Duration {
    let started = Instant::now();
    let new = lab.add_node().unwrap();
    let key = lab.wg_public_key(new).unwrap();
    for i in 0..new {
        until(
            "the new node as a peer everywhere",
            Duration::from_secs(RESYNC_S),
            || {
                lab.on_node(i, "wg show flannel-wg peers")
                    .is_ok_and(|p| p.contains(&key))
            },
        );
    }
    started.elapsed()
}

#[test]
fn etcd_away_for_60_s_leaves_the_data_plane_alone_and_readiness_says_why() {
    let mut lab = Lab::start(config(LabConfig::wireguard(3, WEFT))).unwrap();
    lab.assert_all_pairs();
    until("ready", Duration::from_secs(10), || {
        readyz(&lab, 0).0 == 200
    });
    let watch = ClearWatch::start(&lab).unwrap();
    let marks = log_marks(&lab);

    lab.etcd_mut().stop();
    until(
        "/readyz saying the registry is away",
        Duration::from_secs(RESYNC_S * 2),
        || {
            let (code, body) = readyz(&lab, 0);
            code == 503 && body.contains("the registry (") && body.contains("198.51.100.250:2379")
        },
    );
    eprintln!("etcd away: /readyz says {:?}", readyz(&lab, 1).1.trim());
    // Watched through the 60 s: the first pass that writes fails the test there.
    wait::throughout("no data plane writes", Duration::from_secs(60), || {
        assert_no_writes_since(&lab, &marks);
        true
    });
    let passes = assert_no_writes_since(&lab, &marks);
    assert!(
        passes >= 3 * 60 / RESYNC_S as usize / 2,
        "only {passes} passes in 60 s"
    );
    let watched = watch.finish().unwrap();
    assert!(
        watched.sent - watched.answered <= 3,
        "pod traffic lost while etcd was away: {watched:?}"
    );
    eprintln!("etcd away 60 s: {passes} passes, none wrote; pod streams {watched:?}");

    let back = Instant::now();
    lab.etcd_mut().launch().unwrap();
    for i in 0..3 {
        until("ready again", Duration::from_secs(RESYNC_S), || {
            readyz(&lab, i).0 == 200
        });
    }
    let ready_in = back.elapsed();
    let joined = join_and_time(&mut lab);
    lab.assert_all_pairs();
    eprintln!(
        "etcd back: ready in {ready_in:?}; a node joining after reached everywhere in {joined:?}"
    );
}

#[test]
fn etcd_wiped_and_restored_from_a_snapshot_keeps_every_subnet_once() {
    let mut lab = Lab::start(config(LabConfig::wireguard(3, WEFT))).unwrap();
    lab.assert_all_pairs();
    let snapshot = lab.dir().join("etcd.snapshot");
    lab.etcd().snapshot(&snapshot).unwrap();
    // A node joins after the snapshot: the restore loses its lease.
    let late = lab.add_node().unwrap();
    lab.assert_all_pairs();
    let subnets: Vec<_> = lab.nodes.iter().map(|n| n.subnet.unwrap()).collect();

    // Watched from before the wipe until every lease is back: nothing in clear.
    let watch = ClearWatch::start(&lab).unwrap();
    lab.etcd_mut().wipe_and_restore(&snapshot).unwrap();
    let leases = || {
        lab.etcd()
            .etcdctl(&[
                "get",
                "--prefix",
                "--keys-only",
                "/coreos.com/network/subnets/",
            ])
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let back = wait::until_or(
        "the late node's lease claimed again",
        Duration::from_secs(RESYNC_S * 3),
        || leases().len() == 4,
        || format!("{:?}\n{}", leases(), log(&lab, late)),
    );
    let keys = leases();
    for (i, s) in subnets.iter().enumerate() {
        let key = format!(
            "/coreos.com/network/subnets/{}-{}",
            s.network(),
            s.prefix_len()
        );
        assert!(
            keys.contains(&key),
            "node {} lost subnet {s}: {keys:?}",
            i + 1
        );
    }
    let log = log(&lab, late);
    assert!(log.contains("claiming it again"), "{log}");
    lab.assert_all_pairs();
    let watched = watch.finish().unwrap();
    eprintln!("etcd wiped and restored: {watched:?}, nothing in clear");
    eprintln!("etcd restored from a snapshot without node {}'s lease: claimed again with the same subnet in {back:?}; 4 leases, all pairs", late + 1);
}

/// One fault of the test API server for `lasting`, with the streams running; then the
/// fault ends and a new node must be reached within one resync.
fn api_fault(lab: &mut Lab, fault: Fault, lasting: Duration, says_why: bool) {
    // The node the last fault added: its first post-quantum rounds (which need no
    // registry, and write the device) are over before this fault begins.
    lab.settle_post_quantum(Duration::from_secs(10)).unwrap();
    let watch = ClearWatch::start(lab).unwrap();
    let marks = log_marks(lab);
    let api = lab.kube.as_ref().unwrap();
    api.set_fault(fault);
    if says_why {
        until(
            "/readyz saying the API server fails",
            Duration::from_secs(RESYNC_S * 2),
            || {
                let (code, body) = readyz(lab, 0);
                code == 503 && body.contains("the registry (the API server")
            },
        );
    }
    wait::throughout("no data plane writes", lasting, || {
        assert_no_writes_since(lab, &marks);
        true
    });
    let passes = assert_no_writes_since(lab, &marks);
    lab.kube.as_ref().unwrap().set_fault(Fault::None);
    let watched = watch.finish().unwrap();
    assert!(
        watched.sent - watched.answered <= 3,
        "pod traffic lost during {fault:?}: {watched:?}"
    );
    let ended = Instant::now();
    for i in 0..lab.nodes.len() {
        until_or(
            &format!(
                "node {} ready within one resync after {fault:?} ended",
                i + 1
            ),
            Duration::from_secs(RESYNC_S).saturating_sub(ended.elapsed()),
            || readyz(lab, i).0 == 200,
            || format!("{:?}\n{}", readyz(lab, i), log(lab, i)),
        );
    }
    let ready_in = ended.elapsed();
    let joined = join_and_time(lab);
    eprintln!(
        "{fault:?} for {lasting:?}: {passes} passes, none wrote; streams {watched:?}; ready {ready_in:?} after, a new node reached in {joined:?}"
    );
}

#[test]
fn the_api_server_failing_hanging_or_cutting_watches_leaves_the_data_plane_alone() {
    let mut lab = Lab::start(config(LabConfig::kube(2, WEFT))).unwrap();
    lab.assert_all_pairs();
    api_fault(&mut lab, Fault::Errors, Duration::from_secs(20), true);
    api_fault(&mut lab, Fault::Hang, Duration::from_secs(20), false);
    api_fault(
        &mut lab,
        Fault::ShortWatches(Duration::from_secs(2)),
        Duration::from_secs(20),
        false,
    );
    lab.assert_all_pairs();
}
