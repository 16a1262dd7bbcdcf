//! A packet capture on the lab's first underlay segment (tcpdump on the fabric's `br0`),
//! for proving what crosses the wire: that pod traffic goes only inside WireGuard; or on
//! any interface of the lab.

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::{run, Lab};

pub struct UnderlayCapture {
    child: Child,
    file: PathBuf,
    log: PathBuf,
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
        let mut capture = UnderlayCapture { child, file, log };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !capture.log_text().contains("listening on") {
            if let Some(status) = capture.child.try_wait()? {
                bail!("tcpdump exited ({status}): {}", capture.log_text());
            }
            if Instant::now() > deadline {
                bail!(
                    "tcpdump did not start listening in 10 s: {}",
                    capture.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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
