//! End to end on the Kubernetes registry: three nodes run the real `weft agent
//! --kube-subnet-mgr` against the lab's API server, their pods are attached through the
//! CNI conflist weft ships (`weft-cni` → bridge + host-local), and every pod reaches every
//! pod on the other nodes. Also: flannel's annotations on every Node, NetworkUnavailable
//! cleared, `/healthz` and `/readyz`, CNI CHECK and DEL, a deleted Node leaving every
//! device, and only API calls the ClusterRole allows.

use std::process::{Command, Stdio};
use std::time::Duration;

use weft::registry::kube::API_CALLS;
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::netns::http_get;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");
const PREFIX: &str = "flannel.alpha.coreos.com";
const HEALTHZ_PORT: u16 = 10267;

fn wait_for(what: &str, within: Duration, ok: impl FnMut() -> bool) {
    weft_lab::wait::until(what, within, ok);
}

#[test]
fn a_kube_cluster_meshes_through_weft_cni() {
    let mut cfg = LabConfig::kube(3, WEFT);
    cfg.extra_args.extend([
        format!("--healthz-port={HEALTHZ_PORT}"),
        "--set-node-network-unavailable".into(),
    ]);
    let mut lab = Lab::start(cfg).unwrap();
    assert_eq!(lab.assert_all_pairs(), 24);
    let api = lab.kube.as_ref().unwrap();
    for node in &lab.nodes {
        let name = format!("n{}", node.index);
        // Pods got addresses from the node's pod CIDR, through host-local.
        let subnet = node.subnet.unwrap();
        assert_eq!(subnet.to_string(), format!("10.244.{}.0/24", node.index));
        assert!(node.pods.iter().all(|p| subnet.contains(&p.ip)));
        // flannel's annotations, in flannel's shapes.
        let n = api.node(&name).unwrap();
        let ann = &n["metadata"]["annotations"];
        assert_eq!(ann[format!("{PREFIX}/kube-subnet-manager")], "true");
        assert_eq!(ann[format!("{PREFIX}/backend-type")], "wireguard");
        assert_eq!(ann[format!("{PREFIX}/public-ip")], node.ip.to_string());
        let data: serde_json::Value =
            serde_json::from_str(ann[format!("{PREFIX}/backend-data")].as_str().unwrap()).unwrap();
        assert_eq!(data["Port"], 51820);
        let key = lab.wg_public_key(node.index - 1).unwrap();
        assert_eq!(data["PublicKey"], key);
        wait_for("NetworkUnavailable=False", Duration::from_secs(10), || {
            api.node(&name).unwrap()["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "NetworkUnavailable" && c["status"] == "False")
        });
        // Health.
        let addr = format!("{}:{HEALTHZ_PORT}", node.ip);
        let (code, body) = http_get(&node.ns, &addr, "/healthz");
        assert_eq!(code, 200, "{body}");
        let (code, body) = http_get(&node.ns, &addr, "/readyz");
        assert_eq!((code, body.trim()), (200, "ready"));
    }

    // CNI CHECK (CNI 0.4.0 and later; the shipped conflist is 1.0.0) passes for a pod as
    // added; DEL removes it and releases its address; a second DEL is fine; CHECK on a
    // deleted pod fails; ADD again works.
    let p = lab.add_pod(0, weft_lab::lab::cni::conflist()).unwrap();
    let runtime = lab.cni_runtime(0);
    let pod = &lab.nodes[0].pods[p];
    assert!(lab.ping(&lab.nodes[1].pods[0].ns, pod.ip, Duration::from_secs(10)));
    runtime.check(&pod.attachment, &pod.result).unwrap();
    runtime.del(&pod.attachment, &pod.result).unwrap();
    let links = lab.on_node(0, "ip -o link show master cni0").unwrap();
    assert_eq!(
        links.lines().count(),
        2,
        "the other two pods' veths should remain: {links}"
    );
    let mut ips = std::fs::read_dir(lab.nodes[0].dir.join("cni/networks/cbr0"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("10.244."))
        .collect::<Vec<_>>();
    ips.sort();
    let mut kept: Vec<String> = lab.nodes[0].pods[..2]
        .iter()
        .map(|p| p.ip.to_string())
        .collect();
    kept.sort();
    assert_eq!(
        ips, kept,
        "host-local should hold only the other pods' addresses"
    );
    runtime.del(&pod.attachment, &pod.result).unwrap();
    let err = runtime.check(&pod.attachment, &pod.result).unwrap_err();
    assert!(format!("{err:#}").contains("\"code\":3"), "{err:#}");
    let again = runtime.add(&pod.attachment).unwrap();
    let ip = weft_lab::lab::cni::result_ipv4(&again).unwrap().addr();
    assert!(lab.ping(&lab.nodes[1].pods[0].ns, ip, Duration::from_secs(10)));

    // A Node deleted from the API leaves every other node's device.
    let api = lab.kube.as_ref().unwrap();
    assert!(api.delete_node("n3"));
    for i in 0..2 {
        wait_for("n3 to leave", Duration::from_secs(10), || {
            lab.on_node(i, "wg show flannel-wg peers")
                .unwrap()
                .lines()
                .count()
                == 1
        });
    }

    for (verb, resource) in api.requests().keys() {
        assert!(
            API_CALLS.contains(&(verb.as_str(), resource.as_str())),
            "the agents made a call not in API_CALLS: {verb} {resource}"
        );
    }
}

#[test]
fn health_says_alive_but_not_ready_while_the_api_is_unreachable() {
    let lab = Lab::start(LabConfig {
        nodes: 0,
        ..LabConfig::kube(0, WEFT)
    })
    .unwrap();
    // An agent whose API server does not answer: it retries, alive, and is not ready.
    let ns = format!("{}-etcd", lab.tag);
    let kubeconfig = lab.dir().join("kubeconfig-nowhere");
    let text = std::fs::read_to_string(lab.dir().join("kubeconfig"))
        .unwrap()
        .replace(":6443", ":6999");
    std::fs::write(&kubeconfig, text).unwrap();
    let mut agent = Command::new("ip")
        .args(["netns", "exec", &ns, WEFT, "agent", "--kube-subnet-mgr"])
        .arg(format!("--kubeconfig-file={}", kubeconfig.display()))
        .arg(format!(
            "--net-config-path={}",
            lab.dir().join("net-conf.json").display()
        ))
        .args([
            "--node-name=n9",
            "--public-ip=198.51.100.250",
            &format!("--healthz-port={HEALTHZ_PORT}"),
            "--subnet-file=/nonexistent/subnet.env",
        ])
        .env("WIREGUARD_KEY_FILE", lab.dir().join("n9.key"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(lab.dir().join("n9.log")).unwrap())
        .spawn()
        .unwrap();
    let addr = format!("198.51.100.250:{HEALTHZ_PORT}");
    wait_for("the health endpoint", Duration::from_secs(10), || {
        http_get(&ns, &addr, "/healthz").0 == 200
    });
    // Alive, and not ready, saying what it waits for (a ready answer would fail here).
    let expected = (
        503,
        "not ready; waiting for: lease, data plane, subnet file",
    );
    // ... once it has retried the API server (it logs each retry).
    let log = || std::fs::read_to_string(lab.dir().join("n9.log")).unwrap_or_default();
    let last = weft_lab::wait::first_within(Duration::from_secs(10), || {
        let (code, body) = http_get(&ns, &addr, "/readyz");
        ((code, body.trim()) == expected && log().contains("retrying")).then_some((code, body))
    })
    .unwrap_or_else(|| http_get(&ns, &addr, "/readyz"));
    let _ = agent.kill();
    let _ = agent.wait();
    assert_eq!((last.0, last.1.trim()), expected);
    assert!(log().contains("retrying"), "{}", log());
}
