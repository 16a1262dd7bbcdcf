//! Whether this node can take pods now: the answer to `weft-cni`'s STATUS, served on the
//! control socket as `GET /cni/status` (`{"ready": true}` or `{"ready": false,
//! "missing": [...]}`).
//!
//! Ready means: the lease is held, subnet.env is written, the last pass programmed the data
//! plane (routes and, on an encrypting backend, the fail-closed rules that keep pod traffic
//! from leaving in clear), and the backend's device exists, is up and is the one that pass
//! configured (looked at per request, not taken from the last pass: a deleted device is
//! seen at once, and its successor counts only once a pass has given it its peers and
//! routes). A registry
//! that is away does not stop pods: the mesh keeps the data plane it has.

use std::io;

use serde_json::{json, Value};

use crate::observe::http::Health;
use crate::observe::snapshot::Shared;

/// What is missing for pods; empty when the node is ready.
pub fn missing(health: &Health, snapshot: &Shared) -> Vec<String> {
    let mut missing = health.missing_for_pods();
    let device = snapshot
        .facts(|s| s.device.clone().map(|d| (d, s.device_index)))
        .flatten();
    if let Some((device, configured)) = device {
        let now = weft_backends::userspace::ifindex(&device);
        match link_up(&device) {
            Ok(true) if configured.is_some() && now != configured => missing.push(format!(
                "device {device} to be configured (it was made again since the last pass)"
            )),
            Ok(true) => {}
            Ok(false) => missing.push(format!("device {device} to be up (it is down)")),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {
                missing.push(format!("device {device} (it does not exist)"))
            }
            Err(e) => missing.push(format!("device {device} (reading its state: {e})")),
        }
    }
    missing
}

/// The body of `GET /cni/status`.
pub fn answer(health: &Health, snapshot: &Shared) -> Value {
    let missing = missing(health, snapshot);
    if missing.is_empty() {
        json!({"ready": true})
    } else {
        json!({"ready": false, "missing": missing})
    }
}

/// Whether the link `name` is administratively up, in this process's network namespace.
fn link_up(name: &str) -> io::Result<bool> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::from_raw_os_error(libc::ENODEV));
    }
    // SAFETY: a plain socket, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ifreq is plain data; zero is a valid value for it.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the name and writes the flags of `req`, which outlives
    // the call.
    let rc = unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) };
    let result = if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        let flags = unsafe { req.ifr_ifru.ifru_flags };
        Ok(i32::from(flags) & libc::IFF_UP != 0)
    };
    // SAFETY: fd is ours and open.
    unsafe { libc::close(fd) };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_up_and_a_missing_device_is_named() {
        assert!(link_up("lo").unwrap());
        let e = link_up("weft-nonexist").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENODEV));
        assert!(link_up("").is_err());
        assert!(link_up("a-name-longer-than-ifnamsiz").is_err());
    }

    #[test]
    fn readiness_names_each_missing_part_and_the_device() {
        let health = Health::new(std::time::Duration::from_secs(30));
        let snapshot = Shared::default();
        snapshot.update(|s| s.device = Some("weft-nonexist".into()));
        let body = answer(&health, &snapshot);
        assert_eq!(body["ready"], json!(false));
        let text = body["missing"].to_string();
        for part in [
            "lease",
            "data plane",
            "subnet file",
            "device weft-nonexist (it does not exist)",
        ] {
            assert!(text.contains(part), "{part} not in {text}");
        }
        use crate::observe::http::Readiness::*;
        for r in [LeaseAcquired, DataplaneProgrammed, SubnetFileWritten] {
            health.set(r);
        }
        health.registry().lost("etcd away");
        snapshot.update(|s| s.device = Some("lo".into()));
        assert_eq!(answer(&health, &snapshot), json!({"ready": true}));
        // Another interface than the last pass configured: not yet.
        snapshot.update(|s| s.device_index = Some(u32::MAX));
        let text = answer(&health, &snapshot)["missing"].to_string();
        assert!(text.contains("device lo to be configured"), "{text}");
        snapshot.update(|s| s.device_index = weft_backends::userspace::ifindex("lo"));
        assert_eq!(answer(&health, &snapshot), json!({"ready": true}));
    }
}
