//! A packet capture on the lab's first underlay segment (tcpdump on the fabric's `br0`),
//! for proving what crosses the wire: that pod traffic goes only inside WireGuard; or on
//! any interface of the lab.

use std::fs;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};

use super::{run, Lab};

pub struct UnderlayCapture {
    child: Child,
    file: PathBuf,
    log: PathBuf,
    /// When tcpdump was listening.
    pub started: SystemTime,
}

impl UnderlayCapture {
    /// Starts capturing on the fabric's `br0`; returns once tcpdump says it is listening.
    pub fn start(lab: &Lab) -> anyhow::Result<UnderlayCapture> {
        Self::start_on(lab, &lab.fabric(), "br0", &[])
    }

    /// Starts capturing on `iface` in namespace `ns`, the packets `filter` (tcpdump's
    /// expression, word by word) selects; returns once tcpdump says it is listening.
    pub fn start_on(
        lab: &Lab,
        ns: &str,
        iface: &str,
        filter: &[&str],
    ) -> anyhow::Result<UnderlayCapture> {
        let file = lab.dir().join(format!("{ns}-{iface}.pcap"));
        let log = lab.dir().join(format!("{ns}-{iface}.tcpdump.log"));
        let child = Command::new("ip")
            .args(["netns", "exec", ns, "tcpdump", "-Z", "root"])
            .args(["--immediate-mode", "-i", iface, "-nn", "-U", "-w"])
            .arg(&file)
            .args(filter)
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log)?)
            .spawn()
            .context("starting tcpdump")?;
        let mut capture = UnderlayCapture {
            child,
            file,
            log,
            started: SystemTime::now(),
        };
        // Listening, or exited (an error at once, not after the 10 s).
        let started = crate::wait::first_within(Duration::from_secs(10), || {
            if capture.log_text().contains("listening on") {
                return Some(Ok(()));
            }
            match capture.child.try_wait() {
                Ok(None) => None,
                Ok(Some(status)) => Some(Err(anyhow::anyhow!("tcpdump exited ({status})"))),
                Err(e) => Some(Err(e.into())),
            }
        });
        match started {
            Some(Ok(())) => {}
            Some(Err(e)) => bail!("{e}: {}", capture.log_text()),
            None => bail!(
                "tcpdump did not start listening in 10 s: {}",
                capture.log_text()
            ),
        }
        capture.started = SystemTime::now();
        Ok(capture)
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops the capture; returns it as tcpdump's text, one packet a line.
    pub fn finish(self) -> anyhow::Result<String> {
        Ok(self.finish_with_bytes()?.0)
    }

    /// Stops the capture; returns tcpdump's text and the capture file's bytes (every
    /// packet whole, payloads included).
    pub fn finish_with_bytes(mut self) -> anyhow::Result<(String, Vec<u8>)> {
        run(Command::new("kill").args(["-INT", &self.child.id().to_string()]))?;
        self.child.wait()?;
        let out = run(Command::new("tcpdump").args(["-nn", "-r"]).arg(&self.file))?;
        let bytes =
            fs::read(&self.file).with_context(|| format!("reading {}", self.file.display()))?;
        Ok((String::from_utf8_lossy(&out.stdout).into_owned(), bytes))
    }
}

impl Drop for UnderlayCapture {
    /// A capture not finished (its test failed first) leaves no tcpdump running.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Fails unless the capture shows no pod address in clear and more than `min` WireGuard
/// packets (traffic went through the tunnels, and was seen).
pub fn assert_tunnelled(text: &str, min: usize) {
    let leaks = leaks(text);
    assert!(
        leaks.is_empty(),
        "pod addresses seen in clear on the underlay:\n{}",
        leaks.join("\n")
    );
    let wireguard = wireguard_packets(text);
    assert!(
        wireguard > min,
        "expected WireGuard traffic on the underlay, saw {wireguard} packets:\n{text}"
    );
}

/// The captured packets that show a pod address of either family in clear.
pub fn leaks(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| l.contains("10.244.") || l.contains("fd00:10:244:"))
        .collect()
}

/// How many captured packets are WireGuard's (UDP to or from port 51820, or 51821, the
/// IPv6 device's).
pub fn wireguard_packets(text: &str) -> usize {
    text.lines()
        .filter(|l| {
            [".51820", ".51821"]
                .iter()
                .any(|p| l.contains(&format!("{p}: UDP")) || l.contains(&format!("{p} > ")))
        })
        .count()
}

/// How many captured packets are ESP: in IP protocol 50 (`proto50`), or in UDP port 4500.
pub fn esp_packets(text: &str) -> (usize, usize) {
    let esp = text.lines().filter(|l| l.contains("ESP(spi="));
    let in_udp = esp.clone().filter(|l| l.contains("UDP-encap")).count();
    (esp.count() - in_udp, in_udp)
}

/// One packet of a capture file: when it was captured, and its bytes from the link layer on.
pub struct Record<'a> {
    pub at: SystemTime,
    pub frame: &'a [u8],
}

/// The packets of a pcap file (as tcpdump writes it: either byte order, micro- or
/// nanosecond timestamps).
pub fn records(pcap: &[u8]) -> anyhow::Result<Vec<Record<'_>>> {
    let word = |b: &[u8], big: bool| {
        let b: [u8; 4] = b.try_into().unwrap_or_default();
        if big {
            u32::from_be_bytes(b)
        } else {
            u32::from_le_bytes(b)
        }
    };
    let Some(magic) = pcap.get(..4) else {
        bail!("a capture file of {} bytes has no header", pcap.len());
    };
    let (big, nanos) = match word(magic, false) {
        0xa1b2_c3d4 => (false, false),
        0xa1b2_3c4d => (false, true),
        _ => match word(magic, true) {
            0xa1b2_c3d4 => (true, false),
            0xa1b2_3c4d => (true, true),
            m => bail!("not a pcap file (magic {m:#x})"),
        },
    };
    let mut out = Vec::new();
    let mut at = 24;
    while let Some(header) = pcap.get(at..at + 16) {
        let secs = u64::from(word(&header[0..4], big));
        let frac = u64::from(word(&header[4..8], big));
        let len = word(&header[8..12], big) as usize;
        let Some(frame) = pcap.get(at + 16..at + 16 + len) else {
            break; // the last packet, cut short when tcpdump stopped
        };
        let since = Duration::from_secs(secs)
            + if nanos {
                Duration::from_nanos(frac)
            } else {
                Duration::from_micros(frac)
            };
        out.push(Record {
            at: SystemTime::UNIX_EPOCH + since,
            frame,
        });
        at += 16 + len;
    }
    Ok(out)
}

/// The source address of an Ethernet frame carrying IPv4 or IPv6.
pub fn ip_source(frame: &[u8]) -> Option<IpAddr> {
    let ethertype = u16::from_be_bytes(frame.get(12..14)?.try_into().ok()?);
    match ethertype {
        0x0800 => Some(IpAddr::from(<[u8; 4]>::try_from(frame.get(26..30)?).ok()?)),
        0x86dd => Some(IpAddr::from(<[u8; 16]>::try_from(frame.get(22..38)?).ok()?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_sources_are_read_from_a_pcap_file() {
        let mut pcap = vec![0xd4, 0xc3, 0xb2, 0xa1, 2, 0, 4, 0];
        pcap.extend([0u8; 16]);
        let mut frame = vec![0u8; 12];
        frame.extend([0x08, 0x00]);
        frame.extend([0x45; 12]);
        frame.extend([10, 244, 3, 2, 10, 244, 1, 2]);
        for (secs, micros) in [(1_000u32, 5u32), (1_001, 7)] {
            pcap.extend(secs.to_le_bytes());
            pcap.extend(micros.to_le_bytes());
            pcap.extend((frame.len() as u32).to_le_bytes());
            pcap.extend((frame.len() as u32).to_le_bytes());
            pcap.extend(&frame);
        }
        // A last record cut short is left out.
        pcap.extend([1, 2, 3]);
        let got = records(&pcap).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[1].at,
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_001) + Duration::from_micros(7)
        );
        assert_eq!(ip_source(got[0].frame), Some("10.244.3.2".parse().unwrap()));
        assert!(records(b"not a capture").is_err());
    }
}
