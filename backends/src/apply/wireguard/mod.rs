//! WireGuard devices: what a device holds (`WgDevice`), the per-peer diff against the plan
//! (`diff`), and the cross-process text protocol both `wg` and userspace devices speak
//! (`uapi`). The device implementations (kernel over generic netlink, userspace) build on
//! these.

pub mod devices;
pub mod diff;
pub mod drift;
pub mod genl;
pub mod kernel;
pub mod kernel_msg;
pub(crate) mod pass;
pub mod process;
pub mod read;
pub(crate) mod seen;
pub mod uapi;
pub mod uapi_socket;
pub mod userspace;

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use ipnet::IpNet;
use weft_crypto::{PresharedKey, PrivateKey, PublicKey};

use crate::apply::{ApplyError, Netlink, ObservedLink};
use crate::model::PeerSpec;
use diff::DeviceChange;

/// What a WireGuard implementation does, whichever it is: the kernel device
/// (`kernel::Kernel`) and the userspace device (`process::UserspaceProcess`) implement
/// it, and `devices::WgImpl` is the one a node runs.
pub trait WgDevices {
    /// The links this implementation creates its devices through.
    type Nl: Netlink;
    /// Creates `device` unless this implementation already runs it (replacing whatever
    /// else holds the name). Returns whether it was created.
    fn ensure(
        &mut self,
        nl: &mut Self::Nl,
        device: &str,
    ) -> impl Future<Output = Result<bool, ApplyError>>;
    /// `kernel`, `userspace`, …: which implementation this is.
    fn name(&self) -> &'static str;
    /// Removes a WireGuard device of either kind (a backend or mode change), whether or not
    /// this node runs an implementation.
    fn remove(
        nl: &mut Self::Nl,
        link: &ObservedLink,
    ) -> impl Future<Output = Result<(), ApplyError>>;
    fn get(&mut self, device: &str) -> impl Future<Output = Result<WgDevice, ApplyError>>;
    fn apply(
        &mut self,
        device: &str,
        change: &DeviceChange,
        key: &PrivateKey,
    ) -> impl Future<Output = Result<(), ApplyError>>;
    /// Writes made so far.
    fn writes(&self) -> u64;
    /// Starts a handshake with each of `peers` now (see `pass::prime_handshakes`), once
    /// their routes exist; returns one line per failure.
    fn start_handshakes(&mut self, peers: &[PeerSpec]) -> Vec<String> {
        pass::prime_handshakes(peers)
    }
}

/// A WireGuard device as read back from the kernel or a userspace implementation.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WgDevice {
    /// The device's own public key; `None` when no private key is set.
    pub public_key: Option<PublicKey>,
    pub listen_port: u16,
    pub peers: BTreeMap<PublicKey, WgPeer>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct WgPeer {
    pub endpoint: Option<SocketAddr>,
    /// Sorted.
    pub allowed_ips: Vec<IpNet>,
    /// Seconds; 0 = off.
    pub keepalive: u16,
    pub psk: Option<PresharedKey>,
    /// Time since the Unix epoch of the last handshake, as the device reports it.
    pub last_handshake: Option<Duration>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}
