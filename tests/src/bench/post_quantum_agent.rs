//! `weft-lab bench post-quantum --agent-periods N`: the agent's own post-quantum task (the
//! same code as `weft agent`: its sockets, timers, saved file and every round) with
//! `--peers` peers, each a real exchange on a loopback address of its own, run for N
//! periods of `--period` seconds. The task runs alone on one thread, so that thread's CPU
//! time is the task's; the periods' rounds are counted from what the peers took. The
//! control loop's passes that a new PSK wakes are not in it (they are the loop's cost of any
//! peer change).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use weft::pq::{Config, Published};
use weft_backends::model::{PqKey, PqPeer};
use weft_crypto::pq::{Exchange, KemKeyPair, Own, Timing};
use weft_crypto::PrivateKey;

use super::post_quantum::thread_cpu;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Peer `i`'s loopback address: 127.1.x.y.
fn peer_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250 + 1) as u8)
}

/// One simulated peer: its exchange with the agent, answering and leading as an agent
/// would; counts the PSKs it saw put in force.
async fn peer(
    own: Own,
    mut ex: Exchange,
    socket: tokio::net::UdpSocket,
    agent: SocketAddr,
    rounds: Arc<AtomicUsize>,
) {
    let mut buf = vec![0u8; 4096];
    let mut last = None;
    loop {
        let poll = match ex.poll(now_ms()) {
            Ok(p) => p,
            Err(_) => return,
        };
        for d in &poll.send {
            let _ = socket.send_to(d, agent).await;
        }
        let wait = Duration::from_millis(poll.wake_at.saturating_sub(now_ms()).min(60_000));
        tokio::select! {
            got = socket.recv_from(&mut buf) => {
                if let Ok((n, _)) = got {
                    if let Ok(out) = ex.receive(&own, &buf[..n], now_ms()) {
                        for d in out {
                            let _ = socket.send_to(&d, agent).await;
                        }
                    }
                }
            }
            () = tokio::time::sleep(wait) => {}
        }
        let round = ex.psk(now_ms()).map(|i| i.round);
        if round.is_some() && round != last {
            rounds.fetch_add(1, Ordering::Relaxed);
            last = round;
        }
    }
}

/// The agent's task with `peers` peers for `periods` periods of `period`: its thread's CPU
/// time, and the rounds completed.
pub fn run(peers: usize, period: Duration, periods: u32) -> anyhow::Result<String> {
    let port = 51_900;
    let dir = tempfile::tempdir()?;
    let agent_key = PrivateKey::generate()?;
    let agent_kem = KemKeyPair::generate()?;
    let agent_public = agent_key.public_key();
    let agent_ek = agent_kem.encaps_key();
    let timing = Timing {
        period: period.as_millis() as u64,
        ..Timing::default()
    };
    let config = Config {
        own: Own {
            key: agent_key,
            kem: agent_kem,
            previous_kem: None,
        },
        listen: weft::pq::Listen {
            rounds: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
            notices: Vec::new(),
        },
        port,
        state_dir: dir.path().to_path_buf(),
        timing,
    };
    // The peers' keys and their part of the agent's plan.
    let mut sims = Vec::new();
    let mut listed = Vec::new();
    for i in 0..peers {
        let own = Own {
            key: PrivateKey::generate()?,
            kem: KemKeyPair::generate()?,
            previous_kem: None,
        };
        listed.push(PqPeer {
            node: format!("node-{i}"),
            public_key: own.key.public_key(),
            address: IpAddr::V4(peer_ip(i)),
            underlay: IpAddr::V4(peer_ip(i)),
            ek: PqKey::Published(own.kem.encaps_key()),
        });
        sims.push(own);
    }
    let total = period * periods;
    // The agent's task, alone on its thread.
    let agent = std::thread::spawn(move || -> anyhow::Result<(Duration, usize)> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let start = thread_cpu();
            let handle = weft::pq::spawn(config)?;
            handle.peers.send_replace(weft::pq::PqList::of(listed));
            tokio::time::sleep(total).await;
            let published: Published = handle.published.borrow().clone();
            Ok((thread_cpu().saturating_sub(start), published.psks.len()))
        })
    });
    let rounds = Arc::new(AtomicUsize::new(0));
    let sim_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let agent_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let started = Instant::now();
    sim_rt.block_on(async {
        for (i, own) in sims.into_iter().enumerate() {
            let ex = Exchange::new(&own, agent_public, agent_ek.clone(), timing, now_ms())?;
            let socket = tokio::net::UdpSocket::bind(SocketAddr::from((peer_ip(i), port))).await?;
            tokio::spawn(peer(own, ex, socket, agent_addr, rounds.clone()));
        }
        tokio::time::sleep(total + Duration::from_millis(500)).await;
        anyhow::Ok(())
    })?;
    let (cpu, psks) = agent
        .join()
        .map_err(|_| anyhow::anyhow!("the agent's thread panicked"))??;
    let rounds = rounds.load(Ordering::Relaxed);
    let wall = started.elapsed().as_secs_f64();
    let per_period = cpu.as_secs_f64() / f64::from(periods);
    let at_default = per_period / 120.0 * 100.0;
    Ok(format!(
        "the agent's post-quantum task, {peers} peers, {periods} periods of {} s ({wall:.0} s): \
         {rounds} rounds completed, {} pairs protected at the end; its thread's CPU {:.2} s in all, \
         {:.0} ms a period: at the default 2-minute period {at_default:.3} % of one core\n",
        period.as_secs(),
        psks,
        cpu.as_secs_f64(),
        per_period * 1e3,
    ))
}
