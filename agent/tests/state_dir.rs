//! `/var/lib/weft` full or read-only, as a full disk or a remounted filesystem leaves it:
//! at key creation the agent stops with one clear error and leaves no half-written key;
//! during a rotation the rotation is refused with the reason, the key file is untouched
//! and the node keeps working on its old key; once there is room again, both succeed.

use std::process::Command;
use std::time::Duration;

use weft_lab::lab::{Lab, LabConfig};
use weft_lab::netns::sh;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

/// A small tmpfs mounted over `dir`, unmounted on drop.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        sh(&format!(
            "mount -t tmpfs -o size={size},mode=0700 weft-test {}",
            dir.display()
        ));
        Tmpfs(dir.to_path_buf())
    }

    /// Fills it up: every block taken.
    fn fill(&self) {
        let _ = Command::new("dd")
            .args(["if=/dev/zero", "bs=4k"])
            .arg(format!("of={}", self.0.join("filler").display()))
            .output();
    }

    fn free(&self) {
        let _ = std::fs::remove_file(self.0.join("filler"));
    }

    fn read_only(&self, yes: bool) {
        let mode = if yes { "ro" } else { "rw" };
        sh(&format!("mount -o remount,{mode} {}", self.0.display()));
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// `weft agent` with its key in `dir`, against an etcd that is not there: it stops at
/// the key (or, with room, goes on retrying the registry until killed).
fn start_with_key_in(dir: &std::path::Path) -> (Option<i32>, String) {
    let mut child = Command::new(WEFT)
        .args([
            "agent",
            "--etcd-endpoints=http://127.0.0.1:1",
            "--public-ip=198.51.100.9",
        ])
        .env("WIREGUARD_KEY_FILE", dir.join("wireguard.key"))
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Exited on its own, or killed below.
    weft_lab::wait::holds_within(Duration::from_secs(3), || {
        child.try_wait().is_ok_and(|s| s.is_some())
    });
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text)
}

fn files(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "filler")
        .collect();
    names.sort();
    names
}

#[test]
fn a_full_or_read_only_state_directory_at_key_creation_is_one_clear_error_and_no_key() {
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("state");
    let fs = Tmpfs::mount(&dir, "64k");

    fs.fill();
    let (code, out) = start_with_key_in(&dir);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("No space left on device"), "{out}");
    assert!(
        out.contains(&dir.display().to_string()),
        "names the path: {out}"
    );
    assert!(
        !files(&dir).contains(&"wireguard.key".to_string()),
        "{:?}",
        files(&dir)
    );
    assert!(
        files(&dir).iter().all(|f| !f.starts_with(".wireguard.key")),
        "a temporary key file was left: {:?}",
        files(&dir)
    );
    eprintln!("full: {}", out.lines().last().unwrap_or_default());

    fs.free();
    fs.read_only(true);
    let (code, out) = start_with_key_in(&dir);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("Read-only file system"), "{out}");
    assert!(!files(&dir).contains(&"wireguard.key".to_string()));
    eprintln!("read-only: {}", out.lines().last().unwrap_or_default());

    // Room again: the key is created, whole.
    fs.read_only(false);
    let (_, out) = start_with_key_in(&dir);
    assert!(out.contains("origin=Created"), "{out}");
    let key = std::fs::read_to_string(dir.join("wireguard.key")).unwrap();
    assert_eq!(key.trim().len(), 44, "{key:?}");
}

#[test]
fn a_rotation_with_a_full_or_read_only_state_directory_is_refused_and_the_old_key_works() {
    let mut lab = Lab::start(LabConfig::wireguard(2, WEFT)).unwrap();
    lab.assert_all_pairs();
    // Node 1's state directory on a small tmpfs: stopped, moved over, started again.
    lab.stop_agent(0, "TERM").unwrap();
    let lib = lab.nodes[0].dir.join("lib");
    let saved = lab.nodes[0].dir.join("lib-saved");
    sh(&format!("cp -a {} {}", lib.display(), saved.display()));
    let fs = Tmpfs::mount(&lib, "64k");
    sh(&format!("cp -a {}/. {}", saved.display(), lib.display()));
    lab.start_agent(0).unwrap();
    lab.assert_all_pairs();
    let key_before = std::fs::read(lib.join("wireguard.key")).unwrap();

    for (what, break_it, says) in [
        ("full", true, "No space left on device"),
        ("read-only", false, "Read-only file system"),
    ] {
        if break_it {
            fs.fill();
        } else {
            fs.free();
            fs.read_only(true);
        }
        let out = lab
            .on_node(0, &format!("{WEFT} keys rotate 2>&1; echo exit=$?"))
            .unwrap();
        assert!(
            out.contains(says) && out.contains("wireguard.key.next"),
            "{what}: {out}"
        );
        assert!(!out.trim_end().ends_with("exit=0"), "{what}: {out}");
        assert_eq!(
            std::fs::read(lib.join("wireguard.key")).unwrap(),
            key_before
        );
        assert!(
            !files(&lib)
                .iter()
                .any(|f| f.contains("next") || f == "rotation.json"),
            "{what}: {:?}",
            files(&lib)
        );
        lab.assert_all_pairs();
        eprintln!(
            "rotation, state directory {what}: {}",
            out.lines().next().unwrap_or_default()
        );
    }

    // Room again: the rotation goes through.
    fs.read_only(false);
    let out = lab.on_node(0, &format!("{WEFT} keys rotate")).unwrap();
    assert!(out.contains("announced key generation 2"), "{out}");
    weft_lab::wait::until_or(
        "node 1 switching to its new key",
        Duration::from_secs(15),
        || std::fs::read(lib.join("wireguard.key")).unwrap() != key_before,
        || lab.logs(),
    );
    lab.assert_all_pairs();
    lab.stop_agent(0, "KILL").unwrap();
    drop(fs);
}
