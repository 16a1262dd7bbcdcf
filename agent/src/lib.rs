//! The weft node agent. A map:
//! - `node`: `weft agent` itself: start-up wiring, the control loop, the files it writes
//!   (`subnet.env`), the advertised address;
//! - `registry`: where leases live (etcd, Kubernetes), behind one trait;
//! - `keys`: key rotation, a peer's key switchover, the pre-shared key;
//! - `liveness`: each WireGuard pair alive, or repaired (its own thread);
//! - `observe`: the snapshot, metrics, the health endpoints and the control socket;
//! - `cli` and `commands`: the command line and the operator's commands;
//! - `cni`: the CNI plugin `weft-cni`;
//! - `report`: an error with its causes, as one line.

pub mod backoff;
pub mod cli;
pub mod cni;
pub mod commands;
#[doc(hidden)]
pub mod fuzz_targets;
pub mod keys;
pub mod liveness;
pub mod node;
pub mod observe;
pub mod pathmtu;
pub mod pq;
pub mod registry;
pub mod relay;
pub mod report;
pub(crate) mod udp;
