#![no_main]
//! weft_userspace::fuzz_targets::tso_split under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft_userspace::fuzz_targets::tso_split(data));
