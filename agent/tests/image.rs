//! The container image, built and run for real. `scripts/image` builds `deploy/Dockerfile`
//! with podman; then node 1 of a three-node Kubernetes lab runs its init container
//! (`weft install-cni`) and its agent **from that image**, in the node's network
//! namespace, with exactly what `deploy/kubernetes/daemonset.yaml` gives them (command,
//! args, env, capabilities, host mounts, read from the manifest itself), and meshes with
//! two agents run from the host binary. Every pod reaches every pod, a capture on the
//! underlay sees no pod address in clear, the agent is ready on its health port, and
//! `weft status` answers through `podman exec`.
//!
//! Stand-ins, because no kubelet runs here: the downward API's values are set as the
//! kubelet would set them, and the API server is reached through a kubeconfig named by
//! `KUBECONFIG` instead of an in-cluster service account. A ConfigMap volume is a
//! read-only directory holding the manifest's ConfigMap data; the optional PSK Secret,
//! absent, is an empty read-only directory, as the kubelet mounts it.
//!
//! Skipped, saying so, only where podman is not installed (scripts/install-deps installs
//! it). `WEFT_IMAGE_BUILT=1` uses an image already built by `scripts/image`.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use weft_lab::lab::capture::{assert_tunnelled, UnderlayCapture};
use weft_lab::lab::{run, Lab, LabConfig, Node};
use weft_lab::netns::http_get;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");
/// Where the container finds the lab's kubeconfig (`KUBECONFIG`).
const KUBECONFIG_IN_CONTAINER: &str = "/var/run/secrets/weft-lab/kubeconfig";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn manifest(file: &str, kind: &str) -> Value {
    let path = repo().join("deploy/kubernetes").join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let found = serde_yaml::Deserializer::from_str(&text)
        .map(|doc| <Value as serde::Deserialize>::deserialize(doc).unwrap())
        .find(|d| d["kind"] == kind);
    found.unwrap_or_else(|| panic!("no {kind} in {}", path.display()))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// podman with the runtime that works on this kind of machine (crun refuses its cgroups).
fn podman() -> Command {
    let mut c = Command::new("podman");
    c.args(["--runtime", "runc"]);
    c
}

/// `podman run`, with the rlimits a process here may set (podman's defaults are above them).
fn run_args(nofile: &str) -> Vec<String> {
    vec![
        "run".into(),
        "--rm".into(),
        "--ulimit".into(),
        format!("nofile={nofile}:{nofile}"),
        "--ulimit".into(),
        "nproc=4096:4096".into(),
    ]
}

fn hard_nofile() -> String {
    let out = run(Command::new("sh").args(["-c", "ulimit -Hn"])).unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The name of this test's container `name`.
fn container_name(name: &str) -> String {
    format!("weft-lab-{}-{name}", std::process::id())
}

/// A container removed when dropped, even if the test failed.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman().args(["rm", "-f", "-t", "0", &self.0]).output();
    }
}

/// One container of the DaemonSet, as podman arguments for `node`: name, env, security
/// context, volume mounts (host paths mapped into the node's directory: its private
/// `/run`, its `/var/lib/weft`, anything else under `host/`), entrypoint, image, args.
struct PodSpec {
    daemonset: Value,
    configmap: Value,
}

impl PodSpec {
    fn container(&self, list: &str, name: &str) -> &Value {
        self.daemonset["spec"]["template"]["spec"][list]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no {list} {name} in the DaemonSet"))
    }

    fn image(&self) -> String {
        self.container("containers", "weft")["image"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// Where `host_path` of a Kubernetes node is in the lab's `node`.
    fn node_path(node: &Node, host_path: &str) -> PathBuf {
        let rel = host_path.trim_start_matches('/');
        if let Some(rest) = rel
            .strip_prefix("var/run/")
            .or_else(|| rel.strip_prefix("run/"))
        {
            node.dir.join("run").join(rest)
        } else if rel == "var/lib/weft" {
            node.dir.join("lib")
        } else {
            node.dir.join("host").join(rel)
        }
    }

    /// The host side of volume `name` for `node`, made as the kubelet makes it.
    fn volume(&self, node: &Node, name: &str) -> (PathBuf, bool) {
        let volumes = self.daemonset["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap();
        let v = volumes
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no volume {name}"));
        if let Some(host) = v["hostPath"].as_object() {
            let path = host["path"].as_str().unwrap();
            let kind = host.get("type").and_then(Value::as_str).unwrap_or("");
            if kind == "CharDevice" {
                // Devices are the machine's own.
                let meta = std::fs::metadata(path).unwrap();
                assert!(meta.file_type().is_char_device(), "{path}");
                return (PathBuf::from(path), false);
            }
            let local = Self::node_path(node, path);
            if kind == "FileOrCreate" {
                std::fs::create_dir_all(local.parent().unwrap()).unwrap();
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&local)
                    .unwrap();
            } else {
                std::fs::create_dir_all(&local).unwrap();
            }
            (local, false)
        } else if let Some(cm) = v["configMap"].as_object() {
            assert_eq!(cm["name"], self.configmap["metadata"]["name"]);
            let dir = node.dir.join("configmap").join(name);
            std::fs::create_dir_all(&dir).unwrap();
            for (file, text) in self.configmap["data"].as_object().unwrap() {
                std::fs::write(dir.join(file), text.as_str().unwrap()).unwrap();
            }
            (dir, true)
        } else if v["emptyDir"].is_object() {
            let dir = node.dir.join("emptydir").join(name);
            std::fs::create_dir_all(&dir).unwrap();
            (dir, false)
        } else if v["secret"]["optional"] == true {
            // The Secret does not exist: an optional one is mounted empty.
            let dir = node.dir.join("secret").join(name);
            std::fs::create_dir_all(&dir).unwrap();
            (dir, true)
        } else {
            panic!("volume {name}: a kind this test does not map: {v}")
        }
    }

    /// `podman run` arguments for container `name` of `list` on `node`.
    fn podman_args(&self, list: &str, name: &str, node: &Node, nofile: &str) -> Vec<String> {
        let c = self.container(list, name);
        let mut args = run_args(nofile);
        args.push(format!("--name={}", container_name(name)));
        assert_eq!(
            self.daemonset["spec"]["template"]["spec"]["hostNetwork"],
            true
        );
        args.push(format!("--network=ns:/run/netns/{}", node.ns));
        let security = &c["securityContext"];
        if security["privileged"] == true {
            args.push("--privileged".into());
        }
        for cap in strings(&security["capabilities"]["drop"]) {
            args.push(format!("--cap-drop={cap}"));
        }
        for cap in strings(&security["capabilities"]["add"]) {
            args.push(format!("--cap-add={cap}"));
        }
        if security["allowPrivilegeEscalation"] == false {
            args.push("--security-opt=no-new-privileges".into());
        }
        if security["readOnlyRootFilesystem"] == true {
            // As the kubelet does it: no tmpfs on /run or /tmp, only the pod's volumes.
            args.push("--read-only".into());
            args.push("--read-only-tmpfs=false".into());
        }
        for env in c["env"].as_array().into_iter().flatten() {
            let value = match env["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("spec.nodeName") => format!("n{}", node.index),
                // The kubelet's status.hostIP: the node's own address.
                Some("status.hostIP") => node.ip.to_string(),
                Some("metadata.name") => format!("weft-n{}", node.index),
                Some("metadata.namespace") => self.daemonset["metadata"]["namespace"]
                    .as_str()
                    .unwrap()
                    .into(),
                Some(other) => panic!("a downward API field this test does not set: {other}"),
                None => env["value"].as_str().unwrap().to_string(),
            };
            args.push(format!("--env={}={value}", env["name"].as_str().unwrap()));
        }
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            let (host, always_ro) = self.volume(node, m["name"].as_str().unwrap());
            let ro = always_ro || m["readOnly"] == true;
            args.push(format!(
                "--volume={}:{}{}",
                host.display(),
                m["mountPath"].as_str().unwrap().trim_end_matches('/'),
                if ro { ":ro" } else { "" }
            ));
        }
        let command = strings(&c["command"]);
        assert_eq!(command.len(), 1, "{command:?}");
        args.push(format!("--entrypoint={}", command[0]));
        args.push(c["image"].as_str().unwrap().to_string());
        args.extend(strings(&c["args"]));
        args
    }
}

#[test]
fn a_node_runs_the_daemonset_from_the_image_and_meshes_with_host_agents() {
    if Command::new("podman").arg("--version").output().is_err() {
        eprintln!("skipped: podman is not installed (scripts/install-deps installs it)");
        return;
    }
    let spec = PodSpec {
        daemonset: manifest("daemonset.yaml", "DaemonSet"),
        configmap: manifest("configmap.yaml", "ConfigMap"),
    };
    let image = spec.image();
    if std::env::var("WEFT_IMAGE_BUILT").as_deref() != Ok("1") {
        let built =
            run(Command::new(repo().join("scripts/image")).arg(&image)).expect("scripts/image");
        // Its last line gives the image's size.
        eprintln!(
            "{}",
            String::from_utf8_lossy(&built.stdout)
                .trim_end()
                .lines()
                .last()
                .unwrap_or("")
        );
    }
    let nofile = hard_nofile();

    let mut cfg = LabConfig::kube(3, WEFT);
    // Everyone runs the ConfigMap's net-conf.json, as on a cluster.
    cfg.net_conf = spec.configmap["data"]["net-conf.json"]
        .as_str()
        .unwrap()
        .to_string();
    let spec = std::sync::Arc::new(spec);
    let launch = spec.clone();
    cfg.launchers.insert(
        0,
        Box::new(move |node: &Node| {
            // The init container first, to completion, as the kubelet runs it.
            let init = launch.podman_args("initContainers", "install-cni", node, &nofile);
            run(podman().args(&init))?;
            let mut args = launch.podman_args("containers", "weft", node, &nofile);
            // The stand-in for the in-cluster service account, before the image's name.
            let kubeconfig = node.dir.parent().unwrap().join("kubeconfig");
            let at = args
                .iter()
                .position(|a| a.starts_with("--entrypoint"))
                .unwrap();
            args.insert(at, format!("--env=KUBECONFIG={KUBECONFIG_IN_CONTAINER}"));
            args.insert(
                at,
                format!(
                    "--volume={}:{KUBECONFIG_IN_CONTAINER}:ro",
                    kubeconfig.display()
                ),
            );
            let mut c = podman();
            c.args(&args);
            Ok(c)
        }),
    );
    let _init = Container(container_name("install-cni"));
    let _agent = Container(container_name("weft"));
    let lab = Lab::start(cfg).unwrap();
    let node = &lab.nodes[0];

    // The init container installed the plugin and the ConfigMap's conflist.
    let plugin = node.dir.join("host/opt/cni/bin/flannel");
    let mode = std::fs::metadata(&plugin).unwrap().permissions().mode();
    assert_eq!(
        mode & 0o111,
        0o111,
        "{} is not executable",
        plugin.display()
    );
    let version = run(Command::new(&plugin).env("CNI_COMMAND", "VERSION")).unwrap();
    let version: Value = serde_json::from_slice(&version.stdout).unwrap();
    assert!(
        strings(&version["supportedVersions"]).contains(&"0.3.1".to_string()),
        "{version}"
    );
    let installed: Value = serde_json::from_str(
        &std::fs::read_to_string(node.dir.join("host/etc/cni/net.d/10-flannel.conflist")).unwrap(),
    )
    .unwrap();
    let shipped: Value =
        serde_json::from_str(spec.configmap["data"]["cni-conf.json"].as_str().unwrap()).unwrap();
    assert_eq!(installed, shipped);

    // The node from the image runs userspace WireGuard (this kernel has none) and meshes.
    let link = lab.on_node(0, "ip -d -o link show flannel-wg").unwrap();
    assert!(link.split_whitespace().any(|w| w == "tun"), "{link}");
    let capture = UnderlayCapture::start(&lab).unwrap();
    assert_eq!(lab.assert_all_pairs(), 24);
    assert_tunnelled(&capture.finish().unwrap(), 24);

    // Ready on the DaemonSet's probe port, on loopback only; /metrics on its own port on
    // the node's address; the operator's tools work inside the read-only container.
    let (code, body) = http_get(&node.ns, "127.0.0.1:10267", "/readyz");
    assert_eq!((code, body.trim()), (200, "ready"));
    let (code, _) = http_get(&lab.nodes[1].ns, &format!("{}:10267", node.ip), "/readyz");
    assert_eq!(code, 0, "the health port answers from another node");
    let (code, body) = http_get(&node.ns, &format!("{}:10268", node.ip), "/metrics");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("weft_"), "{body}");
    let status = run(podman().args(["exec", &container_name("weft"), "weft", "status"])).unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    for peer in ["n2", "n3"] {
        let line = status
            .lines()
            .find(|l| l.starts_with(peer))
            .unwrap_or_else(|| panic!("no {peer} in weft status:\n{status}"));
        assert!(line.trim_end().ends_with("up"), "{line}");
    }
    // And the host's agents hold the image's node as a peer with a session.
    let peers = lab
        .on_node(1, "wg show flannel-wg latest-handshakes")
        .unwrap();
    assert_eq!(peers.lines().count(), 2, "{peers}");
    assert!(
        peers.lines().all(|l| !l.trim_end().ends_with("\t0")),
        "a peer without a handshake: {peers}"
    );
}
