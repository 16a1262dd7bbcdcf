//! The implementation a node runs, one of the two behind `WgDevices`: the kernel device,
//! or the userspace device (weft's own, in a process of its own). Both create the device under the
//! same name, take the same per-peer changes and read back the same `WgDevice`; the
//! data plane does not care which one runs.

use std::collections::HashMap;
use std::time::Duration;

use weft_crypto::{PrivateKey, PublicKey};

use super::diff::{DeviceChange, PeerChange, PeerFields};
use super::kernel::{self, Kernel};
use super::process::UserspaceProcess;
use super::{WgDevice, WgDevices};
use crate::apply::{ApplyError, ObservedLink, RtNetlink};
use crate::model::KeyMove;
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

impl WgImpl {
    /// Another handle on the same implementation's devices, with connections of its own
    /// (it starts no device processes: it reads and changes devices that exist).
    pub fn another(&self) -> Result<WgImpl, ApplyError> {
        Ok(match self {
            WgImpl::Kernel(_) => WgImpl::Kernel(Kernel::open()?),
            WgImpl::Userspace(u) => WgImpl::Userspace(u.another()),
        })
    }

    /// The last handshake of every peer of `device` that has handshaken, read now.
    pub async fn handshakes(
        &mut self,
        device: &str,
    ) -> Result<HashMap<PublicKey, Duration>, ApplyError> {
        let observed = self.get(device).await?;
        Ok(observed
            .peers
            .into_iter()
            .filter_map(|(k, p)| Some((k, p.last_handshake.filter(|t| !t.is_zero())?)))
            .collect())
    }

    /// Switches a peer to its next key (`KeyMove`) in one device update: the next key's
    /// entry takes the AllowedIPs, which leave the current entry as they arrive (the
    /// current entry itself goes in the next pass). Nothing else of either entry changes.
    pub async fn move_to_next_key(&mut self, moved: &KeyMove) -> Result<(), ApplyError> {
        let change = DeviceChange {
            set_private_key: false,
            listen_port: None,
            peers: vec![PeerChange::Update {
                spec: moved.next.clone(),
                fields: PeerFields {
                    allowed_ips: Some(moved.next.allowed_ips.clone()),
                    ..PeerFields::default()
                },
            }],
        };
        // The change does not set the device's key, so no key is sent.
        let unused = PrivateKey::from_bytes([0; 32]);
        self.apply(&moved.device, &change, &unused).await
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
