//! The targets that read files an operator or a crash left: the mounted PSK Secret and the
//! rotation state. Each case writes its parts (split at NUL bytes; a missing part is a
//! missing file) into a directory of its own under /dev/shm, then reads them as the agent
//! does at start.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use weft::keys::psk;
use weft::keys::rotation::Rotation;

use super::{big, verdict, Target, KEY};
use crate::fuzz::Verdict;

fn parts(input: &[u8]) -> [Option<&[u8]>; 3] {
    let mut it = input.split(|&b| b == 0);
    [it.next(), it.next(), it.next()]
}

fn write_parts(dir: &Path, names: [&str; 3], input: &[u8]) {
    for (name, part) in names.into_iter().zip(parts(input)) {
        let path = dir.join(name);
        let _ = fs::remove_file(&path);
        if let Some(bytes) = part {
            // The fuzzer's own files: a failure here is the machine's, not the parser's.
            fs::write(&path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            let _ = fs::set_permissions(&path, fs::Permissions::from_mode(0o600));
        }
    }
}

pub(super) fn scratch(name: &str) -> tempfile::TempDir {
    let base = Path::new("/dev/shm");
    let builder = tempfile::Builder::new().prefix(name).to_owned();
    match base.is_dir() {
        true => builder.tempdir_in(base),
        false => builder.tempdir(),
    }
    .unwrap_or_else(|e| panic!("a scratch directory for the fuzzer: {e}"))
}

fn with_nuls(parts: &[&str]) -> Vec<u8> {
    parts.join("\0").into_bytes()
}

pub fn targets() -> Vec<Target> {
    let psk_dir = scratch("weft-fuzz-psk-");
    let rotation_dir = scratch("weft-fuzz-rotation-");
    vec![
        Target {
            name: "psk-files",
            words: &["psk", "switch-at"],
            tokens: &[KEY, "4000000000000", "\n", "\0"],
            seeds: || {
                vec![
                    with_nuls(&[KEY]),
                    with_nuls(&[KEY, KEY, "4000000000000"]),
                    with_nuls(&[&format!("{KEY}\n"), &format!("{KEY}\n"), "4000000000000\n"]),
                ]
            },
            oversized: || big("", b'A', ""),
            parse: Box::new(move |input| {
                write_parts(psk_dir.path(), ["psk", "next-psk", "switch-at"], input);
                verdict(psk::read_dir(psk_dir.path()))
            }),
        },
        Target {
            name: "rotation-state",
            words: &["rotation.json", "wireguard.key", "announcement", "next key"],
            tokens: &[
                "\"PublicKey\"",
                "\"SwitchAt\"",
                "\"Generation\"",
                KEY,
                "4000000000000",
                "\0",
            ],
            seeds: || {
                let next = weft_crypto::PrivateKey::from_bytes([7; 32]);
                let public = next.public_key().to_string();
                vec![
                    with_nuls(&[
                        &next.to_base64_secret(),
                        &format!("{{\"PublicKey\":\"{public}\",\"SwitchAt\":4000000000000,\"Generation\":2}}"),
                        "1",
                    ]),
                    with_nuls(&["", "", "7"]),
                ]
            },
            oversized: || {
                let next = weft_crypto::PrivateKey::from_bytes([7; 32]).to_base64_secret();
                let mut v = with_nuls(&[&next, "{\"PublicKey\":\""]);
                v.extend(big("", b'A', "\"}"));
                v
            },
            parse: Box::new(move |input| {
                let dir = rotation_dir.path();
                write_parts(
                    dir,
                    [
                        "wireguard.key.next",
                        "rotation.json",
                        "wireguard.key.generation",
                    ],
                    input,
                );
                match Rotation::load_explained(&dir.join("wireguard.key")) {
                    (_, Some(why)) => Verdict::Refused(why),
                    (_, None) => Verdict::Accepted,
                }
            }),
        },
    ]
}
