//! weft's data model: leases, the cluster view, the desired state, subnet allocation and
//! the pod network arithmetic they rest on. Pure: no I/O.

pub mod alloc;
pub mod annotations;
mod backend_data;
mod desired;
mod lease;
pub mod net;
mod observed;

pub use alloc::{allocate, Allocation, Exhausted, Taken};
pub use backend_data::BackendDataError;
pub use desired::{
    format_mac, parse_mac, DesiredState, Family, ForwardRule, LeaveReason, LeftOut,
    MasqueradeTable, Match, NatRule, PeerSpec, RouteRole, RouteSpec, SubnetEnv, TunnelSpec,
    VxlanPeer, VxlanSpec, FAIL_CLOSED_METRIC,
};
pub use lease::{ClusterView, Lease, LeaseAttrs, NextKey, Reach, ViewChange};
pub use net::PodNetwork;
pub use observed::{KeyWatch, Observed, PeerObserved, HANDSHAKE_POLL, SWITCH_GRACE, WATCH_BEFORE};
