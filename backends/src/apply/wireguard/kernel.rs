//! The kernel WireGuard device: the link is created over rtnetlink (type `wireguard`), its
//! key, port and peers are set and read over generic netlink. The device lives in the
//! kernel, so it outlives the agent.

use weft_crypto::PrivateKey;

use super::diff::DeviceChange;
use super::genl::Genl;
use super::kernel_msg::{set_device_messages, MESSAGE_BUDGET};
use super::{WgDevice, WgDevices};
use crate::apply::{ApplyError, Netlink, ObservedLink, RtNetlink};

/// The link type the kernel calls WireGuard.
pub const KIND: &str = "wireguard";

pub struct Kernel {
    genl: Genl,
    writes: u64,
}

fn err(op: String) -> impl FnOnce(std::io::Error) -> ApplyError {
    move |source| ApplyError::Netlink { op, source }
}

impl Kernel {
    pub fn open() -> Result<Self, ApplyError> {
        let genl = Genl::open().map_err(err("opening a generic netlink socket".into()))?;
        Ok(Kernel { genl, writes: 0 })
    }
}

impl WgDevices for Kernel {
    type Nl = RtNetlink;

    fn name(&self) -> &'static str {
        "kernel"
    }

    async fn remove(nl: &mut RtNetlink, link: &ObservedLink) -> Result<(), ApplyError> {
        super::process::remove_device(nl, link).await
    }

    /// Creates `device` unless a kernel WireGuard link of that name exists; a link of
    /// another type under the name (a userspace device left by an earlier run) is replaced.
    /// Returns whether the device was created.
    async fn ensure(&mut self, nl: &mut RtNetlink, device: &str) -> Result<bool, ApplyError> {
        if let Some(link) = nl.link(device).await? {
            if link.kind.as_deref() == Some(KIND) {
                return Ok(false);
            }
            super::process::remove_device(nl, &link).await?;
        }
        nl.add_wireguard_link(device).await?;
        Ok(true)
    }

    async fn get(&mut self, device: &str) -> Result<WgDevice, ApplyError> {
        self.genl
            .get_device(device)
            .map_err(err(format!("reading WireGuard device {device}")))
    }

    /// Applies `change` in as many messages as it needs; stops at the first refused.
    async fn apply(
        &mut self,
        device: &str,
        change: &DeviceChange,
        key: &PrivateKey,
    ) -> Result<(), ApplyError> {
        for message in set_device_messages(device, change, key, MESSAGE_BUDGET) {
            self.writes += 1;
            self.genl
                .set_device(message)
                .map_err(err(format!("configuring WireGuard device {device}")))?;
        }
        Ok(())
    }

    fn writes(&self) -> u64 {
        self.writes
    }
}

/// The name of the link `probe` creates and deletes.
const PROBE: &str = "weft-probe-wg";

/// Whether the kernel has WireGuard: a `wireguard` link named `existing` is proof; else a
/// probe link is created and deleted again. The error is the kernel's refusal.
pub async fn probe(nl: &mut RtNetlink, existing: &str) -> Result<(), ApplyError> {
    if let Some(link) = nl.link(existing).await? {
        if link.kind.as_deref() == Some(KIND) {
            return Ok(());
        }
    }
    if let Some(stale) = nl.link(PROBE).await? {
        nl.del_link(&stale).await?;
    }
    nl.add_wireguard_link(PROBE).await?;
    if let Some(link) = nl.link(PROBE).await? {
        nl.del_link(&link).await?;
    }
    Ok(())
}
