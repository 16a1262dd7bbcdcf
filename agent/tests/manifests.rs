//! The Kubernetes manifests (`deploy/kubernetes/`) and the image (`deploy/Dockerfile`)
//! held against the agent: every container's args and environment parse as the agent's
//! flags, the ConfigMap's net-conf.json passes `weft config check` and its cni-conf.json is
//! the conflist the lab runs and `weft install-cni` accepts, the ClusterRole grants exactly
//! the API calls the kube registry makes, and the DaemonSet has what a node agent needs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::CommandFactory;
use serde_json::Value;
use weft::cli::{Cli, Command as Sub};
use weft::registry::kube::API_CALLS;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every document of every manifest, as JSON values.
fn documents() -> Vec<Value> {
    let mut docs = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy().join("kubernetes"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value: Value = serde::Deserialize::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            if !value.is_null() {
                docs.push(value);
            }
        }
    }
    docs
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "expected one {kind}");
    found[0]
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect()
}

/// The container's env as the agent would see it (values from the downward API are
/// placeholders).
fn env_of(container: &Value) -> Vec<(String, String)> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            // The downward API's node address, as the kubelet fills it in.
            let downward = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("status.hostIP") => "198.51.100.7",
                _ => "from-downward-api",
            };
            let value = e["value"].as_str().unwrap_or(downward);
            (e["name"].as_str().unwrap().to_string(), value.to_string())
        })
        .collect()
}

fn parse(container: &Value) -> Cli {
    assert_eq!(strings(&container["command"]), ["/usr/local/bin/weft"]);
    let env = env_of(container);
    let lookup = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let args = std::iter::once("weft".to_string()).chain(strings(&container["args"]));
    Cli::parse_with_env(args.map(Into::into), &lookup).unwrap_or_else(|e| {
        panic!(
            "container {}: the args are not the agent's flags: {e}",
            container["name"]
        )
    })
}

#[test]
fn the_daemonset_runs_flags_and_env_the_agent_accepts() {
    let docs = documents();
    let ds = find(&docs, "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    assert!(pod["tolerations"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["operator"] == "Exists" && t.get("key").is_none()));

    let agent = &pod["containers"][0];
    let Sub::Agent(args) = parse(agent).command else {
        panic!("the main container does not run `weft agent`");
    };
    assert!(args.kube_subnet_mgr && args.ip_masq);
    // Every environment variable is one the agent reads.
    let flags: BTreeSet<String> = Cli::command()
        .find_subcommand("agent")
        .unwrap()
        .get_arguments()
        .filter_map(|a| a.get_long())
        .map(weft::cli::env_suffix)
        .collect();
    for (name, _) in env_of(agent) {
        let known = ["NODE_NAME", "RUST_LOG", "WIREGUARD_KEY_FILE"].contains(&name.as_str())
            || name
                .strip_prefix("WEFT_")
                .or_else(|| name.strip_prefix("FLANNELD_"))
                .is_some_and(|f| flags.contains(f));
        assert!(known, "the agent reads no environment variable {name}");
    }

    // The node's name comes from the downward API, so the agent never looks up its Pod
    // (the ClusterRole does not allow it).
    let node_name = agent["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "NODE_NAME")
        .expect("NODE_NAME is set");
    assert_eq!(
        node_name["valueFrom"]["fieldRef"]["fieldPath"],
        "spec.nodeName"
    );

    // The least privilege: two capabilities and nothing else, no escalation, the
    // runtime's seccomp profile, a read-only root.
    let security = &agent["securityContext"];
    let caps = strings(&security["capabilities"]["add"]);
    assert_eq!(caps, ["NET_ADMIN", "NET_RAW"]);
    assert_eq!(strings(&security["capabilities"]["drop"]), ["ALL"]);
    assert_eq!(security["privileged"], false);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["seccompProfile"]["type"], "RuntimeDefault");
    let volumes = pod["volumes"].as_array().unwrap();
    let host_path = |name: &str| -> Option<String> {
        volumes
            .iter()
            .find(|v| v["name"] == name)
            .and_then(|v| v["hostPath"]["path"].as_str().map(str::to_string))
    };
    let mounts: Vec<(String, String, bool)> = agent["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let name = m["name"].as_str().unwrap().to_string();
            assert!(
                volumes.iter().any(|v| v["name"] == name.as_str()),
                "mount of an undefined volume {name}"
            );
            (
                name,
                m["mountPath"].as_str().unwrap().to_string(),
                m["readOnly"] == true,
            )
        })
        .collect();
    for (path, read_only) in [
        ("/run/flannel", false),
        ("/var/lib/weft", false),
        ("/lib/modules", true),
        ("/run/xtables.lock", false),
        ("/dev/net/tun", false),
        // The control socket, which weft-cni's STATUS on the host asks.
        ("/run/weft", false),
    ] {
        let m = mounts
            .iter()
            .find(|(_, p, _)| p == path)
            .unwrap_or_else(|| panic!("{path} is not mounted"));
        assert_eq!(
            host_path(&m.0).as_deref(),
            Some(path),
            "{path} must be the host's"
        );
        assert_eq!(m.2, read_only, "{path} read-only");
    }
    // The agent's files land on those mounts: subnet.env, the key, the config.
    assert!(args.subnet_file.starts_with("/run/flannel"));
    assert!(Path::new(weft_crypto::DEFAULT_KEY_FILE).starts_with("/var/lib/weft"));
    let cfg_mount = mounts.iter().find(|(n, ..)| n == "weft-cfg").unwrap();
    assert!(args.net_config_path.starts_with(&cfg_mount.1));

    // Probes hit the health endpoints the args turn on, on loopback only (the pod is on
    // the host network); Prometheus scrapes /metrics on its own port.
    assert_ne!(args.healthz_port, 0);
    assert_eq!(args.healthz_ip.to_string(), "127.0.0.1");
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(agent[probe]["httpGet"]["path"], path);
        assert_eq!(agent[probe]["httpGet"]["port"], args.healthz_port);
        assert_eq!(agent[probe]["httpGet"]["host"], "127.0.0.1");
    }
    assert_ne!(args.metrics_port, 0);
    assert_ne!(args.metrics_port, args.healthz_port);
    // /metrics on the node's own address (the downward API's status.hostIP), not on
    // 0.0.0.0, where the pod subnet's gateway address would serve it to every pod too.
    assert_eq!(args.metrics_ip.to_string(), "198.51.100.7");
    let scrape = &ds["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(scrape["prometheus.io/port"], args.metrics_port.to_string());
    assert_eq!(scrape["prometheus.io/path"], "/metrics");
    assert!(agent["resources"]["requests"]["cpu"].is_string());
    assert!(agent["resources"]["requests"]["memory"].is_string());

    // The init container installs the plugin and conflist from the ConfigMap mount.
    let init = &pod["initContainers"][0];
    let Sub::InstallCni(install) = parse(init).command else {
        panic!("the init container does not run `weft install-cni`");
    };
    let init_mounts: Vec<(String, String)> = init["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap().to_string(),
                m["mountPath"]
                    .as_str()
                    .unwrap()
                    .trim_end_matches('/')
                    .to_string(),
            )
        })
        .collect();
    for dir in [&install.cni_bin_dir, &install.cni_conf_dir] {
        let (name, _) = init_mounts
            .iter()
            .find(|(_, p)| Path::new(p) == dir.as_path())
            .unwrap_or_else(|| panic!("{} is not mounted in the init container", dir.display()));
        assert_eq!(host_path(name).as_deref(), dir.to_str());
    }
    assert!(install
        .conflist
        .starts_with(&init_mounts.iter().find(|(n, _)| n == "weft-cfg").unwrap().1));
}

#[test]
fn the_configmap_passes_config_check_and_ships_the_labs_conflist() {
    let docs = documents();
    let cm = find(&docs, "ConfigMap");
    let ds = find(&docs, "DaemonSet");
    assert_eq!(cm["metadata"]["name"], "kube-flannel-cfg");
    let volumes = ds["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap();
    assert!(volumes
        .iter()
        .any(|v| v["configMap"]["name"] == cm["metadata"]["name"]));
    assert_eq!(cm["metadata"]["namespace"], ds["metadata"]["namespace"]);

    let checked = config_check(cm);
    assert_eq!(checked["Backend"]["Type"], "wireguard");
    let dir = tempfile::tempdir().unwrap();

    let conflist_text = cm["data"]["cni-conf.json"].as_str().unwrap();
    let conflist: Value = serde_json::from_str(conflist_text).unwrap();
    assert_eq!(
        conflist,
        weft_lab::lab::cni::conflist(),
        "the lab runs another conflist"
    );
    let conflist_path = dir.path().join("cni-conf.json");
    std::fs::write(&conflist_path, conflist_text).unwrap();
    let out = Command::new(WEFT)
        .arg("install-cni")
        .arg(format!(
            "--cni-bin-dir={}",
            dir.path().join("bin").display()
        ))
        .arg(format!(
            "--cni-conf-dir={}",
            dir.path().join("net.d").display()
        ))
        .arg(format!("--conflist={}", conflist_path.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dir.path().join("bin/flannel").is_file());
    assert!(dir.path().join("net.d/10-flannel.conflist").is_file());
}

#[test]
fn the_cluster_role_grants_exactly_the_registrys_api_calls() {
    let docs = documents();
    let role = find(&docs, "ClusterRole");
    let mut granted = BTreeSet::new();
    for rule in role["rules"].as_array().unwrap() {
        assert_eq!(strings(&rule["apiGroups"]), [""], "core API group only");
        for resource in strings(&rule["resources"]) {
            for verb in strings(&rule["verbs"]) {
                granted.insert((verb, resource.clone()));
            }
        }
    }
    let needed: BTreeSet<(String, String)> = API_CALLS
        .iter()
        .map(|(v, r)| (v.to_string(), r.to_string()))
        .collect();
    assert_eq!(
        granted, needed,
        "the ClusterRole should grant what the registry calls, no more"
    );

    let binding = find(&docs, "ClusterRoleBinding");
    let ds = find(&docs, "DaemonSet");
    let sa = find(&docs, "ServiceAccount");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    assert_eq!(binding["subjects"][0]["name"], sa["metadata"]["name"]);
    assert_eq!(
        binding["subjects"][0]["namespace"],
        sa["metadata"]["namespace"]
    );
    assert_eq!(
        ds["spec"]["template"]["spec"]["serviceAccountName"],
        sa["metadata"]["name"]
    );
    assert_eq!(ds["metadata"]["namespace"], sa["metadata"]["namespace"]);
    let ns = find(&docs, "Namespace");
    assert_eq!(ns["metadata"]["name"], sa["metadata"]["namespace"]);
}

#[test]
fn the_image_carries_both_binaries_and_nft() {
    let text = std::fs::read_to_string(deploy().join("Dockerfile")).unwrap();
    let stages = text.matches("\nFROM ").count() + usize::from(text.starts_with("FROM "));
    assert!(stages >= 2, "a multi-stage build");
    assert!(text.contains("--bin weft --bin weft-cni"));
    assert!(text.contains("/usr/local/bin/weft /usr/local/bin/weft-cni"));
    let runtime = text.rsplit("\nFROM ").next().unwrap();
    assert!(runtime.contains("nftables"), "the runtime image needs nft");
    assert!(
        !runtime.contains("cargo"),
        "no toolchain in the runtime image"
    );
}

/// `weft config check` of the ConfigMap `cm`'s net-conf.json: what it makes of it.
fn config_check(cm: &Value) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let net_conf = dir.path().join("net-conf.json");
    std::fs::write(&net_conf, cm["data"]["net-conf.json"].as_str().unwrap()).unwrap();
    let out = Command::new(WEFT)
        .args(["config", "check"])
        .arg(&net_conf)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "weft config check refused the ConfigMap's net-conf.json: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `kubectl kustomize DIR`'s objects (the `kubectl apply -k DIR` would send), or a failure
/// naming what is missing: kubectl (Debian: kubernetes-client, which `scripts/install-deps`
/// installs) or a kustomization it refuses.
fn kustomized(dir: &Path) -> Vec<Value> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("kubectl (apt-get install kubernetes-client) is needed: {e}"));
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// `v` as Kubernetes reads it: YAML 1.1 takes `0400` for an octal number, where YAML 1.2
/// (serde_yaml) keeps a string, and kustomize writes the number.
fn octal_as_kubernetes_reads_it(v: &mut Value) {
    match v {
        Value::String(s)
            if s.len() > 1
                && s.starts_with('0')
                && s.bytes().all(|b| (b'0'..=b'7').contains(&b)) =>
        {
            if let Ok(n) = u64::from_str_radix(s, 8) {
                *v = Value::from(n);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(octal_as_kubernetes_reads_it),
        Value::Object(o) => o.values_mut().for_each(octal_as_kubernetes_reads_it),
        _ => {}
    }
}

fn by_kind_and_name(docs: Vec<Value>) -> std::collections::BTreeMap<(String, String), Value> {
    docs.into_iter()
        .map(|mut d| {
            octal_as_kubernetes_reads_it(&mut d);
            let key = (
                d["kind"].as_str().unwrap_or_default().to_string(),
                d["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
            (key, d)
        })
        .collect()
}

/// `kubectl apply -k deploy/kubernetes` installs what `kubectl apply -f deploy/kubernetes/`
/// does, object for object (the `Kustomization` file has no `.yaml`, so `-f` passes it
/// over); the example overlay changes the image and the backend and nothing else, and what
/// it changes still passes the agent's own checks. Run with whatever kubectl the machine
/// has; Debian's (1.20, kustomize 2) is the oldest it must work with.
#[test]
fn the_manifests_install_with_kustomize_as_with_f_and_the_overlay_changes_image_and_backend() {
    let base = by_kind_and_name(kustomized(&deploy().join("kubernetes")));
    let files = by_kind_and_name(documents());
    assert_eq!(
        base.keys().collect::<Vec<_>>(),
        files.keys().collect::<Vec<_>>(),
        "-k and -f install other objects"
    );
    for (key, doc) in &files {
        assert_eq!(&base[key], doc, "{key:?} differs between -k and -f");
    }

    let overlay = by_kind_and_name(kustomized(&deploy().join("overlay-example")));
    assert_eq!(
        overlay.keys().collect::<Vec<_>>(),
        files.keys().collect::<Vec<_>>()
    );
    let ds = &overlay[&("DaemonSet".to_string(), "weft".to_string())];
    let spec = &ds["spec"]["template"]["spec"];
    for c in spec["containers"]
        .as_array()
        .into_iter()
        .chain(spec["initContainers"].as_array())
        .flatten()
    {
        assert_eq!(c["image"], "registry.example.com/weft:0.1.0", "{c}");
        if c["name"] == "weft" {
            parse(c);
        }
    }
    let cm = &overlay[&("ConfigMap".to_string(), "kube-flannel-cfg".to_string())];
    let checked = config_check(cm);
    assert_eq!(checked["Backend"]["Type"], "ipsec");
    // Everything else as the base has it.
    for (key, doc) in &files {
        if key.0 != "DaemonSet" && key.0 != "ConfigMap" {
            assert_eq!(&overlay[key], doc, "the overlay changed {key:?}");
        }
    }
}
