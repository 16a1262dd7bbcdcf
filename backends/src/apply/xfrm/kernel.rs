//! XFRM netlink: states and policies read with dumps, written one acknowledged message at
//! a time, over one blocking netlink socket (the kernel answers at once). And the UDP
//! socket that makes the kernel take ESP in UDP on port 4500.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use ipnet::Ipv4Net;
use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP};
use netlink_packet_xfrm::policy::{DelGetMessage as PolicyId, ModifyMessage as PolicyMessage};
use netlink_packet_xfrm::state::{
    DelGetMessage as SaId, GetDumpMessage, ModifyMessage as SaMessage,
};
use netlink_packet_xfrm::{
    Address, AlgAead, EncapTmpl, Id, LifetimeConfig, ReplayEsn, Selector, UserPolicyId,
    UserPolicyInfo, UserSaId, UserSaInfo, UserTemplate, XfrmAttrs, XfrmMessage, AF_INET,
    IPPROTO_ESP, UDP_ENCAP_ESPINUDP, XFRM_INF, XFRM_MODE_TUNNEL, XFRM_POLICY_ALLOW,
    XFRM_POLICY_FWD, XFRM_POLICY_IN, XFRM_POLICY_OUT, XFRM_STATE_ESN,
};
use netlink_sys::protocols::NETLINK_XFRM;

use super::{ObservedSa, PolicyDir, PolicySpec, SaSpec, Xfrm, ESP_UDP_PORT, REPLAY_WINDOW};
use crate::apply::nl_request::NlSocket;
use crate::apply::ApplyError;

pub struct XfrmSocket {
    socket: NlSocket,
    writes: u64,
}

fn failed(op: String) -> impl FnOnce(io::Error) -> ApplyError {
    move |source| ApplyError::Netlink { op, source }
}

impl XfrmSocket {
    pub fn open() -> Result<Self, ApplyError> {
        let socket = NlSocket::open(NETLINK_XFRM)
            .map_err(failed("opening an XFRM netlink socket".into()))?;
        Ok(XfrmSocket { socket, writes: 0 })
    }

    fn write(
        &mut self,
        message: XfrmMessage,
        op: impl FnOnce() -> String,
    ) -> Result<(), ApplyError> {
        self.writes += 1;
        self.socket
            .request(message, NLM_F_ACK)
            .map(|_| ())
            .map_err(|e| failed(op())(e))
    }
}

/// No byte, packet or time limit: weft replaces states itself.
fn unlimited() -> LifetimeConfig {
    LifetimeConfig {
        soft_byte_limit: XFRM_INF,
        hard_byte_limit: XFRM_INF,
        soft_packet_limit: XFRM_INF,
        hard_packet_limit: XFRM_INF,
        ..Default::default()
    }
}

fn v4(addr: &Address) -> Ipv4Addr {
    addr.to_ipv4()
}

fn selector(src: Ipv4Net, dst: Ipv4Net) -> Selector {
    let mut s = Selector::default();
    s.source_prefix(&IpAddr::V4(src.network()), src.prefix_len());
    s.destination_prefix(&IpAddr::V4(dst.network()), dst.prefix_len());
    s.family = AF_INET;
    s
}

fn dir_code(dir: PolicyDir) -> u8 {
    match dir {
        PolicyDir::In => XFRM_POLICY_IN,
        PolicyDir::Out => XFRM_POLICY_OUT,
        PolicyDir::Fwd => XFRM_POLICY_FWD,
    }
}

fn nul_trimmed(name: &[u8]) -> String {
    let end = name.iter().position(|b| *b == 0).unwrap_or(name.len());
    String::from_utf8_lossy(&name[..end]).into_owned()
}

fn observed_sa(m: &SaMessage, if_id: u32) -> Option<ObservedSa> {
    if !m.nlas.contains(&XfrmAttrs::IfId(if_id)) || m.user_sa_info.id.proto != IPPROTO_ESP {
        return None;
    }
    let info = &m.user_sa_info;
    let mut sa = ObservedSa {
        spec: SaSpec {
            src: v4(&info.saddr),
            dst: v4(&info.id.daddr),
            spi: info.id.spi,
            algorithm: String::new(),
            key: super::EspKey::default(),
            icv_bits: 0,
            udp_encap: false,
            if_id,
            reqid: info.reqid,
        },
        bytes: info.lifetime_cur.bytes,
        packets: info.lifetime_cur.packets,
        replay_failed: info.stats.replay,
        integrity_failed: info.stats.integrity_failed,
        replay_window: u32::from(info.replay_window),
        esn: info.flags & XFRM_STATE_ESN != 0,
    };
    for attr in &m.nlas {
        match attr {
            XfrmAttrs::EncryptionAlgAead(a) => {
                sa.spec.algorithm = nul_trimmed(&a.alg_name);
                sa.spec.key = super::EspKey::new(&a.alg_key);
                sa.spec.icv_bits = a.alg_icv_len;
            }
            XfrmAttrs::EncapsulationTemplate(_) => sa.spec.udp_encap = true,
            XfrmAttrs::ReplayStateEsn(r) => sa.replay_window = r.replay_window,
            _ => {}
        }
    }
    Some(sa)
}

fn observed_policy(m: &PolicyMessage, if_id: u32) -> Option<PolicySpec> {
    if !m.nlas.contains(&XfrmAttrs::IfId(if_id)) {
        return None;
    }
    let info = &m.user_policy_info;
    let sel = &info.selector;
    let dir = match info.direction {
        XFRM_POLICY_IN => PolicyDir::In,
        XFRM_POLICY_OUT => PolicyDir::Out,
        XFRM_POLICY_FWD => PolicyDir::Fwd,
        _ => return None,
    };
    let tmpl = m.nlas.iter().find_map(|a| match a {
        XfrmAttrs::Template(t) => t.first().cloned(),
        _ => None,
    })?;
    Some(PolicySpec {
        dir,
        src: Ipv4Net::new(v4(&sel.saddr), sel.prefixlen_s).ok()?,
        dst: Ipv4Net::new(v4(&sel.daddr), sel.prefixlen_d).ok()?,
        tmpl_src: v4(&tmpl.saddr),
        tmpl_dst: v4(&tmpl.id.daddr),
        if_id,
        reqid: tmpl.reqid,
    })
}

fn sa_message(sa: &SaSpec) -> SaMessage {
    let mut info = UserSaInfo {
        selector: Selector {
            family: AF_INET,
            ..Default::default()
        },
        id: Id {
            daddr: Address::from_ipv4(&sa.dst),
            spi: sa.spi,
            proto: IPPROTO_ESP,
        },
        lifetime_cfg: unlimited(),
        mode: XFRM_MODE_TUNNEL,
        flags: XFRM_STATE_ESN,
        reqid: sa.reqid,
        ..Default::default()
    };
    info.source(&IpAddr::V4(sa.src));
    info.destination(&IpAddr::V4(sa.dst));
    let mut name = [0u8; 64];
    let len = sa.algorithm.len().min(63);
    name[..len].copy_from_slice(&sa.algorithm.as_bytes()[..len]);
    let words = (REPLAY_WINDOW / 32) as usize;
    let mut nlas = vec![
        XfrmAttrs::EncryptionAlgAead(AlgAead {
            alg_name: name,
            alg_key_len: (sa.key.len() * 8) as u32,
            alg_icv_len: sa.icv_bits,
            alg_key: sa.key.as_bytes().to_vec(),
        }),
        XfrmAttrs::ReplayStateEsn(ReplayEsn {
            bmp_len: words as u32,
            replay_window: REPLAY_WINDOW,
            bmp: vec![0; words],
            ..Default::default()
        }),
        XfrmAttrs::IfId(sa.if_id),
    ];
    if sa.udp_encap {
        nlas.push(XfrmAttrs::EncapsulationTemplate(EncapTmpl {
            encap_type: UDP_ENCAP_ESPINUDP,
            encap_sport: ESP_UDP_PORT,
            encap_dport: ESP_UDP_PORT,
            encap_oa: Address::default(),
        }));
    }
    SaMessage {
        user_sa_info: info,
        nlas,
    }
}

fn policy_message(p: &PolicySpec) -> PolicyMessage {
    let mut tmpl = UserTemplate {
        family: AF_INET,
        mode: XFRM_MODE_TUNNEL,
        aalgos: u32::MAX,
        ealgos: u32::MAX,
        calgos: u32::MAX,
        reqid: p.reqid,
        ..Default::default()
    };
    tmpl.source(&IpAddr::V4(p.tmpl_src));
    tmpl.destination(&IpAddr::V4(p.tmpl_dst));
    tmpl.protocol(IPPROTO_ESP);
    PolicyMessage {
        user_policy_info: UserPolicyInfo {
            selector: selector(p.src, p.dst),
            lifetime_cfg: unlimited(),
            direction: dir_code(p.dir),
            action: XFRM_POLICY_ALLOW,
            ..Default::default()
        },
        nlas: vec![XfrmAttrs::Template(vec![tmpl]), XfrmAttrs::IfId(p.if_id)],
    }
}

impl Xfrm for XfrmSocket {
    fn states(&mut self, if_id: u32) -> Result<Vec<ObservedSa>, ApplyError> {
        let ask = XfrmMessage::GetDumpSa(GetDumpMessage::default());
        let answers = self
            .socket
            .request(ask, NLM_F_DUMP)
            .map_err(failed("listing XFRM states".into()))?;
        Ok(answers
            .iter()
            .filter_map(|m| match m {
                XfrmMessage::AddSa(m) | XfrmMessage::UpdateSa(m) => observed_sa(m, if_id),
                _ => None,
            })
            .collect())
    }

    fn policies(&mut self, if_id: u32) -> Result<Vec<PolicySpec>, ApplyError> {
        let ask = XfrmMessage::GetPolicy(PolicyId::default());
        let answers = self
            .socket
            .request(ask, NLM_F_DUMP)
            .map_err(failed("listing XFRM policies".into()))?;
        Ok(answers
            .iter()
            .filter_map(|m| match m {
                XfrmMessage::AddPolicy(m) | XfrmMessage::UpdatePolicy(m) => {
                    observed_policy(m, if_id)
                }
                _ => None,
            })
            .collect())
    }

    fn add_state(&mut self, sa: &SaSpec) -> Result<(), ApplyError> {
        self.write(XfrmMessage::AddSa(sa_message(sa)), || {
            format!("adding XFRM state {sa:?}")
        })
    }

    fn delete_state(&mut self, sa: &SaSpec) -> Result<(), ApplyError> {
        let id = SaId {
            user_sa_id: UserSaId {
                daddr: Address::from_ipv4(&sa.dst),
                spi: sa.spi,
                family: AF_INET,
                proto: IPPROTO_ESP,
            },
            nlas: Vec::new(),
        };
        self.write(XfrmMessage::DeleteSa(id), || {
            format!("deleting XFRM state {sa:?}")
        })
    }

    fn put_policy(&mut self, p: &PolicySpec) -> Result<(), ApplyError> {
        self.write(XfrmMessage::UpdatePolicy(policy_message(p)), || {
            format!("putting XFRM {p}")
        })
    }

    fn delete_policy(&mut self, p: &PolicySpec) -> Result<(), ApplyError> {
        let id = PolicyId {
            user_policy_id: UserPolicyId {
                selector: selector(p.src, p.dst),
                index: 0,
                direction: dir_code(p.dir),
            },
            nlas: vec![XfrmAttrs::IfId(p.if_id)],
        };
        self.write(XfrmMessage::DeletePolicy(id), || {
            format!("deleting XFRM {p}")
        })
    }

    fn writes(&self) -> u64 {
        self.writes
    }
}

/// The UDP socket on port 4500 with `UDP_ENCAP_ESPINUDP`: while it is open the kernel
/// takes ESP arriving in UDP to that port and hands it to XFRM. Held for the agent's life.
pub struct EncapSocket {
    _socket: socket2::Socket,
}

/// `SOL_UDP` / `UDP_ENCAP` from `<linux/udp.h>`.
const SOL_UDP: libc::c_int = 17;
const UDP_ENCAP: libc::c_int = 100;

impl EncapSocket {
    pub fn open() -> Result<Self, ApplyError> {
        let op = format!("opening the ESP-in-UDP socket on port {ESP_UDP_PORT}");
        let fail = |source| ApplyError::Io {
            op: op.clone(),
            source,
        };
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)
            .map_err(fail)?;
        socket.set_reuse_address(true).map_err(fail)?;
        let encap: libc::c_int = libc::c_int::from(UDP_ENCAP_ESPINUDP);
        // SAFETY: a valid socket, an int option of the right size.
        let rc = unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&socket),
                SOL_UDP,
                UDP_ENCAP,
                (&encap as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(fail(io::Error::last_os_error()));
        }
        let any = SocketAddr::from((Ipv4Addr::UNSPECIFIED, ESP_UDP_PORT));
        socket.bind(&any.into()).map_err(fail)?;
        Ok(EncapSocket { _socket: socket })
    }
}
