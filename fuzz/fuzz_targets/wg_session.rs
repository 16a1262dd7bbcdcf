#![no_main]
//! weft_userspace::fuzz_targets::wg_session under libFuzzer: the device with a live session,
//! fed its peer's messages unchanged, altered and replayed, reconfigured between them.
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft_userspace::fuzz_targets::wg_session(data));
