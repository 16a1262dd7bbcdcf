//! The one-shot subcommands: `config check`, `keys`, `install-cni` and `cleanup`. Each returns an exit code or an
//! error for `main` to print.

pub mod cleanup;
pub mod config_check;
pub mod install_cni;
pub mod keys;
pub mod userspace_device;
