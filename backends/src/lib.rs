//! weft's backends: the data model, the pure planner, and (in `apply`, later) the
//! reconcilers that bring the kernel in line with the plan. The userspace WireGuard
//! device is a crate of its own (`weft-userspace`), here as `userspace`.

pub mod apply;
#[doc(hidden)]
pub mod fuzz_targets;
pub mod model;
pub mod netconf;
pub mod plan;
pub use weft_userspace as userspace;

#[cfg(test)]
use weft_userspace::test_rng;
