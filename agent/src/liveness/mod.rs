//! The liveness watcher: a thread of its own that reads this node's WireGuard devices twice a
//! second (less often past 5,000 peers), beside the control loop, and keeps every pair alive
//! or says why not.
//! - Each pair's verdict (alive, idle, waiting for an answer, dead and why) comes from
//!   its counters (`weft_backends::plan::liveness`); a pair that sent and heard nothing
//!   back is probed through the tunnel, and one that still hears nothing is dead.
//! - A dead pair is repaired in steps, each logged with its cause: the peer re-applied as
//!   planned (the registry's endpoint among it), then re-handshaken; the device is re-created
//!   only when it is itself at fault (it does not answer, or every pair with traffic is
//!   dead). Then a doubling pause: never a loop.
//! - Drift (a key, AllowedIPs, a listen port changed behind the agent) is seen at the read
//!   after it and put back by a full pass of the loop at once, not at the next resync.
//!
//! The loop hands it each plan (`Handle::follow`) and takes its requests (`Event`); what it
//! finds goes into the snapshot (`weft status`, `weft doctor`) and `/metrics`.

pub mod probe;
mod watch;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, watch as tokio_watch};
use weft_backends::model::{DesiredState, TunnelSpec};
use weft_crypto::PublicKey;

pub use watch::spawn;

/// What the watcher judges against: the last plan's devices.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Counts the plans handed over: drift is drift only when two reads under the same
    /// plan show it (a pass under way changes the device before its plan arrives here).
    pub generation: u64,
    /// This node's public key, as the devices must carry it.
    pub own: PublicKey,
    pub tunnels: Vec<TunnelSpec>,
    /// A key rotation is in its switch window: peers' entries move outside the passes
    /// (the key-switch watcher), so drift is not looked for.
    pub switching: bool,
}

/// What the watcher asks of the control loop.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// `device` differs from the plan (each difference in words): a full pass puts it back.
    Drift { device: String, found: Vec<String> },
    /// `device` is at fault: remove it, and the next pass makes it again.
    Recreate { device: String, cause: String },
}

/// The loop's end of the watcher.
pub struct Handle {
    plan: tokio_watch::Sender<Option<Arc<Plan>>>,
    pub events: mpsc::Receiver<Event>,
    generation: u64,
    /// Set while a pass changes the devices: a device busy taking a large change answers a
    /// read late, and is not at fault for it.
    applying: Arc<AtomicBool>,
}

/// Says the devices are being changed, until dropped.
pub struct Applying(Arc<AtomicBool>);

impl Drop for Applying {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Handle {
    /// For the time a pass changes the devices.
    pub fn applying(&self) -> Applying {
        self.applying.store(true, Ordering::Release);
        Applying(self.applying.clone())
    }

    /// Hands the watcher the plan a pass just applied.
    pub fn follow(&mut self, state: &DesiredState, own: PublicKey) {
        let switching = state.key_watch.is_some();
        let same = self.plan.borrow().as_ref().is_some_and(|p| {
            p.own == own && p.switching == switching && p.tunnels == state.tunnels
        });
        if same {
            return; // the device, once this pass is done, is what the same plan wants
        }
        self.generation += 1;
        let plan = Plan {
            generation: self.generation,
            own,
            tunnels: state.tunnels.clone(),
            switching,
        };
        self.plan.send_replace(Some(Arc::new(plan)));
    }
}
