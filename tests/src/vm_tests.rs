//! The VM runner's pure parts: module load order, the init script.

use super::*;

#[test]
fn modules_load_after_what_they_need() {
    let dep = "kernel/a.ko: kernel/b.ko kernel/c.ko\nkernel/b.ko: kernel/c.ko\nkernel/c.ko:\n";
    assert_eq!(
        load_order(dep, &["kernel/a.ko"]).unwrap(),
        vec!["kernel/c.ko", "kernel/b.ko", "kernel/a.ko"]
    );
    assert!(load_order(dep, &["kernel/x.ko"]).is_err());
}

#[test]
fn console_noise_is_stripped() {
    assert_eq!(strip_control("\u{1b}[0m\u{1b}[32mok\u{1b}[0m\r"), "ok");
}
