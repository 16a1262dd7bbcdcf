//! weft's backends: the data model, the pure planner, and (in `apply`, later) the
//! reconcilers that bring the kernel in line with the plan.

pub mod apply;
#[doc(hidden)]
pub mod fuzz_targets;
pub mod model;
pub mod netconf;
pub mod plan;
pub mod userspace;

#[cfg(test)]
mod test_rng;
