//! Faults on one pair of a lab's nodes, for the liveness tests and benchmark: each is made
//! while a pod of node 0 pings a pod of node 1 ten times a second (the faulted pair) and
//! another pod of node 0 pings node 2 (the other pair), and measured: when the agent named
//! it in its log, when traffic came back (after the fault, or after it was lifted), and
//! what the other pair lost meanwhile.

use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};

use crate::freeze::{freeze, thread_named, Frozen};
use crate::lab::Lab;
use crate::pinger::{unix_now, Pinger};
use crate::wait::{first_within, holds_within};

/// Pings a second on each pair.
pub const PPS: u64 = 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Node 0's endpoint for node 1 set to an address where nothing answers.
    WrongEndpoint,
    /// Node 0's endpoint for node 1: the right address, a wrong port.
    WrongPort,
    /// Both nodes' endpoints for each other set wrong.
    BothWrong,
    /// Node 0 learned node 1's port from a NAT mapping (a real roam), and the mapping goes.
    StaleNat,
    /// Node 0's AllowedIPs for node 1 changed by hand.
    AllowedIps,
    /// Node 0's entry for node 1 replaced by one with another key.
    KeyReplaced,
    /// Node 1's listen port changed by hand.
    ListenPort,
    /// UDP between nodes 0 and 1 dropped for 20 s, then allowed.
    Firewall,
    /// Node 1's device process stopped (SIGSTOP).
    DeviceStopped,
    /// Node 1's device's receiving thread stopped alone (ptrace).
    ThreadStalled,
    /// Node 1's device's UDP sockets destroyed (`ss -K`).
    SocketsDestroyed,
}

/// The faults by the lab they share (each group on a fresh 3-node lab, one after the other).
pub const GROUPS: [&[Fault]; 4] = [
    &[
        Fault::WrongEndpoint,
        Fault::WrongPort,
        Fault::BothWrong,
        Fault::StaleNat,
    ],
    &[Fault::AllowedIps, Fault::KeyReplaced, Fault::ListenPort],
    &[Fault::Firewall],
    &[
        Fault::DeviceStopped,
        Fault::ThreadStalled,
        Fault::SocketsDestroyed,
    ],
];

/// What one fault showed.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    pub fault: Fault,
    /// From the fault to the agent's log naming it.
    pub named: Duration,
    /// From the fault (or its end, for a firewall) to the first reply on the faulted pair.
    pub back: Duration,
    /// Pings the other pair lost meanwhile.
    pub other_lost: u64,
}

/// How long the firewall lasts.
pub const FIREWALL: Duration = Duration::from_secs(20);

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::WrongEndpoint => "wrong endpoint",
            Fault::WrongPort => "right address, wrong port",
            Fault::BothWrong => "both nodes pointed at wrong addresses",
            Fault::StaleNat => "roamed endpoint (NAT mapping) stops answering",
            Fault::AllowedIps => "AllowedIPs changed",
            Fault::KeyReplaced => "peer key replaced",
            Fault::ListenPort => "listen port changed",
            Fault::Firewall => "UDP dropped for 20 s",
            Fault::DeviceStopped => "device process stopped (SIGSTOP)",
            Fault::ThreadStalled => "device's receiving thread stalled",
            Fault::SocketsDestroyed => "device's sockets destroyed (ss -K)",
        }
    }

    /// The userspace device's own faults (a kernel device has no process).
    pub fn userspace_only(self) -> bool {
        matches!(
            self,
            Fault::DeviceStopped | Fault::ThreadStalled | Fault::SocketsDestroyed
        )
    }

    /// The node whose agent names the fault, and what its log says.
    pub fn named(self) -> (usize, &'static str) {
        match self {
            Fault::WrongEndpoint | Fault::WrongPort | Fault::BothWrong | Fault::Firewall => {
                (0, "pair dead")
            }
            Fault::StaleNat => (0, "roamed endpoint unanswered"),
            Fault::AllowedIps | Fault::KeyReplaced => (0, "the device differs from the plan"),
            Fault::ListenPort => (1, "the device differs from the plan"),
            Fault::DeviceStopped => (1, "the device does not answer"),
            Fault::ThreadStalled => (1, "has not moved for"),
            Fault::SocketsDestroyed => (1, "the device cannot go on"),
        }
    }

    /// What comes before the fault: the NAT that node 0 roams through.
    fn prepare(self, lab: &Lab) -> anyhow::Result<()> {
        if self != Fault::StaleNat {
            return Ok(());
        }
        let (ip0, ip1) = (lab.nodes[0].ip, lab.nodes[1].ip);
        lab.on_node(
            1,
            &format!(
                "nft add table ip weft-fault && \
                 nft add chain ip weft-fault post '{{ type nat hook postrouting priority 100; }}' && \
                 nft add chain ip weft-fault pre '{{ type filter hook prerouting priority -300; }}' && \
                 nft add rule ip weft-fault post ip daddr {ip0} udp sport 51820 snat to {ip1}:40000 && \
                 {{ conntrack -D -p udp --orig-port-src 51820 >/dev/null 2>&1; true; }}"
            ),
        )?;
        let pod0 = lab.nodes[0].pods[0].ip;
        crate::lab::in_ns(
            &lab.nodes[1].pods[0].ns,
            &format!("ping -c 3 -i 0.2 -q {pod0}"),
        )?;
        let mapped = format!("{ip1}:40000");
        // The mapped endpoint, or the first error reading it.
        let roamed = first_within(Duration::from_secs(10), || match endpoint_of(lab, 0, 1) {
            Ok(e) if e != mapped => None,
            read => Some(read),
        });
        match roamed {
            Some(read) => read.map(drop),
            None => bail!("node 0 did not roam to node 1's mapped port {mapped}"),
        }
    }

    /// Makes the fault; a stalled thread stays stopped until the freeze is thawed.
    fn make(self, lab: &Lab) -> anyhow::Result<Option<Frozen>> {
        let key = |i| lab.wg_public_key(i);
        let ip1 = lab.nodes[1].ip;
        let set = |on: usize, script: String| lab.on_node(on, &script).map(drop);
        match self {
            Fault::WrongEndpoint => set(
                0,
                format!("wg set flannel-wg peer {} endpoint 192.0.2.77:51820", key(1)?),
            )?,
            Fault::WrongPort => set(
                0,
                format!("wg set flannel-wg peer {} endpoint {ip1}:51999", key(1)?),
            )?,
            Fault::BothWrong => {
                set(
                    0,
                    format!("wg set flannel-wg peer {} endpoint 192.0.2.77:51820", key(1)?),
                )?;
                set(
                    1,
                    format!("wg set flannel-wg peer {} endpoint 192.0.2.78:51820", key(0)?),
                )?;
            }
            Fault::StaleNat => stale_nat(lab)?,
            Fault::AllowedIps => set(
                0,
                format!(
                    "wg set flannel-wg peer {} allowed-ips 10.244.250.0/24",
                    key(1)?
                ),
            )?,
            Fault::KeyReplaced => {
                let subnet = lab.nodes[1].subnet.context("node 1 has no subnet")?;
                set(
                    0,
                    format!(
                        "wg set flannel-wg peer {} remove && \
                         wg set flannel-wg peer $(wg genkey | wg pubkey) allowed-ips {subnet} endpoint {ip1}:51820",
                        key(1)?
                    ),
                )?;
            }
            Fault::ListenPort => set(1, "wg set flannel-wg listen-port 51999".into())?,
            Fault::Firewall => set(
                0,
                format!(
                    "nft add table inet weft-fault && \
                     nft add chain inet weft-fault out '{{ type filter hook output priority 0; }}' && \
                     nft add chain inet weft-fault in '{{ type filter hook input priority 0; }}' && \
                     nft add rule inet weft-fault out ip daddr {ip1} udp dport 51820 drop && \
                     nft add rule inet weft-fault in ip saddr {ip1} udp sport 51820 drop"
                ),
            )?,
            Fault::DeviceStopped => set(1, format!("kill -STOP {}", device_pid(lab)?))?,
            Fault::ThreadStalled => {
                let pid = device_pid(lab)?;
                let tid = thread_named(pid, "wg-rx4")
                    .with_context(|| format!("no wg-rx4 thread in process {pid}"))?;
                return freeze(tid).map(Some);
            }
            Fault::SocketsDestroyed => set(1, "ss -K -u -a sport = :51820 >/dev/null".into())?,
        }
        Ok(None)
    }

    /// Whether the fault is lifted after a while (traffic back counts from then).
    pub fn lifts(self) -> bool {
        self.lift().is_some()
    }

    /// Lifts a fault that lasts a while: after how long, and the script on node 0.
    fn lift(self) -> Option<(Duration, &'static str)> {
        (self == Fault::Firewall).then_some((FIREWALL, "nft delete table inet weft-fault"))
    }

    /// Makes this fault on `lab`'s pair 0–1 and measures it. Errors if the agent does not
    /// name it within `name_limit`, or traffic is not back within `back_limit`.
    pub fn measure(
        self,
        lab: &Lab,
        (name_limit, back_limit): (Duration, Duration),
    ) -> anyhow::Result<Measured> {
        self.prepare(lab)?;
        let interval = Duration::from_millis(1000 / PPS);
        let faulted = Pinger::start(&lab.nodes[0].pods[0].ns, lab.nodes[1].pods[0].ip, interval)?;
        let other = Pinger::start(&lab.nodes[0].pods[1].ns, lab.nodes[2].pods[0].ip, interval)?;
        let before = unix_now();
        for p in [&faulted, &other] {
            if p.wait_reply_after(before, Duration::from_secs(10))
                .is_none()
            {
                bail!("{}: no traffic before the fault", self.name());
            }
        }
        let pid_before = match self.userspace_only() {
            true => Some(device_pid(lab)?),
            false => None,
        };
        let since = SystemTime::now();
        let t0 = unix_now();
        let frozen = self.make(lab)?;
        let (on, needle) = self.named();
        let node = &lab.nodes[on];
        let Some(named_at) = first_within(name_limit, || node.logged_since(needle, since)) else {
            // What the node did instead, first: CI's summary keeps a failure's first lines.
            bail!(
                "{}: node {on} did not log '{needle}' within {name_limit:?}; it logged since \
                 the fault:\n{}\nand its status says:\n{}",
                self.name(),
                node.lines_since(since, 30).join("\n"),
                lab.status(on)
            );
        };
        let mut from = t0;
        if let Some((after, script)) = self.lift() {
            let elapsed = Duration::from_secs_f64(unix_now() - t0);
            std::thread::sleep(after.saturating_sub(elapsed));
            from = unix_now();
            lab.on_node(0, script)?;
        }
        let back = faulted.wait_reply_after(from, back_limit);
        if let Some(f) = frozen {
            f.thaw();
        }
        if self == Fault::DeviceStopped {
            // Resumed if it was not replaced (it was: the test says so).
            let _ = lab.on_node(1, "pkill -CONT -f 'userspace-device flannel-wg'; true");
        }
        let back =
            back.with_context(|| format!("{}: no traffic within {back_limit:?}", self.name()))?;
        if let Some(before) = pid_before {
            // The faulty process is gone and one new device process serves the device.
            let replaced = holds_within(Duration::from_secs(5), || {
                let pids = lab.device_pids(1);
                pids != [before] && pids.len() == 1
            });
            if !replaced {
                bail!(
                    "{}: node 1's device process {before} was not replaced: {:?}",
                    self.name(),
                    lab.device_pids(1)
                );
            }
        }
        let other_lost = other.lost_between(t0, unix_now());
        faulted.finish()?;
        other.finish()?;
        Ok(Measured {
            fault: self,
            named: named_at.duration_since(since).unwrap_or_default(),
            back,
            other_lost,
        })
    }
}

/// Node 1's one device process.
fn device_pid(lab: &Lab) -> anyhow::Result<u32> {
    match lab.device_pids(1).as_slice() {
        [pid] => Ok(*pid),
        pids => bail!("node 1 runs {} device processes: {pids:?}", pids.len()),
    }
}

/// The endpoint node `on`'s device holds for node `peer`.
pub fn endpoint_of(lab: &Lab, on: usize, peer: usize) -> anyhow::Result<String> {
    let key = lab.wg_public_key(peer)?;
    Ok(lab
        .on_node(on, "wg show flannel-wg endpoints")?
        .lines()
        .find(|l| l.starts_with(&key))
        .and_then(|l| l.split_whitespace().nth(1).map(str::to_string))
        .unwrap_or_default())
}

impl std::fmt::Display for Measured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: named after {:.1} s, traffic back {:.1} s after the fault{}, other pair lost {} pings",
            self.fault.name(),
            self.named.as_secs_f64(),
            self.back.as_secs_f64(),
            if self.fault.lifts() { " ended" } else { "" },
            self.other_lost
        )
    }
}

/// The NAT mapping node 0 roamed to goes, and node 1 stays silent, as a peer behind an
/// expired mapping does until it has something to send: first node 0's packets to the
/// mapped port stop reaching node 1 (dropped before conntrack), and once one has been
/// dropped, every reply node 1 owed has left through the mapping; only then does the
/// mapping go. Removed in the other order, a reply to a request that came in just before
/// left from node 1's own port, node 0 roamed back to it on that authenticated packet and
/// the pair healed before node 0 could call it dead (the VM once: nothing named in 10 s).
fn stale_nat(lab: &Lab) -> anyhow::Result<()> {
    let ip0 = lab.nodes[0].ip;
    lab.on_node(
        1,
        &format!("nft add rule ip weft-fault pre ip saddr {ip0} udp dport 40000 counter drop"),
    )?;
    let dropped = || {
        let chain = lab
            .on_node(1, "nft list chain ip weft-fault pre")
            .unwrap_or_default();
        chain
            .split_whitespace()
            .skip_while(|w| *w != "packets")
            .nth(1)
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n > 0)
    };
    if !holds_within(Duration::from_secs(5), dropped) {
        bail!("none of node 0's packets to the mapped port reached the drop on node 1");
    }
    lab.on_node(
        1,
        "nft delete chain ip weft-fault post && \
         { conntrack -D -p udp --orig-port-src 51820 >/dev/null 2>&1; true; }",
    )
    .map(drop)
}
