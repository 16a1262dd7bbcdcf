//! How an operator sees the agent: the snapshot of the node and its peers
//! (`snapshot`), served on the control socket (`control_socket`) to `weft status` and
//! `weft doctor`; Prometheus metrics (`metrics`) and the health endpoints (`http`).

pub mod control_socket;
pub mod http;
pub mod metrics;
pub mod pods_ready;
mod relay_metrics;
pub mod server;
pub mod snapshot;
