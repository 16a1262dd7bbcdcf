//! Watching a window for clear pod traffic: a capture of every byte on the underlay while
//! each node's first pod pings the next node's first pod without pause (20 a second), every
//! echo carrying a marker. Encrypted, the marker never shows on the wire; any packet that
//! leaves a node in clear (a missing blackhole, a route via the underlay for a moment, a
//! device recreated before its peers) carries it, in the headers tcpdump prints or in the
//! bytes of the capture.

use std::fs;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use ipnet::IpNet;

use super::capture::{ip_source, leaks, records, wireguard_packets, UnderlayCapture};
use super::{run, Lab};
use crate::traffic::ping_summary;
use crate::wait::{bound, holds_within};

/// The payload pattern of the watch's pings (`ping -p`): 16 bytes that encrypted traffic
/// shows with probability 2^-128.
pub const MARKER: &[u8; 16] = b"weft:clear-leak!";

/// A running watch; `finish` ends it and judges it.
pub struct ClearWatch {
    /// Taken by `finish`.
    capture: Option<UnderlayCapture>,
    streams: Vec<(String, Child, PathBuf)>,
    /// When the capture was listening.
    started: SystemTime,
}

/// What a watch saw: every stream's sent and answered echoes, and the tunnel packets.
#[derive(Debug)]
pub struct Watched {
    pub sent: usize,
    pub answered: usize,
    pub wireguard: usize,
    /// ESP packets in IP protocol 50, and in UDP port 4500.
    pub esp: usize,
    pub esp_in_udp: usize,
}

impl ClearWatch {
    /// Starts the capture (returning once tcpdump listens), then the pod streams.
    pub fn start(lab: &Lab) -> anyhow::Result<ClearWatch> {
        let capture = UnderlayCapture::start(lab)?;
        Self::with_capture(lab, capture)
    }

    /// Starts the pod streams under a capture already running (one started before the
    /// lab's agents, to watch the lab's start).
    pub fn with_capture(lab: &Lab, capture: UnderlayCapture) -> anyhow::Result<ClearWatch> {
        let started = capture.started;
        let pattern: String = MARKER.iter().map(|b| format!("{b:02x}")).collect();
        let mut streams = Vec::new();
        let count = lab.nodes.len();
        // A node pinging itself proves nothing: one node, no streams (and `finish` fails).
        for (i, node) in lab.nodes.iter().enumerate().filter(|_| count > 1) {
            let peer = &lab.nodes[(i + 1) % count];
            let (Some(from), Some(to)) = (node.pods.first(), peer.pods.first()) else {
                continue;
            };
            // Each of the pod's addresses: IPv4, and IPv6 in a dual-stack lab.
            let targets = std::iter::once(std::net::IpAddr::V4(to.ip))
                .filter(|ip| !ip.is_unspecified())
                .chain(to.ip6.map(Into::into));
            for (family, target) in targets.enumerate() {
                let label = format!("{} ({}) -> {target} ({})", from.ns, node.index, peer.index);
                let out = lab
                    .dir()
                    .join(format!("watch-{}-{family}.ping", node.index));
                let child = Command::new("ip")
                    .args(["netns", "exec", &from.ns, "ping", "-n", "-i", "0.05", "-p"])
                    .arg(&pattern)
                    .arg(target.to_string())
                    .stdout(fs::File::create(&out)?)
                    .stderr(Stdio::null())
                    .spawn()
                    .context("starting a watch stream")?;
                streams.push((label, child, out));
            }
        }
        Ok(ClearWatch {
            capture: Some(capture),
            streams,
            started,
        })
    }

    /// Stops the streams and the capture. Fails if the marker or a pod address was seen
    /// in clear, or if the window was not watched: no stream got an answer, or no
    /// WireGuard packet crossed the wire.
    pub fn finish(self) -> anyhow::Result<Watched> {
        self.judge(None)
    }

    /// As `finish`, for a window in which nodes move onto an encrypting backend from one
    /// that is not: a node's pods' packets (by source address, each node's pod subnets in
    /// `seals`) count as a leak from the moment that node sealed its pod networks on, not
    /// before (until then it ran the unencrypted backend, in clear by design). The watch
    /// must have started before the first seal.
    pub fn finish_from_seals(self, seals: &[(IpNet, SystemTime)]) -> anyhow::Result<Watched> {
        self.judge(Some(seals))
    }

    /// When the capture was listening.
    pub fn started(&self) -> SystemTime {
        self.started
    }

    fn judge(mut self, seals: Option<&[(IpNet, SystemTime)]>) -> anyhow::Result<Watched> {
        // A short window (a device back in milliseconds) may end before a stream's first
        // answer: the watch goes on until every stream has one (ping prints each reply as
        // it comes), or the bound passes and the silent streams fail it below.
        let answered_once = |out: &std::path::Path| {
            fs::read_to_string(out).is_ok_and(|text| text.contains(" bytes from "))
        };
        let limit = bound(Duration::from_secs(5), Duration::from_secs(10));
        holds_within(limit, || {
            self.streams.iter().all(|(_, _, out)| answered_once(out))
        });
        let mut sent = 0;
        let mut answered = 0;
        let mut silent = Vec::new();
        for (label, mut child, out) in std::mem::take(&mut self.streams) {
            run(Command::new("kill").args(["-INT", &child.id().to_string()]))?;
            child.wait()?;
            let text = fs::read_to_string(&out).unwrap_or_default();
            let (s, a) = ping_summary(&text)
                .with_context(|| format!("stream {label} printed no summary: {text}"))?;
            if a == 0 {
                silent.push(label);
            }
            sent += s;
            answered += a;
        }
        let capture = self.capture.take().context("the watch's capture")?;
        let (text, bytes) = capture.finish_with_bytes()?;
        let (in_clear, leaked) = match seals {
            None => (
                bytes.windows(MARKER.len()).filter(|w| w == MARKER).count(),
                leaks(&text).into_iter().map(str::to_string).collect(),
            ),
            Some(seals) => self.leaks_after(&bytes, seals)?,
        };
        if in_clear > 0 || !leaked.is_empty() {
            bail!(
                "clear pod traffic on the underlay: the marker {in_clear} times; packets with a pod address:\n{}",
                leaked.join("\n")
            );
        }
        let wireguard = wireguard_packets(&text);
        let (esp, esp_in_udp) = super::capture::esp_packets(&text);
        if !silent.is_empty() || wireguard + esp + esp_in_udp == 0 {
            bail!(
                "the window was not watched: streams with no answer {silent:?}, {wireguard} WireGuard packets, {} ESP packets",
                esp + esp_in_udp
            );
        }
        Ok(Watched {
            sent,
            answered,
            wireguard,
            esp,
            esp_in_udp,
        })
    }
}

impl ClearWatch {
    /// The marker's count and the pod-addressed packets in clear, each counted only from
    /// its node's seal on.
    fn leaks_after(
        &self,
        pcap: &[u8],
        seals: &[(IpNet, SystemTime)],
    ) -> anyhow::Result<(usize, Vec<String>)> {
        let first = seals.iter().map(|s| s.1).min().context("no seals")?;
        if self.started > first {
            bail!("the watch started after a node sealed: the window was not watched whole");
        }
        let last = seals.iter().map(|s| s.1).max().unwrap_or(first);
        let pod = |ip: &IpAddr| POD_NETWORKS.iter().any(|n| n.contains(ip));
        let (mut markers, mut leaked) = (0, Vec::new());
        for r in records(pcap)? {
            let source = ip_source(r.frame);
            let marked = r.frame.windows(MARKER.len()).any(|w| w == MARKER);
            if !marked && !source.as_ref().is_some_and(pod) {
                continue;
            }
            let sealed = source
                .and_then(|ip| seals.iter().find(|(net, _)| net.contains(&ip)))
                .map_or(last, |s| s.1);
            if r.at >= sealed {
                markers += usize::from(marked);
                let after = r.at.duration_since(sealed).unwrap_or_default();
                leaked.push(format!("from {source:?}, {after:?} after its node sealed"));
            }
        }
        Ok((markers, leaked))
    }
}

/// The lab's pod networks, both families.
const POD_NETWORKS: [IpNet; 2] = [
    IpNet::V4(ipnet::Ipv4Net::new_assert(
        std::net::Ipv4Addr::new(10, 244, 0, 0),
        16,
    )),
    IpNet::V6(ipnet::Ipv6Net::new_assert(
        std::net::Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0),
        48,
    )),
];

impl Drop for ClearWatch {
    /// A watch not finished (its test failed first) leaves no ping running.
    fn drop(&mut self) {
        for (_, child, _) in &mut self.streams {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
