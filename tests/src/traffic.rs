//! Traffic that measures disruption, for the key-rotation tests: a TCP stream (a 1 KiB
//! write every 10 ms) from one pod to another, whose longest silence and whether it broke
//! are recorded, and a 100 pps ping beside it, whose unanswered count is recorded.

use std::io::{BufRead, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::netns::in_named_netns;
use crate::pinger::unix_now;

const PORT: u16 = 7400;

#[derive(Debug, Clone)]
pub struct Disruption {
    pub stream_bytes: u64,
    /// The longest time the receiver went without data.
    pub max_stall: Duration,
    /// When that stall began (seconds since the Unix epoch), to set beside the agents' logs.
    pub stall_from_unix_s: Option<f64>,
    /// How the stream ended if not cleanly (a reset, say).
    pub stream_error: Option<String>,
    pub pings_sent: u64,
    pub pings_lost: u64,
    /// The longest run of unanswered pings: how many, and when the first of them was sent
    /// (seconds since the Unix epoch, from ping's `-D`), to set beside the agents' logs.
    pub longest_hole: Option<Hole>,
}

/// A run of consecutive unanswered pings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hole {
    pub pings: u64,
    pub from_unix_s: f64,
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
            "TCP: {} bytes, longest stall {} ms{}, {}; ping at 100 pps: {} of {} lost ({} ms)",
            self.stream_bytes,
            self.max_stall.as_millis(),
            self.stall_from_unix_s
                .map(|t| format!(" from {t:.3}"))
                .unwrap_or_default(),
            self.stream_error.as_deref().unwrap_or("no reset"),
            self.pings_lost,
            self.pings_sent,
            self.ping_loss().as_millis()
        )?;
        if let Some(h) = self.longest_hole {
            write!(
                f,
                ", longest hole {} pings from {:.3} (Unix time)",
                h.pings, h.from_unix_s
            )?;
        }
        Ok(())
    }
}

/// What the receiver saw.
#[derive(Default)]
struct Received {
    bytes: u64,
    /// The longest silence, and when it began (Unix seconds).
    stall: Duration,
    stall_from: Option<f64>,
    /// How the stream ended if not cleanly.
    error: Option<String>,
}

impl Received {
    fn failed(error: String) -> Received {
        Received {
            error: Some(error),
            ..Received::default()
        }
    }
}

pub struct Probe {
    stop: Arc<AtomicBool>,
    sender: JoinHandle<std::io::Result<std::io::Result<Option<String>>>>,
    receiver: JoinHandle<std::io::Result<std::io::Result<Received>>>,
    ping: Child,
    ping_output: JoinHandle<(Vec<(u64, f64)>, String)>,
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
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let receiver = in_named_netns(to_ns, move || -> std::io::Result<Received> {
            let listener = TcpListener::bind((any, PORT))?;
            let _ = ready_tx.send(());
            // A connection that never comes (the path was down at the start) ends the
            // wait once the probe is stopped, rather than holding `finish` for ever.
            listener.set_nonblocking(true)?;
            let mut conn = loop {
                match listener.accept() {
                    Ok((conn, _)) => break conn,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if stopped.load(Ordering::Relaxed) {
                            return Ok(Received::failed("no connection came".into()));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(e),
                }
            };
            conn.set_nonblocking(false)?;
            conn.set_read_timeout(Some(Duration::from_secs(30)))?;
            let mut buf = [0u8; 65536];
            let mut got = Received::default();
            let (mut last, mut last_unix) = (Instant::now(), unix_now());
            loop {
                match conn.read(&mut buf) {
                    Ok(0) => return Ok(got),
                    Ok(n) => {
                        got.bytes += n as u64;
                        if last.elapsed() > got.stall {
                            got.stall = last.elapsed();
                            got.stall_from = Some(last_unix);
                        }
                        (last, last_unix) = (Instant::now(), unix_now());
                    }
                    Err(e) => {
                        got.error = Some(e.to_string());
                        return Ok(got);
                    }
                }
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .map_err(|_| anyhow::anyhow!("the stream's receiver did not start"))?;
        let stopping = stop.clone();
        let sender = in_named_netns(from, move || -> std::io::Result<Option<String>> {
            let mut conn = TcpStream::connect((to_ip, PORT))?;
            // A stream stalled this long is an error to report, not a hang.
            conn.set_write_timeout(Some(Duration::from_secs(30)))?;
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
        let mut ping = Command::new("ip")
            .args(["netns", "exec", from, "ping", "-i", "0.01", "-D", "-O"])
            .arg(to_ip.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let out = ping
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("ping's output was not piped"))?;
        let ping_output = std::thread::spawn(move || read_ping(out));
        // Let both settle before anything happens.
        std::thread::sleep(Duration::from_millis(500));
        Ok(Probe {
            stop,
            sender,
            receiver,
            ping,
            ping_output,
        })
    }

    /// Stops both and reports.
    pub fn finish(self) -> anyhow::Result<Disruption> {
        self.stop.store(true, Ordering::Relaxed);
        let _ = Command::new("kill")
            .args(["-INT", &self.ping.id().to_string()])
            .status();
        let mut ping = self.ping;
        ping.wait()?;
        let (replies, text) = self
            .ping_output
            .join()
            .map_err(|_| anyhow::anyhow!("reading ping's output panicked"))?;
        let (sent, received) = ping_summary(&text)
            .ok_or_else(|| anyhow::anyhow!("ping printed no summary: {text:?}"))?;
        let (sent, received) = (sent as u64, received as u64);
        let send_error = match self.sender.join() {
            Ok(Ok(Ok(e))) => e,
            Ok(Ok(Err(e))) | Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some("the sender panicked".into()),
        };
        let got = match self.receiver.join() {
            Ok(Ok(Ok(r))) => r,
            Ok(Ok(Err(e))) | Ok(Err(e)) => Received::failed(e.to_string()),
            Err(_) => Received::failed("the receiver panicked".into()),
        };
        Ok(Disruption {
            stream_bytes: got.bytes,
            max_stall: got.stall,
            stall_from_unix_s: got.stall_from,
            stream_error: send_error.or(got.error),
            pings_sent: sent,
            pings_lost: sent.saturating_sub(received),
            longest_hole: longest_hole(replies),
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

/// A reply in ping's `-D` output, `[<unix time>] 64 bytes from …: icmp_seq=N …`, as
/// `(N, unix time)`; `None` for any other line (`-O` reports an unanswered one as
/// `[<unix time>] no answer yet for icmp_seq=N`).
pub(crate) fn ping_reply(line: &str) -> Option<(u64, f64)> {
    if !line.contains(" bytes from ") {
        return None;
    }
    let stamp = line
        .strip_prefix('[')?
        .split(']')
        .next()?
        .parse::<f64>()
        .ok()?;
    let seq = line.split("icmp_seq=").nth(1)?.split_whitespace().next()?;
    Some((seq.parse().ok()?, stamp))
}

/// The longest run of unanswered pings among `replies` (`ping_reply`). It starts one
/// interval (10 ms) after the last reply before it.
pub fn longest_hole(mut replies: Vec<(u64, f64)>) -> Option<Hole> {
    replies.sort_by_key(|r| r.0);
    replies.dedup_by_key(|r| r.0);
    replies
        .windows(2)
        .filter(|w| w[1].0 > w[0].0 + 1)
        .map(|w| Hole {
            pings: w[1].0 - w[0].0 - 1,
            from_unix_s: w[0].1 + 0.01,
        })
        .max_by_key(|h| h.pings)
}

/// Reads ping's output as it comes (a pipe left unread would stop ping once full): the
/// replies, and every other line except the unanswered ones (the summary among them).
fn read_ping(out: impl Read) -> (Vec<(u64, f64)>, String) {
    let (mut replies, mut rest) = (Vec::new(), String::new());
    for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
        match ping_reply(&line) {
            Some(r) => replies.push(r),
            None if line.contains("no answer yet") => {}
            None => {
                rest.push_str(&line);
                rest.push('\n');
            }
        }
    }
    (replies, rest)
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

    #[test]
    fn the_longest_hole_is_found_with_its_start() {
        let text = "PING 10.244.2.2 (10.244.2.2) 56(84) bytes of data.\n\
                    [100.000] 64 bytes from 10.244.2.2: icmp_seq=1 ttl=62 time=0.5 ms\n\
                    [100.020] no answer yet for icmp_seq=2\n\
                    [100.030] 64 bytes from 10.244.2.2: icmp_seq=3 ttl=62 time=0.5 ms\n\
                    [100.040] 64 bytes from 10.244.2.2: icmp_seq=4 ttl=62 time=0.5 ms\n\
                    [100.060] no answer yet for icmp_seq=5\n\
                    [100.070] no answer yet for icmp_seq=6\n\
                    [100.080] no answer yet for icmp_seq=7\n\
                    [100.081] 64 bytes from 10.244.2.2: icmp_seq=8 ttl=62 time=0.5 ms\n";
        let (replies, rest) = super::read_ping(text.as_bytes());
        assert_eq!(replies.len(), 4);
        assert!(rest.starts_with("PING"), "{rest}");
        let h = super::longest_hole(replies).unwrap();
        assert_eq!(h.pings, 3);
        assert!((h.from_unix_s - 100.05).abs() < 1e-9);
        assert_eq!(super::longest_hole(vec![(1, 1.0), (2, 1.01)]), None);
    }
}
