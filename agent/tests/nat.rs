//! "Two VPCs and a NAT", on the Kubernetes registry: nodes 1 and 2 in zone-a on the first
//! segment; nodes 3 and 4 in zone-b on a private segment behind a masquerading NAT, their
//! Nodes annotated with `public-ip-overwrite` = the NAT's outside address, the only way in.
//! The mesh reaches everyone in both directions; zone-b's nodes reach each other on their
//! internal addresses, zone-a reaches them through the NAT; an endpoint WireGuard learned
//! through the NAT survives the agents' resyncs; and after the NAT rebinds every flow
//! (new port range, conntrack flushed) traffic comes back within 7 s (the natted node's
//! keepalive, every 5 s here, shows the new port), as the continuous ping's timestamps
//! tell.

use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use weft_lab::lab::{nat, Lab, LabConfig, NAT_IP};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// Node `i`'s WireGuard endpoints: (peer public key, endpoint).
fn endpoints(lab: &Lab, i: usize) -> Vec<(String, String)> {
    lab.on_node(i, "wg show flannel-wg endpoints")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (k, e) = l.split_once('\t')?;
            Some((k.to_string(), e.to_string()))
        })
        .collect()
}

fn endpoint_of(lab: &Lab, on: usize, peer: usize) -> String {
    let key = lab.wg_public_key(peer).unwrap();
    endpoints(lab, on)
        .into_iter()
        .find(|(k, _)| *k == key)
        .map(|(_, e)| e)
        .unwrap_or_default()
}

#[test]
fn two_vpcs_and_a_nat() {
    let mut cfg = LabConfig::kube(4, WEFT);
    cfg.net_conf = r#"{"Network": "10.244.0.0/16", "SubnetMax": "10.244.199.0", "Backend": {"Type": "wireguard", "PersistentKeepaliveInterval": 5}}"#.into();
    cfg.natted = vec![2, 3];
    cfg.zones = ["zone-a", "zone-a", "zone-b", "zone-b"]
        .map(|z| Some(z.to_string()))
        .to_vec();
    cfg.extra_args.push("--resync-period=3".into());
    let lab = Lab::start(cfg).unwrap();
    assert_eq!(lab.assert_all_pairs(), 48);

    // Same zone behind the NAT: internal addresses, both ways.
    assert_eq!(endpoint_of(&lab, 2, 3), "192.0.2.4:51820");
    assert_eq!(endpoint_of(&lab, 3, 2), "192.0.2.3:51820");
    // Same zone on the first segment.
    assert_eq!(endpoint_of(&lab, 0, 1), "198.51.100.2:51820");
    // From zone-a, both natted nodes are behind the NAT's one address; WireGuard learns
    // which port is which from their handshakes.
    let via_nat: Vec<String> = [2, 3].iter().map(|&p| endpoint_of(&lab, 0, p)).collect();
    for e in &via_nat {
        assert!(e.starts_with(&format!("{NAT_IP}:")), "{via_nat:?}");
    }
    assert_ne!(
        via_nat[0], via_nat[1],
        "two nodes behind one NAT need two ports"
    );
    // And the natted nodes reach zone-a on its published addresses.
    assert_eq!(endpoint_of(&lab, 2, 0), "198.51.100.1:51820");

    // A learned endpoint outlives the agents' full resyncs (every 3 s here): two of them.
    let full_passes = || {
        std::fs::read_to_string(lab.nodes[0].agent_log())
            .unwrap_or_default()
            .matches("full=true")
            .count()
    };
    let before = full_passes();
    weft_lab::wait::until("two full resyncs", Duration::from_secs(15), || {
        full_passes() >= before + 2
    });
    let again: Vec<String> = [2, 3].iter().map(|&p| endpoint_of(&lab, 0, p)).collect();
    assert_eq!(again, via_nat, "a resync overwrote a learned endpoint");
    let log = std::fs::read_to_string(lab.nodes[0].agent_log()).unwrap();
    let rewrites = log
        .lines()
        .filter(|l| l.contains("update peer") && l.contains("endpoint"))
        .count();
    assert_eq!(rewrites, 0, "node 1 rewrote an endpoint:\n{log}");

    // The NAT rebinds every flow: new ports, conntrack flushed. A 10 pps ping from a
    // zone-a pod to a pod behind the NAT must come back once the natted node's next packet
    // (at the latest its keepalive, every 5 s here) shows its new port: within 7 s.
    let target = lab.nodes[3].pods[0].ip;
    // Line-buffered into a file, so the recovery can be read while it runs.
    let ping_log = lab.dir().join("nat-ping.log");
    let ping = Command::new("ip")
        .args(["netns", "exec", &lab.nodes[0].pods[0].ns])
        .args([
            "stdbuf",
            "-oL",
            "ping",
            "-i",
            "0.1",
            "-W",
            "1",
            "-D",
            "-O",
            &target.to_string(),
        ])
        .stdout(std::fs::File::create(&ping_log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let replies = || std::fs::read_to_string(&ping_log).unwrap_or_default();
    weft_lab::wait::until(
        "the ping answered before the rebind",
        Duration::from_secs(10),
        || replies().matches("bytes from").count() >= 5,
    );
    nat::rebind(&lab.tag, "45000-45999").unwrap();
    // From when the rebind is complete (conntrack flushed): under an emulated CPU the
    // commands take a while, and pings go through until they are done.
    let rebound_at = SystemTime::now();
    // Wait until node 1 has learned the new port and a second ping gets through; the
    // recovery itself is read from the continuous ping's timestamps, so how slowly this
    // loop polls (an emulated CPU in the VM) does not count.
    let bound = Duration::from_secs(7);
    weft_lab::wait::until_or(
        "node 1 reaching node 4 through its new NAT port",
        Duration::from_secs(30),
        || {
            let e = endpoint_of(&lab, 0, 3);
            let port: u16 = e
                .rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            (45000..=45999).contains(&port)
                && lab.ping(&lab.nodes[0].pods[1].ns, target, Duration::from_secs(1))
        },
        || {
            format!(
                "node 1 sees node 4 at {}\n{}",
                endpoint_of(&lab, 0, 3),
                lab.logs()
            )
        },
    );
    let rebound = rebound_at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    // The continuous ping's own first answer to a request sent after the rebind.
    weft_lab::wait::until(
        "the ping answered after the rebind",
        Duration::from_secs(10),
        || recovery(&replies(), rebound).is_some(),
    );
    let _ = Command::new("kill")
        .args(["-INT", &ping.id().to_string()])
        .status();
    let mut ping = ping;
    let _ = ping.wait();
    let text = replies();
    let (back_at, lost) = recovery(&text, rebound)
        .unwrap_or_else(|| panic!("no ping answered after the rebind:\n{text}"));
    let recovered = Duration::from_secs_f64((back_at - rebound).max(0.0));
    println!(
        "NAT rebind: traffic back after {:.2} s ({lost} pings of 10 pps unanswered); node 1 now reaches node 4 at {}",
        recovered.as_secs_f64(),
        endpoint_of(&lab, 0, 3)
    );
    assert!(
        recovered < bound,
        "traffic back after {recovered:?}, bound {bound:?}:\n{text}\n{}",
        lab.logs()
    );
    lab.assert_all_pairs();
}

/// From `ping -D -O` output: when traffic came back after `since` (seconds since the Unix
/// epoch), that is the first reply to a request sent after `since` (sent = the reply's
/// time less its round trip, so a slow reply to an earlier request does not count), and
/// how many requests reported unanswered after `since` never got a reply. `None` if no
/// request sent after `since` was answered.
fn recovery(text: &str, since: f64) -> Option<(f64, usize)> {
    let stamp =
        |line: &str| -> Option<f64> { line.strip_prefix('[')?.split(']').next()?.parse().ok() };
    let field = |line: &str, name: &str| -> Option<f64> {
        let rest = line.split(name).nth(1)?;
        rest.split(|c: char| c.is_whitespace()).next()?.parse().ok()
    };
    let mut answered = std::collections::BTreeSet::new();
    let mut unanswered = std::collections::BTreeSet::new();
    let mut back: Option<f64> = None;
    for line in text.lines() {
        let (Some(at), Some(seq)) = (stamp(line), field(line, "icmp_seq=")) else {
            continue;
        };
        let seq = seq as u64;
        if line.contains("no answer yet") {
            if at >= since {
                unanswered.insert(seq);
            }
        } else if line.contains("bytes from") {
            answered.insert(seq);
            let sent = at - field(line, "time=").unwrap_or(0.0) / 1e3;
            if sent >= since && back.is_none_or(|b| at < b) {
                back = Some(at);
            }
        }
    }
    let lost = unanswered.difference(&answered).count();
    back.map(|at| (at, lost))
}

#[test]
fn recovery_is_the_first_reply_to_a_request_sent_after_the_moment() {
    let text = "[100.5] 64 bytes from 10.0.0.1: icmp_seq=1 ttl=64 time=0.1 ms\n\
                [100.9] 64 bytes from 10.0.0.1: icmp_seq=2 ttl=64 time=300 ms\n\
                [101.0] no answer yet for icmp_seq=3\n\
                [101.1] no answer yet for icmp_seq=4\n\
                [101.2] 64 bytes from 10.0.0.1: icmp_seq=4 ttl=64 time=150 ms\n\
                [102.2] 64 bytes from 10.0.0.1: icmp_seq=5 ttl=64 time=0.2 ms\n";
    // seq 2 was sent at 100.6, before the moment; seq 4 was answered late, not lost.
    assert_eq!(recovery(text, 100.8), Some((101.2, 1)));
    assert_eq!(recovery(text, 101.1), Some((102.2, 0)));
    assert_eq!(recovery(text, 103.0), None);
}
