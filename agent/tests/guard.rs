//! Forged clear packets from the underlay, in the lab (wireguard backend, userspace device,
//! the lab's own sysctls: nothing tightened for the test). A host on the underlay sends
//! pings to a node with a pod address as source, the way anyone on that network can:
//! - "from" node 2's pod to node 1's pod: without a guard node 1 routes it to its pod as
//!   if it had come through the tunnel;
//! - "from" node 1's own pod to node 2's pod: without a guard node 1 encrypts it and node
//!   2 receives it as if node 1's pod had sent it.
//!
//! A counter in the receiving pod's namespace shows whether any arrived; the same pod
//! address then pings for real, through the tunnel, and is counted: the guard drops the
//! forgeries and nothing else. The ipsec backend runs the same in the VM (`ipsec`).

use weft_lab::lab::forge::assert_forged_pod_sources_reach_no_pod;
use weft_lab::lab::{Lab, LabConfig};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

#[test]
fn forged_pod_sources_from_the_underlay_reach_no_pod() {
    let lab = Lab::start(LabConfig::wireguard(2, WEFT)).unwrap();
    lab.assert_all_pairs();
    assert_forged_pod_sources_reach_no_pod(&lab);
}
