//! Kernel WireGuard configuration messages (generic netlink `WG_CMD_SET_DEVICE`), built
//! purely from a `DeviceChange`. Large changes are split across messages, each within a
//! byte budget: the device's own settings go in the first, but a new private key in a last
//! message of its own, after every peer's change; a peer whose AllowedIPs do not fit
//! continues in the next message as an update that appends (no replace), as
//! wireguard-tools does. Peers are updated in place (`UpdateOnly`), never by replacing the
//! whole set.
//!
//! Why the key goes last: kernel WireGuard applies a message's private key before its
//! peers, and a new key expires every session, so the next packet (pod traffic never
//! stops) starts a handshake at once, in between, with the PSK each peer still has. On a
//! key switch that is the post-quantum PSK of the old key's pair, which the peer does not
//! hold for the new key: the initiation fails and WireGuard retries only 5 s later. Seen
//! in the VM: a 2 s hole in a 100 pps ping and a 5 s TCP stall during a one-node
//! rotation. With the peers' PSKs changed first, the old key's sessions carry the traffic
//! until the key changes, and the first handshake under it has the right PSKs.

use ipnet::IpNet;
use netlink_packet_core::Emitable;
use netlink_packet_wireguard::{
    WireguardAddressFamily, WireguardAllowedIp, WireguardAllowedIpAttr, WireguardAttribute,
    WireguardCmd, WireguardMessage, WireguardPeer, WireguardPeerAttribute, WireguardPeerFlags,
};
use weft_crypto::{PrivateKey, PublicKey, KEY_LEN};

use super::diff::{DeviceChange, PeerChange, PeerFields};
use crate::model::PeerSpec;

/// Default budget for one message's attributes: well inside a netlink socket's buffer.
pub const MESSAGE_BUDGET: usize = 16 * 1024;

fn allowed_ip(net: &IpNet) -> WireguardAllowedIp {
    let family = match net {
        IpNet::V4(_) => WireguardAddressFamily::Ipv4,
        IpNet::V6(_) => WireguardAddressFamily::Ipv6,
    };
    WireguardAllowedIp(vec![
        WireguardAllowedIpAttr::Family(family),
        WireguardAllowedIpAttr::IpAddr(net.network()),
        WireguardAllowedIpAttr::Cidr(net.prefix_len()),
    ])
}

/// One peer operation, its AllowedIPs kept apart so they can be split.
struct PeerOp {
    head: Vec<WireguardPeerAttribute>,
    flags: WireguardPeerFlags,
    allowed: Vec<IpNet>,
    key: PublicKey,
}

fn op_of(change: &PeerChange) -> PeerOp {
    let full = |p: &PeerSpec, flags: WireguardPeerFlags| {
        let head = vec![
            WireguardPeerAttribute::Endpoint(p.endpoint),
            WireguardPeerAttribute::PersistentKeepalive(p.keepalive),
            WireguardPeerAttribute::PresharedKey(
                p.psk.as_ref().map_or([0; KEY_LEN], |k| *k.as_bytes()),
            ),
        ];
        PeerOp {
            head,
            flags: flags | WireguardPeerFlags::ReplaceAllowedIps,
            allowed: p.allowed_ips.clone(),
            key: p.public_key,
        }
    };
    match change {
        PeerChange::Add(p) => full(p, WireguardPeerFlags::empty()),
        PeerChange::Update { spec, fields } => {
            let PeerFields {
                endpoint,
                allowed_ips,
                keepalive,
                psk,
            } = fields;
            let mut head = Vec::new();
            if let Some(e) = endpoint {
                head.push(WireguardPeerAttribute::Endpoint(*e));
            }
            if let Some(k) = keepalive {
                head.push(WireguardPeerAttribute::PersistentKeepalive(*k));
            }
            if let Some(psk) = psk {
                head.push(WireguardPeerAttribute::PresharedKey(
                    psk.as_ref().map_or([0; KEY_LEN], |k| *k.as_bytes()),
                ));
            }
            let mut flags = WireguardPeerFlags::UpdateOnly;
            if allowed_ips.is_some() {
                flags |= WireguardPeerFlags::ReplaceAllowedIps;
            }
            PeerOp {
                head,
                flags,
                allowed: allowed_ips.clone().unwrap_or_default(),
                key: spec.public_key,
            }
        }
        PeerChange::Remove { key } => PeerOp {
            head: Vec::new(),
            flags: WireguardPeerFlags::RemoveMe,
            allowed: Vec::new(),
            key: *key,
        },
    }
}

fn peer(op: &PeerOp, flags: WireguardPeerFlags, head: bool, allowed: &[IpNet]) -> WireguardPeer {
    let mut attrs = vec![
        WireguardPeerAttribute::PublicKey(*op.key.as_bytes()),
        WireguardPeerAttribute::Flags(flags),
    ];
    if head {
        attrs.extend(op.head.iter().cloned());
    }
    if !allowed.is_empty() {
        attrs.push(WireguardPeerAttribute::AllowedIps(
            allowed.iter().map(allowed_ip).collect(),
        ));
    }
    WireguardPeer(attrs)
}

/// Fills messages up to the budget. Lengths are tracked incrementally: each peer entry's
/// encoded size is measured once, so building is linear in the number of peers.
struct Builder {
    device: String,
    budget: usize,
    own: Vec<WireguardAttribute>,
    done: Vec<WireguardMessage>,
    peers: Vec<WireguardPeer>,
    /// Encoded length of the message being filled.
    len: usize,
}

const NLA_HEADER: usize = 4;

impl Builder {
    fn message(&self, first: bool, peers: Vec<WireguardPeer>) -> WireguardMessage {
        let mut attributes = vec![WireguardAttribute::IfName(self.device.clone())];
        if first {
            attributes.extend(self.own.iter().cloned());
        }
        if !peers.is_empty() {
            attributes.push(WireguardAttribute::Peers(peers));
        }
        WireguardMessage {
            cmd: WireguardCmd::SetDevice,
            attributes,
        }
    }

    fn empty_len(&self) -> usize {
        self.message(self.done.is_empty(), Vec::new()).buffer_len()
    }

    /// Encoded size of one peer entry inside the `Peers` attribute.
    fn entry_len(&self, entry: &WireguardPeer) -> usize {
        self.message(false, vec![entry.clone()]).buffer_len()
            - self.message(false, Vec::new()).buffer_len()
            - NLA_HEADER
    }

    fn len_with(&self, entry: &WireguardPeer) -> usize {
        let base = if self.peers.is_empty() {
            self.empty_len() + NLA_HEADER
        } else {
            self.len
        };
        base + self.entry_len(entry)
    }

    /// Whether `entry` fits in a message of its own (not the first).
    fn fits_alone(&self, entry: &WireguardPeer) -> bool {
        self.message(false, vec![entry.clone()]).buffer_len() <= self.budget
    }

    fn flush(&mut self) {
        let first = self.done.is_empty();
        let peers = std::mem::take(&mut self.peers);
        let msg = self.message(first, peers);
        self.done.push(msg);
        self.len = 0;
    }

    /// Adds a peer entry, starting a new message first if it would not fit.
    fn push(&mut self, entry: WireguardPeer) {
        if !self.peers.is_empty() && self.len_with(&entry) > self.budget {
            self.flush();
        }
        self.len = self.len_with(&entry);
        self.peers.push(entry);
    }
}

/// The `WG_CMD_SET_DEVICE` messages that apply `change` to `device`; none if it is empty.
pub fn set_device_messages(
    device: &str,
    change: &DeviceChange,
    private_key: &PrivateKey,
    budget: usize,
) -> Vec<WireguardMessage> {
    let mut own = Vec::new();
    if let Some(port) = change.listen_port {
        own.push(WireguardAttribute::ListenPort(port));
    }
    let mut b = Builder {
        device: device.to_string(),
        budget,
        own,
        done: Vec::new(),
        peers: Vec::new(),
        len: 0,
    };
    for op in change.peers.iter().map(op_of) {
        let whole = peer(&op, op.flags, true, &op.allowed);
        if op.allowed.len() <= 1 || b.fits_alone(&whole) {
            b.push(whole);
            continue;
        }
        // Too many AllowedIPs for one message: the first part replaces, the rest append.
        let mut rest: &[IpNet] = &op.allowed;
        let mut first = true;
        while !rest.is_empty() {
            let flags = if first {
                op.flags
            } else {
                (op.flags - WireguardPeerFlags::ReplaceAllowedIps) | WireguardPeerFlags::UpdateOnly
            };
            let mut n = rest.len();
            while n > 1 && !b.fits_alone(&peer(&op, flags, first, &rest[..n])) {
                n /= 2;
            }
            b.push(peer(&op, flags, first, &rest[..n]));
            rest = &rest[n..];
            first = false;
        }
    }
    if !b.peers.is_empty() || (!b.own.is_empty() && b.done.is_empty()) {
        b.flush();
    }
    if change.set_private_key {
        let mut last = b.message(false, Vec::new());
        last.attributes
            .push(WireguardAttribute::PrivateKey(*private_key.as_bytes()));
        b.done.push(last);
    }
    b.done
}

#[cfg(test)]
mod tests;
