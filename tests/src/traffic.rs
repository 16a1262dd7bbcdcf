//! Traffic that measures disruption, for the key-rotation tests: a TCP stream (a 1 KiB
//! write every 10 ms) from one pod to another, whose longest silence and whether it broke
//! are recorded, and a 100 pps ping beside it, whose unanswered count is recorded.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::netns::in_named_netns;

const PORT: u16 = 7400;

#[derive(Debug, Clone)]
pub struct Disruption {
    pub stream_bytes: u64,
    /// The longest time the receiver went without data.
    pub max_stall: Duration,
    /// How the stream ended if not cleanly (a reset, say).
    pub stream_error: Option<String>,
    pub pings_sent: u64,
    pub pings_lost: u64,
}

impl Disruption {
    /// Ping loss as time: lost packets at 100 per second.
    pub fn ping_loss(&self) -> Duration {
        Duration::from_millis(self.pings_lost * 10)
    }
}

impl std::fmt::Display for Disruption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TCP: {} bytes, longest stall {} ms, {}; ping at 100 pps: {} of {} lost ({} ms)",
            self.stream_bytes,
            self.max_stall.as_millis(),
            self.stream_error.as_deref().unwrap_or("no reset"),
            self.pings_lost,
            self.pings_sent,
            self.ping_loss().as_millis()
        )
    }
}

/// What the receiver saw: bytes, the longest silence, how it ended if not cleanly.
type Received = (u64, Duration, Option<String>);

pub struct Probe {
    stop: Arc<AtomicBool>,
    sender: JoinHandle<std::io::Result<std::io::Result<Option<String>>>>,
    receiver: JoinHandle<std::io::Result<std::io::Result<Received>>>,
    ping: Child,
}

impl Probe {
    /// Starts the stream and the ping from pod namespace `from` to `to_ip` (in pod
    /// namespace `to_ns`).
    pub fn start(from: &str, to_ns: &str, to_ip: impl Into<IpAddr>) -> anyhow::Result<Probe> {
        let to_ip: IpAddr = to_ip.into();
        let any: IpAddr = match to_ip {
            IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
            IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
        };
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let receiver = in_named_netns(
            to_ns,
            move || -> std::io::Result<(u64, Duration, Option<String>)> {
                let listener = TcpListener::bind((any, PORT))?;
                let _ = ready_tx.send(());
                let (mut conn, _) = listener.accept()?;
                let mut buf = [0u8; 65536];
                let (mut bytes, mut last, mut max_stall) = (0u64, Instant::now(), Duration::ZERO);
                loop {
                    match conn.read(&mut buf) {
                        Ok(0) => return Ok((bytes, max_stall, None)),
                        Ok(n) => {
                            bytes += n as u64;
                            max_stall = max_stall.max(last.elapsed());
                            last = Instant::now();
                        }
                        Err(e) => return Ok((bytes, max_stall, Some(e.to_string()))),
                    }
                }
            },
        );
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .map_err(|_| anyhow::anyhow!("the stream's receiver did not start"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let sender = in_named_netns(from, move || -> std::io::Result<Option<String>> {
            let mut conn = TcpStream::connect((to_ip, PORT))?;
            let chunk = [0x5au8; 1024];
            let t0 = Instant::now();
            let mut i = 0u32;
            while !stopping.load(Ordering::Relaxed) {
                if let Err(e) = conn.write_all(&chunk) {
                    return Ok(Some(e.to_string()));
                }
                i += 1;
                let next = t0 + Duration::from_millis(10) * i;
                if let Some(wait) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            conn.shutdown(std::net::Shutdown::Write)?;
            Ok(None)
        });
        let ping = Command::new("ip")
            .args(["netns", "exec", from, "ping", "-i", "0.01", "-q"])
            .arg(to_ip.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        // Let both settle before anything happens.
        std::thread::sleep(Duration::from_millis(500));
        Ok(Probe {
            stop,
            sender,
            receiver,
            ping,
        })
    }

    /// Stops both and reports.
    pub fn finish(self) -> anyhow::Result<Disruption> {
        self.stop.store(true, Ordering::Relaxed);
        let _ = Command::new("kill")
            .args(["-INT", &self.ping.id().to_string()])
            .status();
        let out = self.ping.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let (sent, received) = ping_summary(&text)
            .ok_or_else(|| anyhow::anyhow!("ping printed no summary: {text:?}"))?;
        let (sent, received) = (sent as u64, received as u64);
        let send_error = match self.sender.join() {
            Ok(Ok(Ok(e))) => e,
            Ok(Ok(Err(e))) | Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some("the sender panicked".into()),
        };
        let (bytes, stall, recv_error) = match self.receiver.join() {
            Ok(Ok(Ok(r))) => r,
            Ok(Ok(Err(e))) | Ok(Err(e)) => (0, Duration::ZERO, Some(e.to_string())),
            Err(_) => (0, Duration::ZERO, Some("the receiver panicked".into())),
        };
        Ok(Disruption {
            stream_bytes: bytes,
            max_stall: stall,
            stream_error: send_error.or(recv_error),
            pings_sent: sent,
            pings_lost: sent.saturating_sub(received),
        })
    }
}

/// `(transmitted, received)` from ping's summary line ("N packets transmitted, M received,
/// …"); `None` without one.
pub fn ping_summary(text: &str) -> Option<(usize, usize)> {
    let line = text.lines().find(|l| l.contains("packets transmitted"))?;
    let mut numbers = line
        .split(',')
        .filter_map(|part| part.split_whitespace().next()?.parse::<usize>().ok());
    Some((numbers.next()?, numbers.next()?))
}

#[cfg(test)]
mod summary_tests {
    #[test]
    fn ping_summaries_are_read() {
        let text = "64 bytes from 10.244.2.2\n\n--- 10.244.2.2 ping statistics ---\n\
                    41 packets transmitted, 39 received, 4.87805% packet loss, time 2003ms\n";
        assert_eq!(super::ping_summary(text), Some((41, 39)));
        let errors = "5 packets transmitted, 3 received, +2 errors, 40% packet loss, time 4004ms";
        assert_eq!(super::ping_summary(errors), Some((5, 3)));
        assert_eq!(super::ping_summary("no summary"), None);
    }
}
