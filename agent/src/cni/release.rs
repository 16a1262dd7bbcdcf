//! The agent's release of leaked pod addresses: at start and every
//! `--leaked-address-period`, what `weft cleanup --leaked-addresses` frees (`leaks`): the
//! attachments whose container is gone (its network namespace gone, or recorded in an
//! earlier boot), through the delegate's DEL, and the host-local reservations no
//! attachment holds. A live pod's attachment is never one of them. Runtimes that never
//! send CNI GC (containerd, CRI-O) would otherwise leave a node's pod range to fill with
//! the addresses of containers that vanished without a DEL.

use std::path::PathBuf;
use std::time::Duration;

use tracing::{info, warn};

use crate::observe::metrics::Metrics;

/// Starts the releases on a thread of their own; nothing when `period` is zero.
pub fn spawn(data_dir: PathBuf, cni_bin_dir: String, period: Duration, metrics: Metrics) {
    if period.is_zero() {
        return;
    }
    let started = std::thread::Builder::new()
        .name("leaked-addresses".into())
        .spawn(move || {
            let mut seen = Seen::default();
            loop {
                release(&data_dir, &cni_bin_dir, &metrics, &mut seen);
                std::thread::sleep(period);
            }
        });
    if let Err(e) = started {
        warn!(error = %e, "cannot start the release of leaked pod addresses: `weft cleanup --leaked-addresses` frees them");
    }
}

/// The containers whose addresses were released lately, so that one container is told and
/// counted once (its attachment released by the delegate's DEL, its reservation, where the
/// delegate left it, at the next release).
#[derive(Default)]
pub struct Seen(std::collections::VecDeque<(String, String)>);

const SEEN_KEPT: usize = 4096;

/// One release: frees what leaked, logs and counts each container once.
pub fn release(data_dir: &std::path::Path, cni_bin_dir: &str, metrics: &Metrics, seen: &mut Seen) {
    if !data_dir.is_dir() {
        return;
    }
    let (freed, failed) = super::leaks::free(data_dir, cni_bin_dir);
    for leak in &freed {
        let id = (leak.network.clone(), leak.container_id.clone());
        if seen.0.contains(&id) {
            tracing::debug!(leak = %leak, "released the rest of a leaked pod address");
            continue;
        }
        info!(leak = %leak, "released a leaked pod address");
        metrics.addresses_released.inc();
        seen.0.push_back(id);
        if seen.0.len() > SEEN_KEPT {
            seen.0.pop_front();
        }
    }
    for e in &failed {
        warn!(error = %e.msg, "releasing a leaked pod address");
    }
}
