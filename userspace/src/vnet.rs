//! The `virtio_net_hdr` a TUN device opened with `IFF_VNET_HDR` puts before each packet:
//! how the packet is to be segmented (GSO) and where its checksum is still to be filled in.

pub const LEN: usize = 10;

/// `flags`: the checksum from `csum_start` to the end is still to be computed.
pub const F_NEEDS_CSUM: u8 = 1;

pub const GSO_NONE: u8 = 0;
pub const GSO_TCPV4: u8 = 1;
pub const GSO_TCPV6: u8 = 4;
pub const GSO_UDP_L4: u8 = 5;
/// Or'd into `gso_type`: the packet carries ECN (CWR belongs on the first segment only).
pub const GSO_ECN: u8 = 0x80;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
}

impl Header {
    /// Reads the header at the start of `buf` (the device's byte order is little-endian on
    /// every host weft runs on, and TUN uses the host's unless told otherwise).
    pub fn decode(buf: &[u8]) -> Option<Header> {
        let b = buf.get(..LEN)?;
        let u16_at = |i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
        Some(Header {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u16_at(2),
            gso_size: u16_at(4),
            csum_start: u16_at(6),
            csum_offset: u16_at(8),
        })
    }

    pub fn encode(&self, buf: &mut [u8]) {
        buf[0] = self.flags;
        buf[1] = self.gso_type;
        buf[2..4].copy_from_slice(&self.hdr_len.to_ne_bytes());
        buf[4..6].copy_from_slice(&self.gso_size.to_ne_bytes());
        buf[6..8].copy_from_slice(&self.csum_start.to_ne_bytes());
        buf[8..10].copy_from_slice(&self.csum_offset.to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let h = Header {
            flags: F_NEEDS_CSUM,
            gso_type: GSO_TCPV6,
            hdr_len: 72,
            gso_size: 1348,
            csum_start: 40,
            csum_offset: 16,
        };
        let mut buf = [0u8; LEN];
        h.encode(&mut buf);
        assert_eq!(Header::decode(&buf), Some(h));
        assert_eq!(Header::decode(&buf[..9]), None);
    }
}
