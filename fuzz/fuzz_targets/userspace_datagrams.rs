#![no_main]
//! weft_userspace::fuzz_targets::userspace_datagrams under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft_userspace::fuzz_targets::userspace_datagrams(data));
