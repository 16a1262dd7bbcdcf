//! The agent killed in a loop: 50 SIGKILLs, each at another moment of the agent's start
//! (from before it runs to after its first pass), leak nothing: one device (and, for a
//! userspace device, one device process), the routes and blackhole as before, only the
//! agent's and the device's sockets, and traffic flows once the last agent runs.

use std::time::{Duration, Instant};

use weft_lab::lab::clear_watch::ClearWatch;
use weft_lab::lab::{Lab, LabConfig};
use weft_lab::wait::until_or;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// What node `i` holds that an agent could leak.
fn holdings(lab: &Lab, i: usize) -> String {
    // A device's `.replay` file (the peers' newest handshake timestamps) is written once
    // the device has answered an initiation, whichever agent ran then: it is listed apart,
    // and each one must belong to a device that is there.
    let script = "echo links: $(ip -o link show | grep -o 'flannel[^:@]*' | sort); \
         echo routes:; ip route show proto 87; ip route show table all type blackhole; \
         echo sockets: $(ls /run/weft /var/run/wireguard 2>/dev/null | grep -v '[.]replay$' | sort); \
         for f in /var/run/wireguard/*.replay; do [ -e \"$f\" ] || continue; \
           [ -S \"${f%.replay}.sock\" ] || echo \"orphan replay file: $f\"; done";
    let held = lab.on_node(i, script).unwrap();
    format!(
        "{held}device processes: {}\n",
        device_processes(&lab.nodes[i].ns)
    )
}

/// The userspace device processes running in network namespace `ns`.
fn device_processes(ns: &str) -> usize {
    weft_lab::lab::read::device_pids_in(ns).len()
}

#[test]
fn fifty_kills_during_start_leak_no_process_device_socket_or_route() {
    let mut lab = Lab::start(LabConfig::wireguard(2, WEFT)).unwrap();
    lab.assert_all_pairs();
    let before = holdings(&lab, 0);
    println!("{before}");
    // Watched from the first kill until the last agent has taken over: nothing in clear.
    let watch = ClearWatch::start(&lab).unwrap();
    let started = Instant::now();
    for round in 0..50u64 {
        lab.stop_agent(0, "KILL").unwrap();
        lab.start_agent(0).unwrap();
        // Fault injection: each kill at another moment of the start, 0 to 450 ms in.
        std::thread::sleep(Duration::from_millis(round % 10 * 50));
    }
    println!("50 kills in {:.1} s", started.elapsed().as_secs_f64());
    // The last agent comes up and takes over what is there.
    until_or(
        "the last agent answering",
        Duration::from_secs(20),
        || lab.on_node(0, &format!("{WEFT} status")).is_ok(),
        || lab.logs(),
    );
    lab.assert_all_pairs();
    let watched = watch.finish().unwrap();
    println!("50 kills: {watched:?}, nothing in clear");
    let after = holdings(&lab, 0);
    assert_eq!(after, before, "something leaked or went missing");
    assert!(after.contains("links: flannel-wg\n"), "one device: {after}");
}
