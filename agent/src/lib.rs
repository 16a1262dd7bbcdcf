//! The weft node agent: CLI, registries (etcd; Kubernetes later), the control loop, and
//! the files it writes (`subnet.env`).

pub mod agent;
pub mod backend_setup;
pub mod backoff;
pub mod cli;
pub mod commands;
pub mod iface;
pub mod registry;
pub mod subnet_file;
