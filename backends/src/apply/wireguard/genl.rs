//! Generic netlink to the kernel's WireGuard (family `wireguard`): `WG_CMD_GET_DEVICE`
//! dumps read back into a `WgDevice`, and the `WG_CMD_SET_DEVICE` messages of
//! `kernel_msg` sent one by one, each acknowledged. Blocking calls on a netlink socket:
//! the kernel answers at once.

use std::collections::BTreeMap;
use std::io;
use std::time::Duration;

use ipnet::IpNet;
use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP};
use netlink_packet_generic::ctrl::nlas::GenlCtrlAttrs;
use netlink_packet_generic::ctrl::{GenlCtrl, GenlCtrlCmd};
use netlink_packet_generic::GenlMessage;
use netlink_packet_wireguard::{
    WireguardAllowedIpAttr, WireguardAttribute, WireguardCmd, WireguardMessage,
    WireguardPeerAttribute,
};
use netlink_sys::protocols::NETLINK_GENERIC;

use crate::apply::nl_request::NlSocket;
use weft_crypto::{PresharedKey, PublicKey};

use super::{WgDevice, WgPeer};

pub struct Genl {
    socket: NlSocket,
    /// The `wireguard` family's id, resolved on first use: the family exists only once
    /// the module is loaded, which creating the first link does.
    family: Option<u16>,
}

impl Genl {
    pub fn open() -> io::Result<Self> {
        Ok(Genl {
            socket: NlSocket::open(NETLINK_GENERIC)?,
            family: None,
        })
    }

    fn family(&mut self) -> io::Result<u16> {
        if let Some(id) = self.family {
            return Ok(id);
        }
        let ask = GenlMessage::from_payload(GenlCtrl {
            cmd: GenlCtrlCmd::GetFamily,
            nlas: vec![GenlCtrlAttrs::FamilyName("wireguard".into())],
        });
        let answers = self.socket.request(ask, NLM_F_ACK)?;
        let id = answers
            .iter()
            .flat_map(|m| m.payload.nlas.iter())
            .find_map(|a| match a {
                GenlCtrlAttrs::FamilyId(id) => Some(*id),
                _ => None,
            })
            .ok_or_else(|| io::Error::other("the kernel named no id for family wireguard"))?;
        self.family = Some(id);
        Ok(id)
    }

    fn wg_request(
        &mut self,
        message: WireguardMessage,
        flags: u16,
    ) -> io::Result<Vec<WireguardMessage>> {
        let family = self.family()?;
        let mut msg = GenlMessage::from_payload(message);
        msg.set_resolved_family_id(family);
        let answers = self.socket.request(msg, flags)?;
        Ok(answers.into_iter().map(|m| m.payload).collect())
    }

    /// The device's configuration and peer statistics.
    pub fn get_device(&mut self, device: &str) -> io::Result<WgDevice> {
        let ask = WireguardMessage {
            cmd: WireguardCmd::GetDevice,
            attributes: vec![WireguardAttribute::IfName(device.to_string())],
        };
        let parts = self.wg_request(ask, NLM_F_DUMP)?;
        device_of(&parts).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    /// Sends one `WG_CMD_SET_DEVICE` message and waits for its acknowledgement.
    pub fn set_device(&mut self, message: WireguardMessage) -> io::Result<()> {
        self.wg_request(message, NLM_F_ACK).map(|_| ())
    }
}

fn key_bytes_are_zero(bytes: &[u8]) -> bool {
    bytes.iter().all(|b| *b == 0)
}

/// A device dump the kernel should never send: what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error("allowed IP {addr}/{prefix}: {source}")]
    AllowedIp {
        addr: std::net::IpAddr,
        prefix: u8,
        #[source]
        source: ipnet::PrefixLenError,
    },
    #[error("an allowed IP without address or prefix")]
    AllowedIpIncomplete,
    #[error("a peer without a public key")]
    PeerWithoutKey,
}

fn peer_of(attrs: &[WireguardPeerAttribute]) -> Result<(PublicKey, WgPeer), DumpError> {
    let mut key = None;
    let mut peer = WgPeer::default();
    for attr in attrs {
        match attr {
            WireguardPeerAttribute::PublicKey(k) => key = Some(PublicKey::from_bytes(*k)),
            WireguardPeerAttribute::PresharedKey(k) if !key_bytes_are_zero(k) => {
                peer.psk = Some(PresharedKey::from_bytes(*k));
            }
            WireguardPeerAttribute::Endpoint(e) if !e.ip().is_unspecified() => {
                peer.endpoint = Some(*e)
            }
            WireguardPeerAttribute::PersistentKeepalive(k) => peer.keepalive = *k,
            WireguardPeerAttribute::LastHandshake(t) if t.seconds > 0 || t.nano_seconds > 0 => {
                let secs = u64::try_from(t.seconds).unwrap_or(0);
                let nanos = u32::try_from(t.nano_seconds).unwrap_or(0).min(999_999_999);
                peer.last_handshake = Some(Duration::new(secs, nanos));
            }
            WireguardPeerAttribute::RxBytes(n) => peer.rx_bytes = *n,
            WireguardPeerAttribute::TxBytes(n) => peer.tx_bytes = *n,
            WireguardPeerAttribute::AllowedIps(ips) => {
                for ip in ips {
                    let (mut addr, mut cidr) = (None, None);
                    for a in &ip.0 {
                        match a {
                            WireguardAllowedIpAttr::IpAddr(x) => addr = Some(*x),
                            WireguardAllowedIpAttr::Cidr(c) => cidr = Some(*c),
                            _ => {}
                        }
                    }
                    match (addr, cidr) {
                        (Some(a), Some(c)) => {
                            peer.allowed_ips.push(IpNet::new(a, c).map_err(|source| {
                                DumpError::AllowedIp {
                                    addr: a,
                                    prefix: c,
                                    source,
                                }
                            })?)
                        }
                        _ => return Err(DumpError::AllowedIpIncomplete),
                    }
                }
            }
            _ => {}
        }
    }
    let key = key.ok_or(DumpError::PeerWithoutKey)?;
    Ok((key, peer))
}

/// Folds the parts of one `WG_CMD_GET_DEVICE` dump into a device. The kernel sends the
/// device's own attributes in the first part and may continue one peer across parts (its
/// AllowedIPs then carry on in the next part, under the same public key).
pub fn device_of(parts: &[WireguardMessage]) -> Result<WgDevice, DumpError> {
    let mut device = WgDevice::default();
    let mut peers: BTreeMap<PublicKey, WgPeer> = BTreeMap::new();
    for part in parts {
        for attr in &part.attributes {
            match attr {
                WireguardAttribute::PublicKey(k) if !key_bytes_are_zero(k) => {
                    device.public_key = Some(PublicKey::from_bytes(*k));
                }
                WireguardAttribute::ListenPort(p) => device.listen_port = *p,
                WireguardAttribute::Peers(list) => {
                    for p in list {
                        let (key, peer) = peer_of(&p.0)?;
                        match peers.get_mut(&key) {
                            Some(seen) => seen.allowed_ips.extend(peer.allowed_ips),
                            None => {
                                peers.insert(key, peer);
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }
    for peer in peers.values_mut() {
        peer.allowed_ips.sort();
    }
    device.peers = peers;
    Ok(device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_wireguard::{
        WireguardAddressFamily, WireguardAllowedIp, WireguardPeer, WireguardTimeSpec,
    };

    fn allowed(net: &str) -> WireguardAllowedIp {
        let net: IpNet = net.parse().unwrap();
        WireguardAllowedIp(vec![
            WireguardAllowedIpAttr::Family(WireguardAddressFamily::Ipv4),
            WireguardAllowedIpAttr::IpAddr(net.network()),
            WireguardAllowedIpAttr::Cidr(net.prefix_len()),
        ])
    }

    #[test]
    fn a_dump_split_across_parts_folds_into_one_device() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let first = WireguardMessage {
            cmd: WireguardCmd::GetDevice,
            attributes: vec![
                WireguardAttribute::IfName("flannel-wg".into()),
                WireguardAttribute::PublicKey([9; 32]),
                WireguardAttribute::ListenPort(51820),
                WireguardAttribute::Peers(vec![
                    WireguardPeer(vec![
                        WireguardPeerAttribute::PublicKey(a),
                        WireguardPeerAttribute::PresharedKey([0; 32]),
                        WireguardPeerAttribute::Endpoint("198.51.100.2:51820".parse().unwrap()),
                        WireguardPeerAttribute::LastHandshake(WireguardTimeSpec::default()),
                        WireguardPeerAttribute::RxBytes(7),
                        WireguardPeerAttribute::AllowedIps(vec![allowed("10.244.2.0/24")]),
                    ]),
                    WireguardPeer(vec![
                        WireguardPeerAttribute::PublicKey(b),
                        WireguardPeerAttribute::PresharedKey([5; 32]),
                        WireguardPeerAttribute::LastHandshake(WireguardTimeSpec {
                            seconds: 1_800_000_000,
                            nano_seconds: 5,
                        }),
                        WireguardPeerAttribute::AllowedIps(vec![allowed("10.244.4.0/24")]),
                    ]),
                ]),
            ],
        };
        // The second part continues peer b's AllowedIPs.
        let second = WireguardMessage {
            cmd: WireguardCmd::GetDevice,
            attributes: vec![WireguardAttribute::Peers(vec![WireguardPeer(vec![
                WireguardPeerAttribute::PublicKey(b),
                WireguardPeerAttribute::AllowedIps(vec![allowed("10.244.3.0/24")]),
            ])])],
        };
        let dev = device_of(&[first, second]).unwrap();
        assert_eq!(dev.public_key, Some(PublicKey::from_bytes([9; 32])));
        assert_eq!(dev.listen_port, 51820);
        assert_eq!(dev.peers.len(), 2);
        let pa = &dev.peers[&PublicKey::from_bytes(a)];
        assert_eq!(pa.psk, None, "an all-zero PSK means none");
        assert_eq!(
            pa.last_handshake, None,
            "a zero time means no handshake yet"
        );
        assert_eq!(pa.endpoint, Some("198.51.100.2:51820".parse().unwrap()));
        assert_eq!(pa.rx_bytes, 7);
        let pb = &dev.peers[&PublicKey::from_bytes(b)];
        assert!(pb.psk.is_some());
        assert_eq!(pb.last_handshake, Some(Duration::new(1_800_000_000, 5)));
        assert_eq!(
            pb.allowed_ips,
            vec![
                "10.244.3.0/24".parse::<IpNet>().unwrap(),
                "10.244.4.0/24".parse().unwrap()
            ],
            "AllowedIPs continued in the next part are merged, sorted"
        );
    }

    #[test]
    fn a_peer_without_a_key_is_an_error_not_a_panic() {
        let part = WireguardMessage {
            cmd: WireguardCmd::GetDevice,
            attributes: vec![WireguardAttribute::Peers(vec![WireguardPeer(vec![
                WireguardPeerAttribute::RxBytes(1),
            ])])],
        };
        assert!(matches!(device_of(&[part]), Err(DumpError::PeerWithoutKey)));
    }
}
