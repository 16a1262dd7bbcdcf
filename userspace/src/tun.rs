//! The TUN device: opened with `IFF_VNET_HDR` so that, with `TUNSETOFFLOAD`, the kernel
//! hands over TCP (and, from Linux 6.2, UDP) super-packets of up to 64 KiB with their
//! checksums left to fill in, and takes such packets back.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const CLONE_DEVICE: &str = "/dev/net/tun";
/// The interface's transmit queue: deep enough for bursts the reader is behind on.
const TX_QUEUE_LEN: i32 = 10_000;

/// What the device does, as probed at start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Offloads {
    /// Packets carry a vnet header.
    pub vnet: bool,
    /// TCP segmentation offload: reads may be TCP super-packets, writes may be too.
    pub tso: bool,
    /// UDP segmentation offload (Linux 6.2 and later).
    pub uso: bool,
}

pub struct Tun {
    pub file: File,
    pub offloads: Offloads,
}

#[repr(C)]
struct IfReq {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

fn ifreq(name: &str, flags: libc::c_int) -> io::Result<IfReq> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface name {name:?} must be 1 to 15 bytes"),
        ));
    }
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: flags as libc::c_short,
        _pad: [0; 22],
    };
    for (d, s) in req.name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    Ok(req)
}

fn ioctl_int(fd: &File, request: libc::Ioctl, value: libc::c_ulong) -> io::Result<()> {
    // SAFETY: TUN's integer ioctls take their argument by value; `fd` is open.
    if unsafe { libc::ioctl(fd.as_raw_fd(), request, value) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl Tun {
    /// Creates (or attaches to) the TUN interface `name` and turns on every offload the
    /// kernel has, falling back one feature at a time.
    pub fn open(name: &str) -> io::Result<Tun> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(CLONE_DEVICE)
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "{CLONE_DEVICE}: {e} (load the tun module, or in a container mount the \
                         host's {CLONE_DEVICE})"
                    ),
                )
            })?;
        let mut offloads = Offloads::default();
        let base = libc::IFF_TUN | libc::IFF_NO_PI;
        let mut req = ifreq(name, base | libc::IFF_VNET_HDR)?;
        // SAFETY: `req` is a properly laid out ifreq that outlives the call.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) } == 0 {
            offloads.vnet = true;
        } else {
            let mut req = ifreq(name, base)?;
            // SAFETY: as above.
            if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        if offloads.vnet {
            let tcp = libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6 | libc::TUN_F_TSO_ECN;
            let udp = libc::TUN_F_USO4 | libc::TUN_F_USO6;
            if ioctl_int(&file, libc::TUNSETOFFLOAD, (tcp | udp).into()).is_ok() {
                (offloads.tso, offloads.uso) = (true, true);
            } else if ioctl_int(&file, libc::TUNSETOFFLOAD, tcp.into()).is_ok() {
                offloads.tso = true;
            }
        }
        set_tx_queue_len(name);
        Ok(Tun { file, offloads })
    }

    /// A second handle on the same queue, for the thread that writes.
    pub fn try_clone(&self) -> io::Result<File> {
        self.file.try_clone()
    }
}

/// Whether the interface the queue `file` belongs to still exists, in whatever network
/// namespace it is now. Moving the interface to another namespace leaves the queue
/// attached (as kernel WireGuard's device keeps its sockets where it was created);
/// deleting it detaches the queue, and the kernel then answers TUNGETIFF with EBADFD.
pub fn attached(file: &File) -> bool {
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: 0,
        _pad: [0; 22],
    };
    // SAFETY: TUNGETIFF fills an ifreq; `req` is one and outlives the call.
    unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNGETIFF, &mut req) == 0 }
}

/// Whether a failed read of a TUN queue means its interface is gone: a reader blocked
/// when the interface is deleted wakes with EFAULT (the queue's socket is shut down),
/// and a later read finds the queue detached (EBADFD).
pub fn deleted(e: &io::Error, file: &File) -> bool {
    matches!(e.raw_os_error(), Some(libc::EFAULT | libc::EBADFD)) && !attached(file)
}

/// Best effort: a failure only leaves the default queue (500 packets).
fn set_tx_queue_len(name: &str) {
    let _ = interface_int(name, libc::SIOCSIFTXQLEN as _, Some(TX_QUEUE_LEN));
}

/// The MTU a device starts with, as kernel WireGuard's: 1500 less WireGuard over IPv6.
pub const DEFAULT_MTU: i32 = 1420;

/// Sets the interface's MTU.
pub fn set_mtu(name: &str, mtu: i32) -> io::Result<()> {
    interface_int(name, libc::SIOCSIFMTU as _, Some(mtu)).map(|_| ())
}

/// The interface's MTU.
pub fn mtu(name: &str) -> io::Result<i32> {
    interface_int(name, libc::SIOCGIFMTU as _, None)
}

/// An interface ioctl whose argument is an int (`ifr_mtu`, `ifr_qlen`): sets it to
/// `value` when given, and returns what the kernel left in it.
fn interface_int(name: &str, request: libc::Ioctl, value: Option<i32>) -> io::Result<i32> {
    // SAFETY: a plain socket(2) call; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned here alone.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = ifreq(name, 0)?;
    // The int shares the union with ifr_flags, at the same offset.
    let at = &mut req as *mut IfReq as *mut u8;
    // SAFETY: the union after the name is 24 bytes; an int fits at its start.
    unsafe {
        if let Some(v) = value {
            std::ptr::copy_nonoverlapping(v.to_ne_bytes().as_ptr(), at.add(libc::IFNAMSIZ), 4);
        }
        if libc::ioctl(sock.as_raw_fd(), request, &mut req) < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut out = [0u8; 4];
        std::ptr::copy_nonoverlapping(at.add(libc::IFNAMSIZ), out.as_mut_ptr(), 4);
        Ok(i32::from_ne_bytes(out))
    }
}
