#![no_main]
//! weft_backends::fuzz_targets::userspace_datagrams under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft_backends::fuzz_targets::userspace_datagrams(data));
