//! The one-shot subcommands: `config check`, `keys`, `install-cni`, `cleanup` and
//! `status`. Each returns an exit code or an
//! error for `main` to print.

pub mod cleanup;
pub mod config_check;
pub mod install_cni;
pub mod keys;
pub mod status;
pub mod userspace_device;
