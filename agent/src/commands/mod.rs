//! The one-shot subcommands: `config check`, `keys`, `install-cni`, `cleanup`, `status`
//! and `doctor`. Each returns an exit code or an
//! error for `main` to print.

pub mod cleanup;
pub mod config_check;
pub mod doctor;
pub mod install_cni;
pub mod keys;
pub mod pq_status;
pub mod rotate;
pub mod rotate_cluster;
pub mod status;
pub mod userspace_device;
