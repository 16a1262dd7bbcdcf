//! The one-shot subcommands: `config check` and `keys`. Each returns an exit code or an
//! error for `main` to print.

pub mod config_check;
pub mod keys;
pub mod userspace_device;
