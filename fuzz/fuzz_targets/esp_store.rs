#![no_main]
//! weft_backends::fuzz_targets::esp_store under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft_backends::fuzz_targets::esp_store(data));
