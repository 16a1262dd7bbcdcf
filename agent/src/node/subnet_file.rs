//! `/run/flannel/subnet.env`: written atomically (temp file in the same directory, fsync,
//! rename, fsync of the directory) so the CNI plugin never reads half a file; and read back
//! at start for the node's previous subnet.

use std::fs;
use std::path::Path;

use ipnet::IpNet;
use weft_backends::model::SubnetEnv;
use weft_crypto::atomic_file::write_atomic;

pub use weft_crypto::atomic_file::AtomicWriteError as SubnetFileError;

/// Writes `env` to `path`, replacing any previous file in one step. Returns whether the
/// content changed (an unchanged file is not rewritten).
pub fn write(path: &Path, env: &SubnetEnv) -> Result<bool, SubnetFileError> {
    let text = env.render();
    if fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|source| SubnetFileError {
        op: "creating directory",
        path: dir.to_path_buf(),
        source,
    })?;
    write_atomic(path, text.as_bytes(), 0o644)?;
    Ok(true)
}

/// The subnets recorded in an existing subnet file (`FLANNEL_SUBNET`, `FLANNEL_IPV6_SUBNET`),
/// as network prefixes. A missing or unreadable file, or a bad line, gives `None` for that
/// family: the previous subnet is only a preference.
pub fn previous_subnets(path: &Path) -> (Option<IpNet>, Option<IpNet>) {
    let Ok(text) = fs::read_to_string(path) else {
        return (None, None);
    };
    let find = |key: &str| {
        text.lines()
            .filter_map(|l| l.split_once('='))
            .find(|(k, _)| k.trim() == key)
            .and_then(|(_, v)| v.trim().parse::<IpNet>().ok())
            .map(|n| n.trunc())
    };
    (find("FLANNEL_SUBNET"), find("FLANNEL_IPV6_SUBNET"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env() -> SubnetEnv {
        SubnetEnv {
            network: Some("10.244.0.0/16".parse().unwrap()),
            subnet: Some("10.244.3.1/24".parse().unwrap()),
            ipv6_network: None,
            ipv6_subnet: None,
            mtu: 1420,
            ipmasq: true,
        }
    }

    #[test]
    fn writes_flannel_format_atomically_and_reads_back_the_subnet() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/flannel/subnet.env");
        assert!(write(&path, &env()).unwrap());
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.3.1/24\nFLANNEL_MTU=1420\nFLANNEL_IPMASQ=true\n"
        );
        assert!(
            !write(&path, &env()).unwrap(),
            "unchanged content is not rewritten"
        );
        let entries: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(entries, ["subnet.env"], "no temporary file left behind");
        assert_eq!(
            previous_subnets(&path),
            (Some("10.244.3.0/24".parse().unwrap()), None)
        );
    }

    #[test]
    fn a_reader_never_sees_a_partial_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("subnet.env");
        let mut a = env();
        write(&path, &a).unwrap();
        let reader = {
            let path = path.clone();
            std::thread::spawn(move || {
                for _ in 0..2000 {
                    let text = fs::read_to_string(&path).unwrap();
                    assert!(
                        text.ends_with("FLANNEL_IPMASQ=true\n"),
                        "partial read: {text:?}"
                    );
                }
            })
        };
        for mtu in 0..2000 {
            a.mtu = 1000 + mtu;
            write(&path, &a).unwrap();
        }
        reader.join().unwrap();
    }

    #[test]
    fn garbage_gives_no_previous_subnet() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("subnet.env");
        fs::write(&path, "FLANNEL_SUBNET=banana\n").unwrap();
        assert_eq!(previous_subnets(&path), (None, None));
        assert_eq!(previous_subnets(&dir.path().join("absent")), (None, None));
    }
}
