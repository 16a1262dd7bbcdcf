//! The tunnel's UDP port already taken on a node: by a process (a test thread here) or by
//! another device's kernel socket. The agent says so once, naming the port, the holder
//! and the fix, `weft doctor` reports it, and once the port is free the node comes up. A
//! holder that set `SO_REUSEADDR` does not share the port with the device either (the
//! device's sockets do not set it); a device going away is ended and waited for by the
//! agent (heal's deleted-device test).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use weft_lab::lab::{Lab, LabConfig};
use weft_lab::netns::in_named_netns;
use weft_lab::wait::{first_within, found_or};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// A UDP socket bound to `port` on 0.0.0.0 with `SO_REUSEADDR`, as any program may bind
/// (userspace WireGuard devices of other tools do).
fn bind_reusable(port: u16) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a descriptor this function owns from its creation.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = std::os::fd::OwnedFd::from_raw_fd(fd);
        let one: libc::c_int = 1;
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        if libc::setsockopt(
            raw,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            len,
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr { s_addr: 0 },
            sin_zero: [0; 8],
        };
        let addr_len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        if libc::bind(raw, (&addr as *const libc::sockaddr_in).cast(), addr_len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(fd)
    }
}

/// Holds UDP `port` in namespace `ns`, bound by `bind` (retried while the old device's
/// socket goes), until the returned sender is dropped.
fn hold_port<S: Send + 'static>(
    ns: &str,
    port: u16,
    bind: fn(u16) -> std::io::Result<S>,
) -> mpsc::Sender<()> {
    let (release, released) = mpsc::channel::<()>();
    let (bound, is_bound) = mpsc::channel();
    in_named_netns(ns, move || {
        let socket =
            first_within(Duration::from_secs(5), || bind(port).ok()).map_or_else(|| bind(port), Ok);
        let _ = bound.send(socket.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        let _ = released.recv();
        drop(socket);
    });
    is_bound
        .recv_timeout(Duration::from_secs(5))
        .expect("the holder thread")
        .expect("binding the port");
    release
}

/// A plain UDP socket on 0.0.0.0:`port`, as any other program would bind it.
fn bind_plain(port: u16) -> std::io::Result<std::net::UdpSocket> {
    std::net::UdpSocket::bind(("0.0.0.0", port))
}

fn wait_for_log(lab: &Lab, i: usize, what: &str) -> String {
    let log = || std::fs::read_to_string(lab.nodes[i].agent_log()).unwrap_or_default();
    found_or(
        &format!("{what:?} in node {}'s log", i + 1),
        Duration::from_secs(15),
        || Some(log()).filter(|l| l.contains(what)),
        log,
    )
}

fn port_taken_then_freed<S: Send + 'static>(
    mut cfg: LabConfig,
    (device, port, field): (&str, u16, &str),
    bind: fn(u16) -> std::io::Result<S>,
) {
    // Nothing else wakes the agent once the port is freed: its resync retries.
    cfg.extra_args.push("--resync-period=3".into());
    let mut lab = Lab::start(cfg).unwrap();
    lab.assert_all_pairs();
    lab.stop_agent(0, "TERM").unwrap();
    lab.on_node(0, &format!("ip link del {device}")).unwrap();
    let release = hold_port(&lab.nodes[0].ns, port, bind);
    lab.start_agent(0).unwrap();
    let want = format!(
        "{device} cannot use UDP port {port}: it is taken by pid {} (",
        std::process::id()
    );
    let log = wait_for_log(&lab, 0, &want);
    let error_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .filter(|l| !l.contains("boringtun"))
        .collect();
    println!("{}", error_lines.join("\n"));
    // One clear error, with the fix; not repeated at each pass, and no stream of route
    // errors behind it.
    let taken: Vec<&&str> = error_lines.iter().filter(|l| l.contains(&want)).collect();
    assert_eq!(taken.len(), 1, "{log}");
    assert!(
        taken[0].contains(&format!("(Backend.{field} in net-conf.json)")),
        "{}",
        taken[0]
    );
    assert!(
        !log.contains("Network is down"),
        "route errors behind the port error:\n{log}"
    );
    // The doctor says the same.
    let (said, doctor) = lab.doctor_says(0, &["FAIL  data plane:", &want]);
    assert!(said, "{doctor}");
    // Freed, the node comes up at the next pass (the 3 s resync at the latest).
    drop(release);
    let freed = Instant::now();
    let deadline = freed + Duration::from_secs(10);
    while !lab.all_pairs(Duration::from_secs(1)).1.is_empty() {
        assert!(
            Instant::now() < deadline,
            "not up after the port was freed\n{}",
            lab.logs()
        );
    }
    println!(
        "up {:.1} s after the port was freed",
        freed.elapsed().as_secs_f64()
    );
    wait_for_log(&lab, 0, "data plane errors resolved");
}

#[test]
fn a_taken_wireguard_port_is_one_clear_error_naming_its_holder() {
    port_taken_then_freed(
        LabConfig::wireguard(2, WEFT),
        ("flannel-wg", 51820, "ListenPort"),
        bind_plain,
    );
}

/// A holder with `SO_REUSEADDR` (the option any host process may set) does not share the
/// port with the userspace device: taken all the same, and said so.
#[test]
fn a_wireguard_port_held_with_so_reuseaddr_is_taken_too() {
    port_taken_then_freed(
        LabConfig::wireguard(2, WEFT),
        ("flannel-wg", 51820, "ListenPort"),
        bind_reusable,
    );
}

#[test]
fn a_taken_vxlan_port_is_one_clear_error_naming_its_holder() {
    port_taken_then_freed(
        LabConfig::backend(2, WEFT, "vxlan", false),
        ("flannel.1", 8472, "Port"),
        bind_plain,
    );
}
