//! The watcher's thread against a device that is slow to answer, over the real UAPI socket.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

use weft_backends::apply::wireguard::process::UserspaceProcess;
use weft_backends::apply::wireguard::uapi_socket::{socket_path, SOCKET_DIR};
use weft_backends::model::DesiredState;
use weft_crypto::PrivateKey;

use super::*;

/// How long the stand-in device keeps each `get` waiting: past the watcher's read timeout,
/// so a round lasts that timeout.
const SLOW: Duration = Duration::from_millis(1500);

/// A UAPI socket for `device` that tells `asked` of each request, then answers it after
/// `SLOW` (no such device).
fn slow_device(device: &str, asked: std::sync::mpsc::Sender<()>) -> std::path::PathBuf {
    let path = socket_path(device);
    std::fs::create_dir_all(SOCKET_DIR).unwrap();
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let asked = asked.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
                    if line == "\n" {
                        let _ = asked.send(());
                        std::thread::sleep(SLOW);
                        let _ = stream.write_all(b"errno=19\n\n");
                    }
                    line.clear();
                }
            });
        }
    });
    path
}

fn plan_for(device: &str, endpoint: &str) -> Arc<DesiredState> {
    let mut state = DesiredState::default();
    state.tunnels.push(TunnelSpec {
        device: device.into(),
        listen_port: 51820,
        mtu: 1420,
        addresses: vec![],
        peers: vec![PeerSpec {
            node: "node-b".into(),
            public_key: PrivateKey::from_bytes([2; 32]).public_key(),
            endpoint: endpoint.parse().unwrap(),
            allowed_ips: vec!["10.244.2.0/24".parse().unwrap()],
            keepalive: 0,
            psk: None,
            via: Default::default(),
        }],
    });
    Arc::new(state)
}

/// The loop hands the watcher a new plan at every pass that changes one: that must not
/// wait for the round under way (at 10,000 peers a round's read and repairs held the
/// loop's pass 260-550 ms, the churn benchmark's p99).
#[test]
fn a_new_plan_is_handed_over_while_a_round_waits_on_the_device() {
    let device = format!("wlt-slow{}", std::process::id() % 10_000);
    let (asked_tx, asked) = std::sync::mpsc::channel();
    let path = slow_device(&device, asked_tx);
    let wg = WgImpl::Userspace(UserspaceProcess::new(vec!["true".into()]));
    let mut handle = spawn(
        wg,
        snapshot::Shared::default(),
        Metrics::default(),
        None,
        tokio::sync::mpsc::unbounded_channel().0,
    )
    .unwrap();
    let own = PrivateKey::from_bytes([1; 32]).public_key();
    handle.follow(
        &plan_for(&device, "198.51.100.2:51820"),
        own,
        &Default::default(),
    );
    // The first round starts after one poll period and waits on the device.
    asked
        .recv_timeout(Duration::from_secs(5))
        .expect("the watcher reads the planned device");
    let started = Instant::now();
    handle.follow(
        &plan_for(&device, "198.51.100.3:51820"),
        own,
        &Default::default(),
    );
    let took = started.elapsed();
    let _ = std::fs::remove_file(path);
    assert!(
        took < Duration::from_millis(100),
        "handing over a plan waited {took:?} for the round"
    );
}
