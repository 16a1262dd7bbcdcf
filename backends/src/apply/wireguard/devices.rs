//! The implementation a node runs, one of the two behind `WgDevices`: the kernel device,
//! or the userspace device (weft's own, in a process of its own). Both create the device under the
//! same name, take the same per-peer changes and read back the same `WgDevice`; the
//! data plane does not care which one runs.

use weft_crypto::PrivateKey;

use super::diff::DeviceChange;
use super::kernel::{self, Kernel};
use super::process::UserspaceProcess;
use super::{WgDevice, WgDevices};
use crate::apply::{ApplyError, ObservedLink, RtNetlink};
use crate::netconf::Implementation;

/// The implementation a node runs, chosen once at start.
pub enum WgImpl {
    Kernel(Kernel),
    Userspace(UserspaceProcess),
}

impl WgImpl {
    /// Picks the implementation for `wanted`, saying why: `auto` takes the kernel's when
    /// the kernel accepts a `wireguard` link and falls back to userspace when it refuses;
    /// `kernel` without kernel support is an error naming the kernel's answer.
    pub async fn choose(
        wanted: Implementation,
        nl: &mut RtNetlink,
        device: &str,
        userspace: UserspaceProcess,
    ) -> Result<(WgImpl, String), ApplyError> {
        if wanted == Implementation::Userspace {
            return Ok((
                WgImpl::Userspace(userspace),
                "userspace (weft's device): Implementation=userspace".into(),
            ));
        }
        match kernel::probe(nl, device).await {
            Ok(()) => Ok((
                WgImpl::Kernel(Kernel::open()?),
                format!(
                    "kernel: the kernel accepts a wireguard link (Implementation={})",
                    if wanted == Implementation::Auto {
                        "auto"
                    } else {
                        "kernel"
                    }
                ),
            )),
            Err(refused) if wanted == Implementation::Auto => Ok((
                WgImpl::Userspace(userspace),
                format!("userspace (weft's device): the kernel has no WireGuard ({refused})"),
            )),
            Err(refused) => Err(ApplyError::Netlink {
                op: "Implementation=kernel".into(),
                source: std::io::Error::other(format!(
                    "the kernel has no WireGuard ({refused}); load the wireguard module, or \
                     use Implementation auto or userspace"
                )),
            }),
        }
    }
}

impl WgDevices for WgImpl {
    type Nl = RtNetlink;

    fn name(&self) -> &'static str {
        match self {
            WgImpl::Kernel(k) => k.name(),
            WgImpl::Userspace(u) => u.name(),
        }
    }

    async fn remove(nl: &mut RtNetlink, link: &ObservedLink) -> Result<(), ApplyError> {
        super::process::remove_device(nl, link).await
    }

    async fn ensure(&mut self, nl: &mut RtNetlink, device: &str) -> Result<bool, ApplyError> {
        match self {
            WgImpl::Kernel(k) => k.ensure(nl, device).await,
            WgImpl::Userspace(u) => u.ensure(nl, device).await,
        }
    }
    async fn get(&mut self, device: &str) -> Result<WgDevice, ApplyError> {
        match self {
            WgImpl::Kernel(k) => k.get(device).await,
            WgImpl::Userspace(u) => u.get(device).await,
        }
    }
    async fn apply(
        &mut self,
        device: &str,
        change: &DeviceChange,
        key: &PrivateKey,
    ) -> Result<(), ApplyError> {
        match self {
            WgImpl::Kernel(k) => k.apply(device, change, key).await,
            WgImpl::Userspace(u) => u.apply(device, change, key).await,
        }
    }
    fn writes(&self) -> u64 {
        match self {
            WgImpl::Kernel(k) => k.writes(),
            WgImpl::Userspace(u) => u.writes(),
        }
    }
}
