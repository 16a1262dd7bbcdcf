//! The weft node agent: CLI, registries (etcd, Kubernetes), the control loop, the
//! health endpoints, the files it writes (`subnet.env`), and the CNI plugin.

pub mod agent;
pub mod backend_setup;
pub mod backoff;
pub mod cli;
pub mod cni;
pub mod commands;
pub mod control;
mod control_loop;
pub mod health;
pub mod iface;
pub mod metrics;
pub mod psk;
pub mod registry;
pub mod rotation;
pub mod status;
pub mod subnet_file;
pub mod switchover;
