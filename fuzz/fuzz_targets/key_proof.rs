#![no_main]
//! weft_crypto::fuzz_targets::key_proof under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft_crypto::fuzz_targets::key_proof(data));
