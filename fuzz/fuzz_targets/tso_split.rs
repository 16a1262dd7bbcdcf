#![no_main]
//! weft_backends::fuzz_targets::tso_split under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft_backends::fuzz_targets::tso_split(data));
