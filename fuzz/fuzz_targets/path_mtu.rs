#![no_main]
//! weft::fuzz_targets path_mtu (the path-MTU prober's datagrams) under libFuzzer.
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft::pathmtu::fuzz::path_mtu(data));
