//! weft's data model: leases, the cluster view, the desired state, and the pod network
//! arithmetic they rest on. Pure: no I/O.

pub mod net;

pub use net::PodNetwork;
