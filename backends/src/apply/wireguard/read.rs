//! Reading a WireGuard device of either kind, for the operator's tools (`weft status`,
//! `weft doctor`, `/metrics`) that look at the device beside the agent: a userspace device
//! over its UAPI socket when one answers, else the kernel's over generic netlink.

use std::io;

use super::genl::Genl;
use super::uapi;
use super::uapi_socket::UapiClient;
use super::WgDevice;

/// The device `name`, or `None` if there is none (no answering socket, no such link).
pub async fn read_device(name: &str) -> io::Result<Option<WgDevice>> {
    if let Ok(mut client) = UapiClient::connect(name).await {
        let answer = client.exchange("get=1\n").await?;
        return uapi::parse_get(&answer).map(Some).map_err(|e| {
            io::Error::other(format!("reading userspace WireGuard device {name}: {e}"))
        });
    }
    let mut genl = match Genl::open() {
        Ok(g) => g,
        // No generic netlink WireGuard family: no kernel device either.
        Err(_) => return Ok(None),
    };
    match genl.get_device(name) {
        Ok(device) => Ok(Some(device)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENODEV) | Some(libc::ENOENT)) => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("reading WireGuard device {name}: {e}"),
        )),
    }
}
