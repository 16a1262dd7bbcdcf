//! A TCP source and sink for the lab: the source streams N pseudo-random bytes, the sink
//! reads to EOF; both print the byte count and SHA-256, so a test can prove a transfer
//! arrived intact, and the source prints its rate for the demo. Run inside namespaces by
//! `ip netns exec … weft-lab tcp-sink|tcp-source`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use anyhow::Context;
use ring::digest::{Context as Sha, SHA256};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Accepts one connection on `port`, reads to EOF; returns "BYTES SHA256".
pub fn sink(port: u16) -> anyhow::Result<String> {
    sink_then(port, || {})
}

/// `sink`, calling `listening` once the port accepts connections.
pub fn sink_then(port: u16, listening: impl FnOnce()) -> anyhow::Result<String> {
    sink_on(std::net::Ipv4Addr::UNSPECIFIED.into(), port, listening)
}

/// `sink_then` on address `at` (`::` takes both families).
pub fn sink_on(
    at: std::net::IpAddr,
    port: u16,
    listening: impl FnOnce(),
) -> anyhow::Result<String> {
    let listener =
        TcpListener::bind((at, port)).with_context(|| format!("listening on port {port}"))?;
    listening();
    let (mut conn, _) = listener.accept().context("accepting")?;
    let mut sha = Sha::new(&SHA256);
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        let n = conn.read(&mut buf).context("reading")?;
        if n == 0 {
            break;
        }
        sha.update(&buf[..n]);
        total += n as u64;
    }
    Ok(format!("{total} {}", hex(sha.finish().as_ref())))
}

/// Sends `bytes` to `addr`; returns "BYTES SHA256 SECONDS".
pub fn source(addr: &str, bytes: u64) -> anyhow::Result<String> {
    let mut conn = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    let mut sha = Sha::new(&SHA256);
    let mut block = vec![0u8; 64 * 1024];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let started = Instant::now();
    let mut sent = 0u64;
    while sent < bytes {
        for chunk in block.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
        }
        let n = (bytes - sent).min(block.len() as u64) as usize;
        conn.write_all(&block[..n]).context("writing")?;
        sha.update(&block[..n]);
        sent += n as u64;
    }
    conn.shutdown(std::net::Shutdown::Write)
        .context("closing")?;
    // Wait for the sink to close: the transfer is complete only once it has read it all.
    let _ = conn.read(&mut block);
    Ok(format!(
        "{sent} {} {:.3}",
        hex(sha.finish().as_ref()),
        started.elapsed().as_secs_f64()
    ))
}
