//! weft's userspace WireGuard device: weft's own WireGuard core (`wg`) under its own
//! packet loop, for kernels without WireGuard. Sessions are shared by the packet threads
//! and the crypto helpers (`pool`), which seal and open parts of a batch beside them.
//!
//! The I/O is where the time goes, so it is batched end to end: the TUN device hands
//! over TCP super-packets of up to 64 KiB (`IFF_VNET_HDR` with `TUNSETOFFLOAD`), which are
//! split in place (`segment`), encrypted straight into one buffer and sent with one UDP
//! GSO call (`udp`), which back-to-back super-packets share; received GRO batches are
//! decrypted straight into the packet being coalesced (`coalesce`), which grows across
//! batches while more are waiting, and written to the TUN device in one write. Plain threads with blocking loops, one
//! sending, one receiving per socket and one for timers; the state (`peers`) is read once
//! per batch. Every feature is probed at start and falls back on its own. The UAPI
//! (`uapi`) is served from the device's own state, so peers change in place.

pub mod checksum;
pub mod coalesce;
pub mod device;
pub mod fuzz_targets;
pub mod handshakes;
mod noise;
pub mod peers;
mod pool;
pub mod relay;
pub mod replay_file;
pub mod rx;
pub mod segment;
pub mod tun;
mod tx;
pub mod uapi;
pub mod udp;
pub mod vnet;
pub mod watchdog;
pub mod wg;

pub use device::Device;

/// The index of interface `name` in the caller's network namespace, if it exists (asked
/// of the kernel: sysfs may show another namespace).
pub fn ifindex(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (index != 0).then_some(index)
}

#[cfg(test)]
mod offload_tests;

#[doc(hidden)]
pub mod test_rng;
