#![no_main]
//! weft_userspace::fuzz_targets::uapi_set under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft_userspace::fuzz_targets::uapi_set(data));
