//! CNI 1.1 through `weft-cni`, driven as a runtime drives it, with Debian's bridge and
//! host-local (which speak up to CNI 1.0.0) as the delegates, on lab nodes running the
//! real agent:
//! - a 1.1.0 config adds pods over 1.0.0 delegates (the result is 1.1.0, the pod works);
//! - STATUS is 0 while the node is ready, 50 with the reason while its device is deleted,
//!   while its agent is stopped or does not answer, and 0 again once the agent has put
//!   things back; a stuck agent does not hold STATUS up;
//! - a /28 filled by containers that vanished without DEL takes pods again after GC, and
//!   after a reboot (attachments recorded in another boot are released by the next ADD);
//! - a multus-style 1.1.0 config takes the shipped conflist (1.0.0) as its delegate, and
//!   refuses flannel's old one (0.3.1);
//! - every error path answers with its spec code.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use weft_lab::lab::cni::{self, Attachment, Runtime};
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::wait::first_within;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// The shipped conflist at CNI 1.1.0, weft-cni alone: Debian's portmap speaks up to
/// 1.0.0, and libcni would hand it 1.1.0 too.
fn conflist_1_1() -> Value {
    let mut list = cni::conflist();
    list["cniVersion"] = json!("1.1.0");
    if let Some(plugins) = list["plugins"].as_array_mut() {
        plugins.truncate(1);
    }
    list
}

fn runtime(lab: &Lab, conflist: Value) -> Runtime<'_> {
    Runtime {
        conflist,
        ..lab.cni_runtime(0)
    }
}

/// STATUS through the list; `Err` is weft-cni's error object.
fn status(rt: &Runtime) -> Result<(), Value> {
    rt.network("STATUS", &[]).expect("running STATUS")
}

fn code(e: &Value) -> u64 {
    e["code"].as_u64().unwrap_or_default()
}

/// Polls STATUS until `want` holds for its answer; the answer.
fn status_until(
    rt: &Runtime,
    within: Duration,
    want: impl Fn(&Result<(), Value>) -> bool,
) -> Result<(), Value> {
    first_within(within, || Some(status(rt)).filter(|a| want(a))).unwrap_or_else(|| status(rt))
}

fn signal(lab: &Lab, sig: &str) {
    let pid = lab.agent_pid(0).expect("node 1's agent runs");
    let ok = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig} {pid}");
}

#[test]
fn status_follows_the_agent_and_its_device_and_1_1_runs_over_1_0_plugins() {
    let mut lab = Lab::start(LabConfig::wireguard(2, WEFT)).unwrap();

    // A pod added with a 1.1.0 config over Debian's 1.0.0 bridge and host-local.
    let p = lab.add_pod(0, conflist_1_1()).unwrap();
    let pod = &lab.nodes[0].pods[p];
    let pod_ip = pod.ip;
    assert_eq!(pod.result["cniVersion"], json!("1.1.0"), "{}", pod.result);
    let saved = std::fs::read(
        lab.nodes[0]
            .dir
            .join("cni/flannel")
            .join(&pod.attachment.container_id),
    )
    .unwrap();
    let saved: Value = serde_json::from_slice(&saved).unwrap();
    assert_eq!(
        saved["cniVersion"],
        json!("1.0.0"),
        "the delegate's config: {saved}"
    );
    assert!(lab.ping(&lab.nodes[1].pods[0].ns, pod_ip, Duration::from_secs(10)));

    // A multus-style 1.1.0 config delegating to the shipped conflist (1.0.0): taken, and
    // its pod reaches the other node's.
    let shipped = cni::conflist();
    assert_eq!(shipped["cniVersion"], json!("1.0.0"));
    for delegate in cni::multus_delegates(&cni::multus_over(&shipped)).unwrap() {
        let m = lab.add_pod(0, delegate).unwrap();
        let ip = lab.nodes[0].pods[m].ip;
        assert!(lab.ping(&lab.nodes[1].pods[0].ns, ip, Duration::from_secs(10)));
    }

    let rt = runtime(&lab, conflist_1_1());
    let started = Instant::now();
    assert_eq!(status(&rt), Ok(()));
    let ready_took = started.elapsed();

    // STATUS needs a 1.1.0 config.
    let e = runtime(&lab, cni::conflist())
        .try_call(
            "STATUS",
            &json!({"cniVersion": "1.0.0", "name": "cbr0", "type": "flannel"}),
            None,
        )
        .unwrap()
        .unwrap_err();
    assert_eq!(code(&e), 1, "{e}");

    // The device deleted: 50 naming it, until the agent has made it again and configured
    // it. The agent repairs within milliseconds, so it is frozen while the device goes, and
    // STATUS is asked in a loop from the moment it resumes, in the node's own shell.
    let mut conf = conflist_1_1()["plugins"][0].clone();
    conf["name"] = json!("cbr0");
    conf["cniVersion"] = json!("1.1.0");
    let conf_file = lab.dir().join("status-conf.json");
    std::fs::write(&conf_file, conf.to_string()).unwrap();
    let plugin = rt.cni_path.split(':').next().unwrap().to_string() + "/flannel";
    let agent = lab.agent_pid(0).unwrap();
    let script = format!(
        "kill -STOP {agent}; ip link del flannel-wg; kill -CONT {agent}; \
         for i in $(seq 400); do CNI_COMMAND=STATUS {plugin} < {}; echo \" exit $?\"; done",
        conf_file.display()
    );
    let out = (rt.wrap)(&script).output().unwrap();
    let answers = String::from_utf8_lossy(&out.stdout);
    let down = answers
        .lines()
        .filter(|l| l.contains("\"code\":50") && l.contains("device flannel-wg"))
        .count();
    let first = answers.lines().next().unwrap_or_default();
    assert!(
        down > 0,
        "no STATUS 50 naming the device after its deletion: {answers}"
    );
    eprintln!("device deleted: {down} of 400 STATUS answers 50 naming it; the first: {first}");
    assert_eq!(
        status_until(&rt, Duration::from_secs(30), Result::is_ok),
        Ok(())
    );
    assert!(lab.ping(&lab.nodes[1].pods[0].ns, pod_ip, Duration::from_secs(10)));

    // A stopped (frozen) agent: 50 at once, not a wait.
    signal(&lab, "STOP");
    let started = Instant::now();
    let e = status(&rt).expect_err("STATUS 0 from a frozen agent");
    let stuck_took = started.elapsed();
    signal(&lab, "CONT");
    assert_eq!(code(&e), 50, "{e}");
    assert!(
        e["msg"]
            .as_str()
            .unwrap_or_default()
            .contains("did not answer"),
        "{e}"
    );
    eprintln!("STATUS took {ready_took:?} ready, {stuck_took:?} with the agent frozen");
    assert!(
        stuck_took < ready_took + Duration::from_millis(100),
        "a frozen agent held STATUS {stuck_took:?} (ready: {ready_took:?})"
    );
    assert_eq!(
        status_until(&rt, Duration::from_secs(5), Result::is_ok),
        Ok(())
    );
    drop(rt);

    // The agent gone: 50; started again: 0 once it is ready.
    lab.stop_agent(0, "TERM").unwrap();
    let e = status(&runtime(&lab, conflist_1_1())).expect_err("STATUS 0 without an agent");
    assert_eq!(code(&e), 50, "{e}");
    lab.start_agent(0).unwrap();
    let rt = runtime(&lab, conflist_1_1());
    assert_eq!(
        status_until(&rt, Duration::from_secs(30), Result::is_ok),
        Ok(())
    );
    assert!(lab.ping(&lab.nodes[1].pods[0].ns, pod_ip, Duration::from_secs(10)));
}

/// Node 1's host-local reservations: the files named by address.
fn reservations(lab: &Lab) -> Vec<String> {
    let dir = lab.nodes[0].dir.join("cni/networks/cbr0");
    let mut ips: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.parse::<std::net::IpAddr>().is_ok())
                .collect()
        })
        .unwrap_or_default();
    ips.sort();
    ips
}

/// `weft <args>` on node 1 as a root shell there sees it (its `/run`, `/var/lib/cni` and
/// the pods' namespaces); its stdout, whatever its exit status.
fn node_cli(lab: &Lab, args: &str) -> String {
    let out = (lab.cni_runtime(0).wrap)(&format!("exec {WEFT} {args}"))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Pods vanish as after a crash: their namespaces go, no DEL is sent (those gone already
/// are passed over).
fn vanish(lab: &Lab, pods: std::ops::Range<usize>) {
    for p in pods {
        let ns = lab.nodes[0].pods[p].ns.clone();
        if !std::path::Path::new("/var/run/netns").join(&ns).exists() {
            continue; // vanished before
        }
        let out = std::process::Command::new("ip")
            .args(["netns", "del", &ns])
            .status()
            .unwrap();
        assert!(out.success(), "ip netns del {ns}");
    }
}

/// Adds pods until the node's range is full; how many fit.
fn fill(lab: &mut Lab) -> usize {
    let mut added = 0;
    loop {
        match lab.add_pod(0, conflist_1_1()) {
            Ok(_) => added += 1,
            Err(e) => {
                let text = format!("{e:#}");
                assert!(text.contains("no IP addresses available"), "{text}");
                return added;
            }
        }
        assert!(added <= 14, "a /28 took more than 13 pods");
    }
}

/// The agent releases what leaked by itself: a /28 filled by containers killed without a
/// DEL (their runtime gone too, so no GC ever comes) gets its addresses back within the
/// agent's period, with no GC call and no operator, while a live pod keeps its address
/// and its traffic. `/metrics` counts what was released.
#[test]
fn the_agent_releases_leaked_addresses_by_itself_and_never_a_live_pods() {
    let mut cfg = LabConfig::wireguard(1, WEFT);
    cfg.pods_per_node = 0;
    cfg.leaked_address_period = 2;
    cfg.extra_args.extend([
        "--healthz-port=10267".to_string(),
        "--healthz-ip=127.0.0.1".to_string(),
    ]);
    cfg.net_conf = r#"{"Network": "10.244.0.0/16", "SubnetLen": 28, "SubnetMax": "10.244.199.0", "Backend": {"Type": "wireguard"}}"#.into();
    let mut lab = Lab::start(cfg).unwrap();
    assert_eq!(fill(&mut lab), 13);
    let live = lab.nodes[0].pods[0].ip.to_string();
    vanish(&lab, 1..13);
    weft_lab::wait::until_or(
        "the 12 leaked addresses released by the agent",
        std::time::Duration::from_secs(10),
        || reservations(&lab) == [live.clone()],
        || format!("{:?}\n{}", reservations(&lab), lab.logs()),
    );
    // The live pod kept its address and its traffic.
    let pod = &lab.nodes[0].pods[0];
    assert_eq!(pod.ip.to_string(), live);
    let gateway = pod.result["ips"][0]["gateway"]
        .as_str()
        .unwrap()
        .to_string();
    weft_lab::lab::in_ns(&pod.ns, &format!("ping -c 1 -W 2 -q {gateway}")).unwrap();
    assert_eq!(fill(&mut lab), 12, "the range has room again");
    let log = std::fs::read_to_string(lab.nodes[0].agent_log()).unwrap();
    let released: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("released a leaked pod address"))
        .collect();
    assert_eq!(released.len(), 12, "{}", released.join("\n"));
    let metrics = lab
        .on_node(0, "curl -s http://127.0.0.1:10267/metrics")
        .unwrap();
    assert!(
        metrics.contains("weft_pod_address_leaks_released_total 12"),
        "{metrics}"
    );
}

#[test]
fn leaked_addresses_come_back_after_gc_and_after_a_reboot() {
    let mut cfg = LabConfig::wireguard(1, WEFT);
    cfg.pods_per_node = 0;
    // The runtime's GC and the operator's cleanup, not the agent's own release.
    cfg.leaked_address_period = 0;
    cfg.net_conf = r#"{"Network": "10.244.0.0/16", "SubnetLen": 28, "SubnetMax": "10.244.199.0", "Backend": {"Type": "wireguard"}}"#.into();
    let mut lab = Lab::start(cfg).unwrap();

    // 13 pods fill the /28 (the gateway takes .1); they vanish without DEL, but the first.
    assert_eq!(fill(&mut lab), 13);
    assert_eq!(reservations(&lab).len(), 13);
    vanish(&lab, 1..13);
    assert_eq!(fill(&mut lab), 0, "nothing came back by itself");

    let rt = runtime(&lab, conflist_1_1());
    let kept = lab.nodes[0].pods[0].attachment.container_id.clone();
    let keep = Attachment {
        container_id: kept.clone(),
        netns: lab.nodes[0].pods[0].attachment.netns.clone(),
        ifname: "eth0".into(),
    };
    // A bad entry in the list: a clear error, nothing released.
    let bad = Attachment {
        container_id: "../etc".into(),
        ..keep.clone()
    };
    let e = rt.network("GC", &[&keep, &bad]).unwrap().unwrap_err();
    assert_eq!(code(&e), 7, "{e}");
    assert!(e["msg"].as_str().unwrap_or_default().contains("[1]"), "{e}");
    assert_eq!(reservations(&lab).len(), 13);
    // GC with the one pod that still exists: the other 12 addresses come back.
    assert_eq!(rt.network("GC", &[&keep]).unwrap(), Ok(()));
    drop(rt);
    let left = reservations(&lab);
    assert_eq!(left, [lab.nodes[0].pods[0].ip.to_string()], "{left:?}");
    let data = lab.nodes[0].dir.join("cni/flannel");
    assert!(data.join(&kept).exists());
    assert_eq!(fill(&mut lab), 12);
    // The kept pod still works: its gateway answers.
    let pod = &lab.nodes[0].pods[0];
    let gateway = pod.result["ips"][0]["gateway"]
        .as_str()
        .unwrap()
        .to_string();
    weft_lab::lab::in_ns(&pod.ns, &format!("ping -c 1 -W 2 -q {gateway}")).unwrap();

    // Vanished again: `weft doctor` names each leak, `weft cleanup --leaked-addresses`
    // frees them beside the running agent, and the pods fit again.
    let pods = lab.nodes[0].pods.len();
    vanish(&lab, 1..pods);
    let doctor = node_cli(&lab, "doctor --handshake-wait 1");
    let line = doctor
        .lines()
        .find(|l| l.contains("pod addresses:"))
        .unwrap_or_default()
        .to_string();
    assert!(
        line.starts_with("WARN") && line.contains("12 leaked"),
        "{doctor}"
    );
    assert_eq!(
        line.matches("its network namespace is gone").count(),
        12,
        "{line}"
    );
    let cni_path = lab.cni_runtime(0).cni_path;
    let freed = node_cli(
        &lab,
        &format!("cleanup --leaked-addresses --cni-bin-dir {cni_path}"),
    );
    assert_eq!(
        freed.lines().filter(|l| l.starts_with("freed ")).count(),
        12,
        "{freed}"
    );
    assert_eq!(reservations(&lab).len(), 1);
    let doctor = node_cli(&lab, "doctor --handshake-wait 1");
    assert!(
        doctor.contains("PASS  pod addresses: 1 attachments"),
        "{doctor}"
    );
    assert_eq!(fill(&mut lab), 12);

    // A reboot: every pod is gone, no DEL was sent, and the records are of another boot.
    let pods = lab.nodes[0].pods.len();
    vanish(&lab, 0..pods);
    let records = data.join(".weft");
    for entry in std::fs::read_dir(&records).unwrap().flatten() {
        let path = entry.path();
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let Ok(mut record) = serde_json::from_str::<Value>(&text) else {
            continue;
        };
        if record.get("boot").is_some() {
            record["boot"] = json!("an-earlier-boot");
            std::fs::write(&path, record.to_string()).unwrap();
        }
    }
    assert_eq!(reservations(&lab).len(), 13);
    // The next ADD releases the earlier boot's attachments first: 13 pods fit again.
    assert_eq!(fill(&mut lab), 13);
    assert_eq!(reservations(&lab).len(), 13);
}

#[test]
fn flannels_old_conflist_is_one_multus_refuses() {
    // flannel's conflist before 2026 (0.3.1): what multus at 1.1.0 refuses.
    let mut old = cni::conflist();
    old["cniVersion"] = json!("0.3.1");
    let e = cni::multus_delegates(&cni::multus_over(&old)).unwrap_err();
    assert!(e.to_string().contains("older than 0.4.0"), "{e}");
}

#[test]
fn every_error_answers_with_its_spec_code() {
    let cni_bin = std::path::Path::new(WEFT).with_file_name("weft-cni");
    let dir = tempfile::tempdir().unwrap();
    let conf = |version: &str| {
        json!({"cniVersion": version, "name": "cbr0", "type": "flannel",
            "subnetFile": dir.path().join("subnet.env"), "dataDir": dir.path().join("data"),
            "agentSocket": dir.path().join("weft.sock")})
        .to_string()
    };
    let run = |env: &[(&str, &str)], stdin: &str| -> (bool, Value) {
        let mut cmd = std::process::Command::new(&cni_bin);
        cmd.env_clear().envs(env.iter().copied());
        let out = weft_lab::output_with_stdin(&mut cmd, stdin.as_bytes()).unwrap();
        let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        (out.status.success(), v)
    };
    let add = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "c1"),
        ("CNI_NETNS", "/var/run/netns/none"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/nonexistent"),
    ];
    // VERSION: 1.1.0, and everything from 0.3.0 up.
    let (ok, v) = run(&[("CNI_COMMAND", "VERSION")], "");
    assert!(ok);
    assert_eq!(v["cniVersion"], json!("1.1.0"));
    for version in ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        assert!(
            v["supportedVersions"]
                .as_array()
                .unwrap()
                .contains(&json!(version)),
            "{v}"
        );
    }
    for (env, stdin, want) in [
        // 1: incompatible version.
        (&add[..], conf("9.9.9"), 1),
        (&[("CNI_COMMAND", "STATUS")][..], conf("1.0.0"), 1),
        // 4: the environment.
        (&add[..1], conf("1.1.0"), 4),
        (&[("CNI_COMMAND", "GC")][..], conf("1.1.0"), 4),
        (&[("CNI_COMMAND", "FROB"), ("CNI_CONTAINERID", "c1"), ("CNI_NETNS", "/x"), ("CNI_IFNAME", "eth0"), ("CNI_PATH", "/x")][..], conf("1.1.0"), 4),
        // 5: I/O (no subnet.env).
        (&add[..], conf("1.1.0"), 5),
        // 6: not JSON.
        (&add[..], "{".to_string(), 6),
        // 7: a bad config, and GC without its list.
        (&add[..], r#"{"cniVersion": "1.1.0", "name": "cbr0", "type": "flannel", "delegate": {"type": 3}}"#.to_string(), 7),
        (&[("CNI_COMMAND", "GC"), ("CNI_PATH", "/nonexistent")][..], conf("1.1.0"), 7),
        // 50: STATUS without an agent.
        (&[("CNI_COMMAND", "STATUS")][..], conf("1.1.0"), 50),
    ] {
        let (ok, v) = run(env, &stdin);
        assert!(!ok, "{env:?} {stdin} succeeded");
        assert_eq!(code(&v), want, "{env:?} {stdin}: {v}");
        assert!(!v["msg"].as_str().unwrap_or_default().is_empty(), "{v}");
    }
    // 3: CHECK of a container never added.
    let mut check = add;
    check[0] = ("CNI_COMMAND", "CHECK");
    let (ok, v) = run(&check, &conf("1.1.0"));
    assert!(!ok);
    assert_eq!(code(&v), 3, "{v}");
}
