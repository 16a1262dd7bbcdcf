//! WireGuard's cross-platform text protocol ("UAPI": `get=1` / `set=1` over
//! `/var/run/wireguard/<dev>.sock`), spoken by `wg` and by userspace devices. Keys travel
//! as hex. Pure: encoding and parsing only; the socket lives with the device implementation.

use std::fmt::Write;

use weft_crypto::{PresharedKey, PrivateKey, PublicKey, KEY_LEN};

use super::diff::{DeviceChange, PeerChange};
use super::{WgDevice, WgPeer};
use crate::model::PeerSpec;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UapiError {
    #[error("the device answered errno={0}")]
    Errno(i32),
    #[error("line {line}: {problem}: {:?}", crate::model::clip(text))]
    Bad {
        line: usize,
        problem: &'static str,
        text: String,
    },
}

/// As an I/O error: the device's errno is the OS's (a taken port is `AddrInUse`, as from
/// the kernel), anything else is "other".
impl From<UapiError> for std::io::Error {
    fn from(e: UapiError) -> Self {
        match e {
            UapiError::Errno(n) => std::io::Error::from_raw_os_error(n),
            other => std::io::Error::other(other.to_string()),
        }
    }
}

pub(crate) use weft_userspace::uapi::{hex, unhex};

fn peer_lines(p: &PeerSpec) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "public_key={}", hex(p.public_key.as_bytes()));
    if let Some(psk) = &p.psk {
        let _ = writeln!(out, "preshared_key={}", hex(psk.as_bytes()));
    }
    let _ = writeln!(out, "endpoint={}", p.endpoint);
    let _ = writeln!(out, "persistent_keepalive_interval={}", p.keepalive);
    let _ = writeln!(out, "replace_allowed_ips=true");
    for ip in &p.allowed_ips {
        let _ = writeln!(out, "allowed_ip={ip}");
    }
    out
}

/// The `set=1` request for `change` (none when nothing changes): the device's own
/// settings first (peers cannot be added before the private key), then every peer
/// operation, in one request. An update changes the peer in place (`update_only`), so
/// its session survives an endpoint or AllowedIPs change.
pub fn encode_set(change: &DeviceChange, private_key: &PrivateKey) -> Vec<String> {
    // One buffer, the request's header first: at 10,000 peers a set is megabytes, and a
    // copy of it into another string doubled what the process held for it.
    const SET: &str = "set=1\n";
    let mut body = String::from(SET);
    if change.set_private_key {
        let _ = writeln!(body, "private_key={}", hex(private_key.as_bytes()));
    }
    if let Some(port) = change.listen_port {
        let _ = writeln!(body, "listen_port={port}");
    }
    for peer in &change.peers {
        match peer {
            PeerChange::Add(p) => body.push_str(&peer_lines(p)),
            PeerChange::Update { spec, fields } => body.push_str(&update_lines(spec, fields)),
            PeerChange::Remove { key } => {
                let _ = writeln!(body, "public_key={}\nremove=true", hex(key.as_bytes()));
            }
        }
    }
    if body.len() == SET.len() {
        return Vec::new();
    }
    body.push('\n');
    vec![body]
}

fn update_lines(spec: &PeerSpec, fields: &super::diff::PeerFields) -> String {
    let mut out = format!(
        "public_key={}\nupdate_only=true\n",
        hex(spec.public_key.as_bytes())
    );
    if let Some(e) = fields.endpoint {
        let _ = writeln!(out, "endpoint={e}");
    }
    if let Some(k) = fields.keepalive {
        let _ = writeln!(out, "persistent_keepalive_interval={k}");
    }
    match &fields.psk {
        Some(Some(psk)) => {
            let _ = writeln!(out, "preshared_key={}", hex(psk.as_bytes()));
        }
        Some(None) => {
            let _ = writeln!(out, "preshared_key={}", hex(&[0; KEY_LEN]));
        }
        None => {}
    }
    if let Some(ips) = &fields.allowed_ips {
        let _ = writeln!(out, "replace_allowed_ips=true");
        for ip in ips {
            let _ = writeln!(out, "allowed_ip={ip}");
        }
    }
    out
}

/// Parses a `get=1` answer (up to and including its `errno=` line).
pub fn parse_get(text: &str) -> Result<WgDevice, UapiError> {
    let mut device = WgDevice::default();
    let mut current: Option<(PublicKey, WgPeer)> = None;
    let mut handshake_sec = 0u64;
    for (i, line) in text.lines().enumerate() {
        if line.is_empty() {
            continue;
        }
        let bad = |problem| UapiError::Bad {
            line: i + 1,
            problem,
            text: line.chars().take(80).collect(),
        };
        // The longest line of a `get` answer is a key: 64 hex digits and its name.
        if line.len() > 4096 {
            return Err(bad("longer than 4096 bytes"));
        }
        let (key, value) = line.split_once('=').ok_or_else(|| bad("not key=value"))?;
        let num = |v: &str| v.parse::<u64>().map_err(|_| bad("not a number"));
        match key {
            "errno" => {
                let code: i32 = value.parse().map_err(|_| bad("not a number"))?;
                if code != 0 {
                    return Err(UapiError::Errno(code));
                }
            }
            "private_key" => {
                device.public_key = unhex(value)
                    .map(|k| PrivateKey::from_bytes(k).public_key())
                    .filter(|_| value.bytes().any(|b| b != b'0'))
            }
            "own_public_key" => {
                device.public_key = Some(PublicKey::from_bytes(
                    unhex(value).ok_or_else(|| bad("not a hex key"))?,
                ))
            }
            "listen_port" => {
                device.listen_port = u16::try_from(num(value)?).map_err(|_| bad("not a port"))?
            }
            "fwmark" | "protocol_version" => {}
            "public_key" => {
                if let Some((k, p)) = current.take() {
                    device.peers.insert(k, p);
                }
                current = Some((
                    PublicKey::from_bytes(unhex(value).ok_or_else(|| bad("not a hex key"))?),
                    WgPeer::default(),
                ));
            }
            _ => {
                let Some((_, peer)) = current.as_mut() else {
                    return Err(bad("peer field before any public_key"));
                };
                match key {
                    "preshared_key" => {
                        let bytes = unhex(value).ok_or_else(|| bad("not a hex key"))?;
                        peer.psk = (bytes != [0; KEY_LEN]).then(|| PresharedKey::from_bytes(bytes));
                    }
                    "endpoint" => {
                        peer.endpoint = Some(value.parse().map_err(|_| bad("not an endpoint"))?)
                    }
                    "persistent_keepalive_interval" => {
                        peer.keepalive =
                            u16::try_from(num(value)?).map_err(|_| bad("out of range"))?
                    }
                    "allowed_ip" => {
                        peer.allowed_ips
                            .push(value.parse().map_err(|_| bad("not a CIDR"))?);
                        peer.allowed_ips.sort();
                    }
                    "last_handshake_time_sec" => handshake_sec = num(value)?,
                    "last_handshake_time_nsec" => {
                        let d = std::time::Duration::new(
                            handshake_sec,
                            u32::try_from(num(value)?).unwrap_or(0),
                        );
                        peer.last_handshake = (!d.is_zero()).then_some(d);
                    }
                    "rx_bytes" => peer.rx_bytes = num(value)?,
                    "tx_bytes" => peer.tx_bytes = num(value)?,
                    _ => {} // newer fields are ignored, not fatal
                }
            }
        }
    }
    if let Some((k, p)) = current {
        device.peers.insert(k, p);
    }
    Ok(device)
}

#[cfg(test)]
mod tests;
