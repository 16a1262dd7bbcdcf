//! The two WireGuard implementations behind `WgDevices`, each in a fresh network namespace:
//! how `auto` chooses (checked against what the kernel really accepts), the userspace
//! device as a process of its own (taken over by a second agent with zero writes, gone when
//! its link is deleted, a broken or ownerless device replaced), and the kernel device with
//! 1000 peers where the kernel has WireGuard. Those two are `#[ignore]`d, so the summary
//! says they did not run where the kernel has none (as here); the VM runner runs them with
//! `--include-ignored`, and there a kernel without WireGuard fails them.

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use weft_backends::apply::wireguard::devices::WgImpl;
use weft_backends::apply::wireguard::diff::diff_device;
use weft_backends::apply::wireguard::kernel::Kernel;
use weft_backends::apply::wireguard::process::UserspaceProcess;
use weft_backends::apply::wireguard::uapi_socket::{socket_path, UapiClient};
use weft_backends::apply::wireguard::WgDevices;
use weft_backends::apply::{Dataplane, Netlink, RtNetlink};
use weft_backends::model::{Lease, PeerSpec, TunnelSpec};
use weft_backends::netconf::Implementation;
use weft_backends::plan::wireguard_backend_data;
use weft_crypto::PrivateKey;
use weft_lab::fixtures::plan_of;
use weft_lab::netns::{in_new_netns, sh, sh_async};
use weft_lab::wait::until_async;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn userspace() -> UserspaceProcess {
    UserspaceProcess::new(vec![WEFT.into(), "userspace-device".into()])
}

/// Asks the kernel directly, with iproute2.
fn kernel_has_wireguard() -> bool {
    let ok = Command::new("ip")
        .args(["link", "add", "wgt-ask", "type", "wireguard"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        sh("ip link del wgt-ask");
    }
    ok
}

/// Fails unless this kernel accepts WireGuard links: the kernel tests never pass by
/// skipping their work.
fn require_kernel_wireguard() {
    assert!(
        kernel_has_wireguard(),
        "this kernel refuses wireguard links; these tests run in the VM runner (kernel_vm)"
    );
}

fn spec(device: &str, peers: usize) -> TunnelSpec {
    let peers = (0..peers)
        .map(|i| {
            let mut seed = [7u8; 32];
            seed[..4].copy_from_slice(&(i as u32).to_be_bytes());
            PeerSpec {
                node: format!("node-{i}"),
                public_key: PrivateKey::from_bytes(seed).public_key(),
                endpoint: SocketAddr::from(([198, 51, 100, 2 + (i % 200) as u8], 51820)),
                allowed_ips: vec![IpNet::new(
                    std::net::Ipv4Addr::from(0x0a00_0000 | ((i as u32) << 8)).into(),
                    24,
                )
                .unwrap()],
                keepalive: 25,
                psk: None,
                via: Default::default(),
            }
        })
        .collect();
    TunnelSpec {
        device: device.into(),
        listen_port: 51820,
        mtu: 1420,
        addresses: vec![],
        peers,
    }
}

/// Whether `pid` has exited (gone, or a zombie waiting for its parent).
fn exited(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(true)
}

/// Deletes `device`'s link and waits (at most 2 s) for its device process `pid` to exit.
async fn delete_and_wait_for_exit(device: &str, pid: i32) {
    sh(&format!("ip link del {device}"));
    until_async(
        &format!("pid {pid} exiting"),
        Duration::from_secs(2),
        || exited(pid),
    )
    .await;
}

async fn server_pid(device: &str) -> i32 {
    UapiClient::connect(device)
        .await
        .unwrap()
        .server_pid()
        .unwrap()
}

#[test]
fn auto_chooses_what_the_kernel_accepts_and_kernel_without_it_is_a_clear_error() {
    in_new_netns(|| async {
        let has = kernel_has_wireguard();
        let mut nl = RtNetlink::connect().unwrap();
        let (chosen, why) = WgImpl::choose(Implementation::Auto, &mut nl, "wgt-auto", userspace())
            .await
            .unwrap();
        assert_eq!(
            chosen.name(),
            if has { "kernel" } else { "userspace" },
            "{why}"
        );
        if has {
            assert!(why.starts_with("kernel: the kernel accepts"), "{why}");
        } else {
            assert!(why.contains("the kernel has no WireGuard ("), "{why}");
            let err = WgImpl::choose(Implementation::Kernel, &mut nl, "wgt-auto", userspace())
                .await
                .err()
                .expect("Implementation=kernel without kernel WireGuard must fail");
            let text = err.to_string();
            assert!(
                text.contains("Implementation=kernel")
                    && text.contains("load the wireguard module"),
                "{text}"
            );
        }
        let (chosen, why) =
            WgImpl::choose(Implementation::Userspace, &mut nl, "wgt-auto", userspace())
                .await
                .unwrap();
        assert_eq!(chosen.name(), "userspace", "{why}");
        assert!(
            !sh("ip -o link").contains("weft-probe-wg"),
            "the probe link was left behind"
        );
    });
}

#[test]
fn the_userspace_device_process_is_taken_over_and_replaced_when_broken() {
    in_new_netns(|| async {
        let dev = "wgt-proc"; // the socket directory is shared between tests: one name each
        let key = PrivateKey::generate().unwrap();
        let spec = spec(dev, 3);
        let mut nl = RtNetlink::connect().unwrap();
        let mut first = userspace();
        assert!(first.ensure(&mut nl, dev).await.unwrap(), "started");
        assert!(
            !first.ensure(&mut nl, dev).await.unwrap(),
            "already running"
        );
        let link = nl.link(dev).await.unwrap().unwrap();
        assert_eq!(link.kind.as_deref(), Some("tun"));
        let mode = std::fs::metadata(socket_path(dev)).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
        let change = diff_device(&spec, &key.public_key(), &first.get(dev).await.unwrap());
        first.apply(dev, &change, &key).await.unwrap();

        // A second agent (as after a restart) takes the device over: nothing to write.
        let mut second = userspace();
        assert!(!second.ensure(&mut nl, dev).await.unwrap(), "taken over");
        let seen = second.get(dev).await.unwrap();
        assert!(diff_device(&spec, &key.public_key(), &seen).is_empty());
        assert_eq!(second.writes(), 0);
        let shown = sh_async(&format!("wg show {dev} peers")).await;
        assert_eq!(shown.lines().count(), 3, "{shown}");

        // Its link deleted, the device process exits; ensure starts a new one.
        let pid = server_pid(dev).await;
        delete_and_wait_for_exit(dev, pid).await;
        assert!(second.ensure(&mut nl, dev).await.unwrap(), "started again");
        assert_ne!(server_pid(dev).await, pid);
        assert!(
            second.get(dev).await.unwrap().peers.is_empty(),
            "a new device starts empty; the reconcile replays the peers"
        );

        // A TUN under the name that no process serves is replaced.
        let pid = server_pid(dev).await;
        sh(&format!("kill -9 {pid}"));
        let t = Instant::now();
        while nl.link(dev).await.unwrap().is_some() {
            assert!(
                t.elapsed() < Duration::from_secs(2),
                "the TUN outlived its process"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        sh(&format!("ip tuntap add dev {dev} mode tun"));
        assert!(second.ensure(&mut nl, dev).await.unwrap(), "replaced");
        assert!(second.get(dev).await.is_ok(), "a device process answers");

        // Clean up: deleting the link ends the process.
        let pid = server_pid(dev).await;
        delete_and_wait_for_exit(dev, pid).await;
    });
}

#[test]
fn a_program_that_is_not_a_device_keeps_the_uapi_socket_it_holds() {
    in_new_netns(|| async {
        let dev = "wgt-squat"; // the socket directory is shared between tests: one name each
        let path = socket_path(dev);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let _ = std::fs::remove_file(&path);
        // Some other program listening on the device's socket path.
        let mut squatter = Command::new("perl")
            .args([
                "-MIO::Socket::UNIX",
                "-e",
                "my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM(), Local => $ARGV[0], \
                 Listen => 1) or die $!; print \"ready\\n\"; STDOUT->flush; sleep 60",
            ])
            .arg(&path)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(squatter.stdout.take().unwrap()),
            &mut ready,
        )
        .unwrap();
        assert_eq!(ready.trim(), "ready");
        let mut nl = RtNetlink::connect().unwrap();
        let err = userspace()
            .ensure(&mut nl, dev)
            .await
            .expect_err("a device must not be started over another program's socket");
        let text = err.to_string();
        assert!(
            text.contains(&format!("pid {}", squatter.id())) && text.contains("perl"),
            "{text}"
        );
        assert!(
            squatter.try_wait().unwrap().is_none(),
            "the other program was killed"
        );
        assert!(path.exists(), "its socket was removed");
        squatter.kill().unwrap();
        squatter.wait().unwrap();
        let _ = std::fs::remove_file(&path);
        // Its own device processes are still taken over as before (see the test above).
        let cmdline = format!("{WEFT}\0userspace-device\0{dev}\0");
        assert!(weft_backends::apply::wireguard::process::is_device_process(
            cmdline.as_bytes(),
            dev
        ));
        assert!(
            !weft_backends::apply::wireguard::process::is_device_process(
                b"/usr/bin/sshd\0-D\0",
                dev
            )
        );
    });
}

#[test]
#[ignore = "needs kernel WireGuard; the VM runner (kernel_vm) runs it"]
fn kernel_device_takes_1000_peers_in_split_messages_and_then_writes_nothing() {
    in_new_netns(|| async {
        require_kernel_wireguard();
        let dev = "wgt-kernel";
        let key = PrivateKey::generate().unwrap();
        let spec = spec(dev, 1000);
        let mut nl = RtNetlink::connect().unwrap();

        // A userspace device holding the name is replaced by the kernel's.
        let mut us = userspace();
        assert!(us.ensure(&mut nl, dev).await.unwrap());
        let mut k = Kernel::open().unwrap();
        assert!(k.ensure(&mut nl, dev).await.unwrap(), "created");
        let link = nl.link(dev).await.unwrap().unwrap();
        assert_eq!(link.kind.as_deref(), Some("wireguard"));
        assert!(!k.ensure(&mut nl, dev).await.unwrap(), "already there");

        let change = diff_device(&spec, &key.public_key(), &k.get(dev).await.unwrap());
        assert_eq!(change.peers.len(), 1000);
        k.apply(dev, &change, &key).await.unwrap();
        let messages = k.writes();
        assert!(messages > 1, "1000 peers went out in {messages} message(s)");
        let seen = k.get(dev).await.unwrap();
        assert_eq!(seen.peers.len(), 1000);
        assert_eq!(seen.public_key, Some(key.public_key()));
        assert!(diff_device(&spec, &key.public_key(), &seen).is_empty());
        assert_eq!(k.writes(), messages, "a second pass writes nothing");
        let shown = sh_async(&format!("wg show {dev} peers")).await;
        assert_eq!(shown.lines().count(), 1000);
        eprintln!("kernel device: 1000 peers in {messages} netlink messages");
    });
}

/// A wireguard lease for synthetic node `i`: subnet 10.(i/256).(i%256).0/24 inside
/// 10.0.0.0/8's /24s, a key of its own, an address on the documentation range.
fn synthetic_lease(i: u32) -> Lease {
    let mut seed = [9u8; 32];
    seed[..4].copy_from_slice(&i.to_be_bytes());
    Lease {
        node: format!("node-{i}"),
        subnet: format!("10.{}.{}.0/24", 1 + i / 256, i % 256).parse().ok(),
        subnet_v6: None,
        public_ip: Some(std::net::Ipv4Addr::from(0xc633_0000 | i)), // 198.51.x.y
        public_ipv6: None,
        backend_type: "wireguard".into(),
        backend_data: Some(wireguard_backend_data(
            &PrivateKey::from_bytes(seed).public_key(),
            51820,
        )),
        backend_v6_data: None,
        expires: None,
        reach: Default::default(),
        next_key: None,
        created: None,
        key_proof: None,
        ml_kem_key: None,
        also: Default::default(),
    }
}

#[test]
#[ignore = "needs kernel WireGuard; the VM runner (kernel_vm) runs it"]
fn one_reconcile_programs_1000_kernel_peers_in_split_messages_and_the_next_writes_nothing() {
    in_new_netns(|| async {
        require_kernel_wireguard();
        let me = synthetic_lease(0);
        let peers: Vec<Lease> = (1..=1000).map(synthetic_lease).collect();
        let conf = r#"{"Network": "10.0.0.0/8", "Backend": {"Type": "wireguard"}}"#;
        let state = plan_of(conf, &me, peers);
        assert_eq!(state.tunnels[0].peers.len(), 1000);
        let (mut dp, why) = Dataplane::connect(Some(Implementation::Kernel), userspace())
            .await
            .unwrap();
        assert_eq!(dp.implementation(), "kernel", "{why}");
        let key = PrivateKey::generate().unwrap();
        let t = Instant::now();
        let first = dp
            .reconcile(&state, &key, &Default::default())
            .await
            .unwrap();
        let took = t.elapsed();
        assert!(first.errors.is_empty(), "{:?}", first.errors);
        let messages = dp.wireguard_writes();
        assert!(messages > 1, "1000 peers in {messages} message(s)");
        let writes = dp.writes();
        let second = dp
            .reconcile(&state, &key, &Default::default())
            .await
            .unwrap();
        assert!(second.changes.is_empty(), "{:?}", second.changes);
        assert_eq!(dp.writes(), writes, "the second reconcile wrote");
        let shown = sh_async("wg show flannel-wg peers").await;
        assert_eq!(shown.lines().count(), 1000);
        let routes = sh("ip -4 route show proto 87 dev flannel-wg");
        assert_eq!(
            routes.lines().count(),
            1001,
            "1000 peer routes + the covering one"
        );
        eprintln!(
            "kernel, 1000 peers: first reconcile {took:?}, {messages} WireGuard netlink \
             messages, {writes} writes in all; second reconcile 0 writes"
        );
    });
}
