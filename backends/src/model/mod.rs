//! weft's data model: leases, the cluster view, the desired state, subnet allocation and
//! the pod network arithmetic they rest on. Pure: no I/O.

pub mod alloc;
pub mod annotations;
pub mod backend_data;
mod desired;
#[cfg(test)]
pub(crate) mod fixtures;
mod ifname;
mod lease;
mod left_out;
pub mod net;
mod observed;
mod rules;
pub mod sorted;

pub use alloc::{allocate, Allocation, Exhausted, Taken};
pub use backend_data::BackendDataError;
pub use desired::{
    format_mac, parse_mac, DesiredState, EspPq, EspSa, GuardSpec, IpipSpec, IpsecPeer, IpsecSpec,
    PairBackend, PairSecret, PeerPath, PeerSpec, PqKey, PqPeer, RouteRole, RouteSpec, TunnelSpec,
    Via, VxlanPeer, VxlanSpec, FAIL_CLOSED_METRIC,
};
pub use ifname::IfName;
pub use lease::{ClusterView, Lease, LeaseAttrs, NextKey, Reach, ViewChange, DEFAULT_RELAY_PORT};
pub use left_out::{LeaveReason, LeftOut};
pub use net::PodNetwork;
pub use observed::{
    DevicePeer, KeyMove, KeyWatch, Observed, PathHistory, PeerObserved, HANDSHAKE_POLL, SEEN_LEAD,
    SWITCH_GRACE, WATCH_BEFORE,
};
pub use rules::{Family, ForwardRule, MasqueradeTable, Match, NatRule, SubnetEnv};

/// Text from outside (a key, a value) as an error message shows it: whole up to 80
/// characters, else its start and its length, so a huge value is never echoed back.
pub fn clip(text: &str) -> String {
    const SHOWN: usize = 80;
    if text.chars().count() <= SHOWN {
        return text.to_string();
    }
    let start: String = text.chars().take(SHOWN).collect();
    format!("{start}… ({} bytes)", text.len())
}

/// serde_json's message with each value it quotes clipped (`clip`): its own wording (the
/// field, the type expected, the place) stays, a long value does not come back whole.
pub fn json_error(e: &serde_json::Error) -> String {
    json_error_showing(e, clip)
}

/// serde_json's message with each value it quotes (between double quotes) replaced by
/// `shown(value)`; `json_error` clips them, a secret's parser hides them.
pub fn json_error_showing(e: &serde_json::Error, shown: impl Fn(&str) -> String) -> String {
    let mut out = String::new();
    for (i, part) in e.to_string().split('"').enumerate() {
        match i % 2 {
            0 => out.push_str(part),
            _ => {
                out.push('"');
                out.push_str(&shown(part));
                out.push('"');
            }
        }
    }
    out
}

#[cfg(test)]
mod clip_tests {
    #[test]
    fn long_text_is_cut_with_its_length() {
        assert_eq!(super::clip("short"), "short");
        let long = "x".repeat(1000);
        let shown = super::clip(&long);
        assert!(shown.starts_with(&"x".repeat(80)) && shown.ends_with("… (1000 bytes)"));
    }

    #[test]
    fn json_errors_keep_their_words_and_clip_their_values() {
        let long = "y".repeat(500);
        let e = serde_json::from_str::<u64>(&format!("\"{long}\"")).unwrap_err();
        let shown = super::json_error(&e);
        assert!(shown.starts_with("invalid type: string \"yyy"), "{shown}");
        assert!(shown.contains("(500 bytes)\", expected u64"), "{shown}");
    }
}
