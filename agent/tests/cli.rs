//! The `weft` binary as an operator runs it: `keys` byte-compatible with `wg` (Debian
//! `wireguard-tools`), `config check` on good and bad files, and `weft agent` started while
//! etcd is down: it must say so, retry, acquire once etcd is up, write subnet.env, and exit
//! cleanly on SIGTERM, leaving the data plane in place.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use weft_lab::Etcd;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn run(program: &str, args: &[&str], stdin: &str) -> Output {
    weft_lab::output_with_stdin(Command::new(program).args(args), stdin.as_bytes())
        .unwrap_or_else(|e| panic!("cannot run {program}: {e} (wg comes from Debian wireguard-tools: scripts/install-deps)"))
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn keys_match_wireguard_tools_byte_for_byte() {
    for _ in 0..5 {
        let private = stdout(&run(WEFT, &["keys", "generate"], ""));
        assert_eq!(
            private.len(),
            45,
            "44 base64 characters and a newline: {private:?}"
        );
        assert_eq!(
            stdout(&run("wg", &["pubkey"], &private)),
            stdout(&run(WEFT, &["keys", "public"], &private))
        );
        let theirs = stdout(&run("wg", &["genkey"], ""));
        assert_eq!(
            stdout(&run("wg", &["pubkey"], &theirs)),
            stdout(&run(WEFT, &["keys", "public"], &theirs))
        );
    }
    let psk = stdout(&run(WEFT, &["keys", "psk"], ""));
    let wg_psk = stdout(&run("wg", &["genpsk"], ""));
    assert_eq!((psk.len(), wg_psk.len()), (45, 45));
    assert_ne!(psk, stdout(&run(WEFT, &["keys", "psk"], "")));
    // A PSK from either tool is accepted where a config takes one.
    for p in [psk.trim(), wg_psk.trim()] {
        let conf = format!(
            r#"{{"Network": "10.244.0.0/16", "Backend": {{"Type": "wireguard", "PSK": "{p}"}}}}"#
        );
        assert!(run(WEFT, &["config", "check", "-"], &conf).status.success());
    }
}

#[test]
fn keys_public_refuses_garbage_and_says_why() {
    let out = run(WEFT, &["keys", "public"], "hello\n");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("standard input does not hold a WireGuard private key"),
        "{err}"
    );
}

#[test]
fn config_check_prints_the_effective_config() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("net-conf.json");
    std::fs::write(
        &path,
        r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#,
    )
    .unwrap();
    let out = run(WEFT, &["config", "check", path.to_str().unwrap()], "");
    let effective: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(effective["SubnetLen"], 24);
    assert_eq!(effective["SubnetMin"], "10.244.1.0");
    assert_eq!(effective["Backend"]["ListenPort"], 51820);
    assert_eq!(effective["Backend"]["Implementation"], "auto");
}

#[test]
fn config_check_lists_every_problem_and_exits_1() {
    let bad = r#"{"Network": "10.244.0.0/33", "Colour": 1, "Backend": {"Type": "wireguard", "ListenPort": 0, "Mode": "x"}}"#;
    let out = run(WEFT, &["config", "check", "-"], bad);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("standard input: net-conf.json has 4 problems:"),
        "{err}"
    );
    for needle in [
        "`Network` = \"10.244.0.0/33\"",
        "unknown key `Colour`",
        "`Backend.ListenPort` = 0",
        "`Backend.Mode` = \"x\"",
    ] {
        assert!(err.contains(needle), "missing {needle} in {err}");
    }
    let out = run(WEFT, &["config", "check", "/nonexistent/net-conf.json"], "");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "reading net-conf.json at /nonexistent/net-conf.json: No such file or directory"
        ),
        "{err}"
    );
}

/// A command's stdout in this thread's namespace, or nothing if it failed (what is not
/// there yet).
fn quiet_sh(cmd: &str) -> String {
    Command::new("sh")
        .args(["-c", cmd])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

fn wait_for(what: &str, secs: u64, ok: impl FnMut() -> bool) {
    weft_lab::wait::until(what, Duration::from_secs(secs), ok);
}

/// Userspace device processes in this thread's network namespace (still running).
fn device_processes_here() -> usize {
    let here = std::fs::read_link("/proc/thread-self/ns/net").ok();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return 0;
    };
    procs
        .flatten()
        .filter(|p| {
            let dir = p.path();
            let cmd = std::fs::read(dir.join("cmdline")).unwrap_or_default();
            let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
            let zombie = stat
                .rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'));
            String::from_utf8_lossy(&cmd).contains("userspace-device")
                && !zombie
                && std::fs::read_link(dir.join("ns/net")).ok() == here
        })
        .count()
}

fn log_of(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Runs in its own network namespace (etcd too): the agent programs a data plane, and the
/// host's must never be touched.
#[test]
fn agent_waits_for_etcd_then_acquires_programs_the_node_and_stops_on_sigterm() {
    weft_lab::netns::in_new_netns(|| async {
        let mut etcd = Etcd::reserve().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (key_file, subnet_file, log) = (
            dir.path().join("lib/wireguard.key"),
            dir.path().join("run/subnet.env"),
            dir.path().join("agent.log"),
        );
        // The address to advertise comes from --iface, as with flanneld.
        weft_lab::netns::sh(
            "ip link add uplink type veth peer name uplink-peer && \
             ip addr add 198.51.100.9/24 dev uplink && ip link set uplink up",
        );
        let mut agent = Command::new(WEFT)
            .args(["agent", "--iface=uplink", "--ip-masq"])
            .env("FLANNELD_ETCD_ENDPOINTS", etcd.endpoint())
            .env("WEFT_SUBNET_FILE", &subnet_file)
            .env("WIREGUARD_KEY_FILE", &key_file)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        wait_for("the agent to report etcd unreachable", 15, || {
            log_of(&log).contains("connecting to etcd failed; retrying")
                || log_of(&log).contains("reading the network config failed; retrying")
        });
        assert!(
            agent.try_wait().unwrap().is_none(),
            "the agent exited while etcd was down:\n{}",
            log_of(&log)
        );

        etcd.launch().unwrap();
        let mut c = etcd_client::Client::connect([etcd.endpoint()], None)
            .await
            .unwrap();
        c.put(
            "/coreos.com/network/config",
            r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#,
            None,
        )
        .await
        .unwrap();
        wait_for("subnet.env", 30, || subnet_file.exists());
        let env = std::fs::read_to_string(&subnet_file).unwrap();
        assert!(
            env.starts_with("FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244."),
            "{env}"
        );
        assert!(
            env.ends_with("FLANNEL_MTU=1420\nFLANNEL_IPMASQ=true\n"),
            "{env}"
        );
        assert_eq!(
            std::fs::metadata(&key_file).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // The published key is the key file's public key, in flannel's value shape.
        let public = stdout(&run(
            WEFT,
            &["keys", "public"],
            &std::fs::read_to_string(&key_file).unwrap(),
        ));
        let r = c
            .get(
                "/coreos.com/network/subnets/",
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .unwrap();
        let published = r
            .kvs()
            .first()
            .map(|kv| kv.value_str().unwrap().to_string())
            .unwrap_or_default();
        assert!(
            published.contains(&format!("\"PublicKey\":\"{}\"", public.trim())),
            "{published}"
        );
        assert!(
            published.starts_with(
                r#"{"PublicIP":"198.51.100.9","PublicIPv6":null,"BackendType":"wireguard""#
            ),
            "{published}"
        );

        // The node's data plane: the device with its key, the fail-closed routes, the rules.
        // The pass puts in the blackhole first, then the device, its routes, its
        // configuration and the rules: wait until all of it is there (waiting for the
        // blackhole alone passed only while the poll was slow enough), then check each.
        wait_for("the data plane", 10, || {
            let routes = quiet_sh("ip -4 route show proto 87");
            routes.contains("blackhole 10.244.0.0/16")
                && routes.contains("10.244.0.0/16 dev flannel-wg")
                && quiet_sh("ip -o link show flannel-wg").contains(",UP")
                && quiet_sh("wg show flannel-wg listen-port").trim() == "51820"
                && quiet_sh("nft list table ip flannel-ipv4").contains("masquerade")
        });
        let routes = weft_lab::netns::sh("ip -4 route show proto 87");
        assert!(routes.contains("10.244.0.0/16 dev flannel-wg"), "{routes}");
        let link = weft_lab::netns::sh("ip -o link show flannel-wg");
        assert!(link.contains("mtu 1420") && link.contains(",UP"), "{link}");
        assert!(weft_lab::netns::sh("wg show flannel-wg listen-port").trim() == "51820");
        assert!(weft_lab::netns::sh("nft list table ip flannel-ipv4")
            .contains("masquerade fully-random"));

        Command::new("kill")
            .args(["-TERM", &agent.id().to_string()])
            .status()
            .unwrap();
        let status = weft_lab::wait::found_or(
            "the agent's exit after SIGTERM",
            Duration::from_secs(10),
            || agent.try_wait().unwrap(),
            || log_of(&log),
        );
        assert!(status.success(), "exit {status}:\n{}", log_of(&log));
        assert!(log_of(&log).contains("left in place"), "{}", log_of(&log));
        // Left in place indeed: the device still carries its peers' configuration.
        assert_eq!(
            weft_lab::netns::sh("wg show flannel-wg listen-port").trim(),
            "51820",
            "the device did not outlive the agent"
        );
        // Deleting the link ends a userspace device's process, so nothing outlives the test.
        weft_lab::netns::sh("ip link del flannel-wg");
        wait_for("the device process to exit", 5, || {
            device_processes_here() == 0
        });
    });
}

#[test]
fn config_check_names_each_bad_ipsec_value() {
    let bad = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "PSK": "short", "UDPEncap": 1, "ESPProposal": "3des-sha1", "MTU": 70000}}"#;
    let out = run(WEFT, &["config", "check", "-"], bad);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has 4 problems:"), "{err}");
    for needle in [
        "`Backend.PSK` = <5 characters, not shown>: an ipsec PSK must be at least 96 characters",
        "`Backend.UDPEncap` = 1: expected true or false",
        "`Backend.ESPProposal` = \"3des-sha1\": valid: aes128gcm16…, aes256gcm16…, chacha20poly1305…",
        "`Backend.MTU` = 70000",
    ] {
        assert!(err.contains(needle), "missing {needle} in {err}");
    }
    assert!(!err.contains("short"), "the PSK is never echoed: {err}");
    let good = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "ESPProposal": "chacha20poly1305-prfsha256-x25519"}}"#;
    let out = run(WEFT, &["config", "check", "-"], good);
    let effective: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(effective["Backend"]["ESPProposal"], "chacha20poly1305");
    assert_eq!(effective["Backend"]["UDPEncap"], false);
}
