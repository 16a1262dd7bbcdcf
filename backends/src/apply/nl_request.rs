//! One blocking netlink socket that sends a request and collects its answers, for the
//! families rtnetlink does not cover: generic netlink (WireGuard) and XFRM. The kernel
//! answers these at once.

use std::io;

use netlink_packet_core::{
    NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable,
    NLM_F_REQUEST,
};
use netlink_sys::{Socket, SocketAddr};

/// Room for the largest message the kernel sends in one datagram.
const RECV_BUFFER: usize = 1 << 17;

pub struct NlSocket {
    socket: Socket,
    seq: u32,
}

impl NlSocket {
    /// A socket of netlink protocol `protocol`, bound and connected to the kernel.
    pub fn open(protocol: isize) -> io::Result<Self> {
        let mut socket = Socket::new(protocol)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(NlSocket { socket, seq: 0 })
    }

    /// Sends `payload` and collects the answers: until `NLMSG_DONE` for a dump, until the
    /// acknowledgement otherwise. An error answer becomes the `io::Error` of its errno.
    pub fn request<T>(&mut self, payload: T, flags: u16) -> io::Result<Vec<T>>
    where
        T: NetlinkSerializable + NetlinkDeserializable + std::fmt::Debug,
    {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.seq;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(payload));
        msg.finalize();
        let mut buf = vec![0u8; msg.buffer_len()];
        msg.serialize(&mut buf);
        self.socket.send(&buf, 0)?;
        let mut answers = Vec::new();
        loop {
            let mut data: Vec<u8> = Vec::with_capacity(RECV_BUFFER);
            let n = self.socket.recv(&mut data, 0)?;
            let mut offset = 0;
            while offset < n {
                let reply = NetlinkMessage::<T>::deserialize(&data[offset..n])
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                let len = reply.header.length as usize;
                if len == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "a netlink message of length 0",
                    ));
                }
                offset += len;
                if reply.header.sequence_number != self.seq {
                    continue;
                }
                match reply.payload {
                    NetlinkPayload::InnerMessage(inner) => answers.push(inner),
                    NetlinkPayload::Error(e) if e.code.is_some() => return Err(e.to_io()),
                    NetlinkPayload::Error(_) | NetlinkPayload::Done(_) => return Ok(answers),
                    _ => {}
                }
            }
        }
    }
}
