//! WireGuard devices in memory, each tied to a `FakeNetlink` link of kind `wireguard`: a
//! link deleted behind the data plane's back takes its device (key, peers) with it, as a
//! kernel device or a userspace device's TUN would.

use std::collections::BTreeMap;

use weft_crypto::PrivateKey;

use super::FakeNetlink;
use crate::apply::wireguard::diff::{apply_to, DeviceChange};
use crate::apply::wireguard::{WgDevice, WgDevices};
use crate::apply::{ApplyError, Netlink, ObservedLink};
use crate::model::PeerSpec;

#[derive(Debug, Default)]
pub struct FakeWg {
    /// By device name.
    pub devices: BTreeMap<String, WgDevice>,
    /// Device reads so far: an incremental pass should not read devices it already knows.
    pub reads: u64,
    /// The peers handshakes were started with, by node name, in order.
    pub primed: Vec<String>,
    writes: u64,
}

fn no_device(device: &str) -> ApplyError {
    ApplyError::Io {
        op: format!("reading WireGuard device {device}"),
        source: std::io::Error::from_raw_os_error(19),
    }
}

impl WgDevices for FakeWg {
    type Nl = FakeNetlink;

    fn name(&self) -> &'static str {
        "fake"
    }

    async fn ensure(&mut self, nl: &mut FakeNetlink, device: &str) -> Result<bool, ApplyError> {
        match nl.link(device).await? {
            Some(l)
                if l.kind.as_deref() == Some("wireguard") && self.devices.contains_key(device) =>
            {
                return Ok(false)
            }
            Some(other) => nl.del_link(&other).await?,
            None => {}
        }
        self.writes += 1;
        nl.add_link(device, "wireguard");
        self.devices.insert(device.to_string(), WgDevice::default());
        Ok(true)
    }

    async fn remove(nl: &mut FakeNetlink, link: &ObservedLink) -> Result<(), ApplyError> {
        nl.del_link(link).await
    }

    async fn get(&mut self, device: &str) -> Result<WgDevice, ApplyError> {
        self.reads += 1;
        self.devices
            .get(device)
            .cloned()
            .ok_or_else(|| no_device(device))
    }

    async fn apply(
        &mut self,
        device: &str,
        change: &DeviceChange,
        key: &PrivateKey,
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        let d = self
            .devices
            .get_mut(device)
            .ok_or_else(|| no_device(device))?;
        apply_to(d, change, &key.public_key());
        Ok(())
    }

    fn writes(&self) -> u64 {
        self.writes
    }

    fn start_handshakes(&mut self, peers: &[PeerSpec]) -> Vec<String> {
        self.primed.extend(peers.iter().map(|p| p.node.clone()));
        Vec::new()
    }
}
