#![no_main]
//! The agent's parsers of outside data (net-conf.json, etcd leases, Node annotations, CNI
//! input, subnet.env, UAPI answers, PSK sources, rotation state, the control socket) under
//! libFuzzer: `weft_lab::fuzz::judge_picked`, whose first input byte picks the parser.
//! A panic, or an error that names no field or echoes its input, is a crash.

use weft_lab::fuzz::{judge_picked, targets, Target};

thread_local! {
    static TARGETS: Vec<Target> = targets();
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    TARGETS.with(|all| {
        if let Err(problem) = judge_picked(all, data) {
            panic!("{problem}");
        }
    })
});
