//! `weft agent`: this node's part of the mesh.
//! - `start`: start-up (key, health and control endpoints, registry, config, lease, data
//!   plane) and the wiring between them;
//! - `run_loop`: the control loop, level-triggered, until shutdown: it chooses what woke
//!   it; `pass` runs one pass; `error_policy` says what a failure means;
//! - `backend_setup`: what each backend needs before the first plan; `also`: the old
//!   backend kept while the cluster changes backend;
//! - `esp_epoch`: a new ipsec epoch when states installed under the old one are lost;
//! - `roaming`: what the loop remembers of its peers' endpoints, for the plan;
//! - `iface`: the address this node advertises; `address`: following it when it changes;
//! - `one_agent`: the lock that keeps a second agent off the node;
//! - `subnet_file`: `/run/flannel/subnet.env`.

mod address;
mod also;
mod also_changes;
pub mod backend_setup;
mod clock_switch;
mod error_policy;
mod esp_epoch;
pub mod iface;
mod local_facts;
mod loop_timing;
mod nft_check;
mod one_agent;
mod pass;
mod paths;
mod pq_seen;
mod roaming;
mod rotate_requests;
mod run_loop;
mod start;
pub mod subnet_file;

pub(crate) use start::init_tracing;
pub use start::run;
