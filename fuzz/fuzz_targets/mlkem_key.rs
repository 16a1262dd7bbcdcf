#![no_main]
//! weft_crypto::fuzz_targets::mlkem_key under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft_crypto::fuzz_targets::mlkem_key(data));
