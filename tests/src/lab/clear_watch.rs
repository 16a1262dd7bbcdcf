//! Watching a window for clear pod traffic: a capture of every byte on the underlay while
//! each node's first pod pings the next node's first pod without pause (20 a second), every
//! echo carrying a marker. Encrypted, the marker never shows on the wire; any packet that
//! leaves a node in clear (a missing blackhole, a route via the underlay for a moment, a
//! device recreated before its peers) carries it, in the headers tcpdump prints or in the
//! bytes of the capture.

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context};

use super::capture::{leaks, wireguard_packets, UnderlayCapture};
use super::{run, Lab};
use crate::traffic::ping_summary;

/// The payload pattern of the watch's pings (`ping -p`): 16 bytes that encrypted traffic
/// shows with probability 2^-128.
pub const MARKER: &[u8; 16] = b"weft:clear-leak!";

/// A running watch; `finish` ends it and judges it.
pub struct ClearWatch {
    /// Taken by `finish`.
    capture: Option<UnderlayCapture>,
    streams: Vec<(String, Child, PathBuf)>,
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
        })
    }

    /// Stops the streams and the capture. Fails if the marker or a pod address was seen
    /// in clear, or if the window was not watched: no stream got an answer, or no
    /// WireGuard packet crossed the wire.
    pub fn finish(mut self) -> anyhow::Result<Watched> {
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
        let in_clear = bytes.windows(MARKER.len()).filter(|w| w == MARKER).count();
        let leaked = leaks(&text);
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

impl Drop for ClearWatch {
    /// A watch not finished (its test failed first) leaves no ping running.
    fn drop(&mut self) {
        for (_, child, _) in &mut self.streams {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
