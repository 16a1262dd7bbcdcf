#![no_main]
//! weft_crypto::fuzz_targets::pq_datagrams under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft_crypto::fuzz_targets::pq_datagrams(data));
