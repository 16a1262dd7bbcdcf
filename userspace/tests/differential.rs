//! weft's WireGuard core against an independent one (boringtun's), message for message:
//! the same script of handshake and data messages (valid, replayed, reordered, mutated,
//! under load with and without a cookie), and the same configuration changes (keepalive,
//! PSK, private key, the peer removed and added), fed to both, must meet the same
//! verdicts: answered (and with what), opened, or refused. A verdict counts only if the
//! keys agree: a data message opens only where the session's keys match the sender's.
//!
//! Where boringtun and kernel WireGuard differ, the kernel decides, and the test says so
//! at that step: boringtun's device gives a peer a new `Tunn` on a PSK or keepalive change
//! or a removal, which forgets the peer's newest initiation timestamp, so a recorded
//! initiation is answered again there; kernel WireGuard (and weft) keep it in the peer.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use boringtun::noise::rate_limiter::RateLimiter;
use boringtun::noise::{Tunn, TunnResult as Theirs};
use weft_userspace::wg::cookie::{Checker, Macs};
use weft_userspace::wg::index::Indices;
use weft_userspace::wg::{TunnResult, Tunnel};
use x25519_dalek::{PublicKey, StaticSecret};

const FROM: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(198, 51, 100, 2)), 51820);

/// A change made to a message before it is delivered.
type Change<'a> = &'a dyn Fn(&mut Vec<u8>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Answered with a message of this type.
    Answered(u8),
    /// A packet for the TUN device.
    Opened,
    /// Taken, nothing to say (a keepalive, a cookie reply).
    Taken,
    Refused,
}

fn key(n: u8) -> StaticSecret {
    StaticSecret::from([n; 32])
}

fn ip_packet(tag: u8) -> Vec<u8> {
    let mut p = vec![tag; 84];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&84u16.to_be_bytes());
    p[12..16].copy_from_slice(&[10, 0, 0, 2]);
    p[16..20].copy_from_slice(&[10, 0, 0, 1]);
    p
}

/// A receiver: weft's core behind its cookie checker, or boringtun's `Tunn`.
trait Receiver {
    fn deliver(&mut self, msg: &[u8]) -> (Verdict, Vec<u8>);
}

struct Ours {
    checker: Checker,
    tunn: Tunnel,
    under_load: bool,
}

impl Ours {
    fn new(psk: Option<[u8; 32]>) -> Ours {
        Ours {
            checker: Checker::new(&PublicKey::from(&key(1))),
            tunn: Tunnel::new(
                key(1),
                PublicKey::from(&key(2)),
                psk,
                None,
                Arc::new(Indices::default()),
                Instant::now(),
            ),
            under_load: false,
        }
    }
}

impl Receiver for Ours {
    fn deliver(&mut self, msg: &[u8]) -> (Verdict, Vec<u8>) {
        let now = Instant::now();
        if matches!(msg.first(), Some(1 | 2)) {
            match self.checker.check(msg, FROM, now) {
                Macs::Invalid => return (Verdict::Refused, vec![]),
                Macs::Mac1 if self.under_load => {
                    let reply = self.checker.reply(msg, FROM, now).unwrap();
                    return (Verdict::Answered(3), reply.to_vec());
                }
                _ => {}
            }
        }
        let mut buf = vec![0u8; 2048];
        match self.tunn.decapsulate(msg, now, &mut buf) {
            TunnResult::WriteToNetwork(b) => (Verdict::Answered(b[0]), b.to_vec()),
            TunnResult::WriteToTunnelV4(..) | TunnResult::WriteToTunnelV6(..) => {
                (Verdict::Opened, vec![])
            }
            TunnResult::Done => (Verdict::Taken, vec![]),
            TunnResult::Err(_) => (Verdict::Refused, vec![]),
        }
    }
}

struct Boring(Tunn);

fn boring(psk: Option<[u8; 32]>, limit: u64) -> Boring {
    let limiter = Arc::new(RateLimiter::new(&PublicKey::from(&key(1)), limit));
    Boring(Tunn::new(
        key(1),
        PublicKey::from(&key(2)),
        psk,
        None,
        1,
        Some(limiter),
    ))
}

impl Receiver for Boring {
    fn deliver(&mut self, msg: &[u8]) -> (Verdict, Vec<u8>) {
        let mut buf = vec![0u8; 2048];
        match self.0.decapsulate(Some(FROM.ip()), msg, &mut buf) {
            Theirs::WriteToNetwork(b) => (Verdict::Answered(b[0]), b.to_vec()),
            Theirs::WriteToTunnelV4(..) | Theirs::WriteToTunnelV6(..) => (Verdict::Opened, vec![]),
            Theirs::Done => (Verdict::Taken, vec![]),
            Theirs::Err(_) => (Verdict::Refused, vec![]),
        }
    }
}

/// The peer both receivers talk to (one instance each, same key): boringtun's.
fn sender(psk: Option<[u8; 32]>) -> Tunn {
    Tunn::new(key(2), PublicKey::from(&key(1)), psk, None, 7, None)
}

fn out(r: Theirs<'_>) -> Vec<u8> {
    match r {
        Theirs::WriteToNetwork(b) => b.to_vec(),
        other => panic!("the sender wrote nothing: {other:?}"),
    }
}

/// One side of the comparison: a sender and the receiver it talks to, and every message
/// the sender made so far.
struct Side<R> {
    s: Tunn,
    r: R,
    sent: Vec<Vec<u8>>,
}

impl<R: Receiver> Side<R> {
    fn initiation(&mut self) -> usize {
        let mut buf = vec![0u8; 2048];
        let m = out(self.s.format_handshake_initiation(&mut buf, true));
        self.sent.push(m);
        self.sent.len() - 1
    }

    fn data(&mut self, tag: u8) -> usize {
        let mut buf = vec![0u8; 2048];
        let m = out(self.s.encapsulate(&ip_packet(tag), &mut buf));
        self.sent.push(m);
        self.sent.len() - 1
    }

    /// Delivers message `i` (changed by `f`); an answer goes back to the sender, and
    /// what the sender answers (a confirming keepalive) to the receiver.
    fn deliver(&mut self, i: usize, f: impl Fn(&mut Vec<u8>)) -> Verdict {
        let mut m = self.sent[i].clone();
        f(&mut m);
        let (v, answer) = self.r.deliver(&m);
        if let Verdict::Answered(2 | 3) = v {
            let mut buf = vec![0u8; 2048];
            if let Theirs::WriteToNetwork(k) =
                self.s.decapsulate(Some(FROM.ip()), &answer, &mut buf)
            {
                let k = k.to_vec();
                let (confirmed, _) = self.r.deliver(&k);
                assert_eq!(confirmed, Verdict::Taken, "the confirming keepalive");
            }
        }
        v
    }
}

#[test]
fn weft_and_boringtun_meet_the_same_verdicts_message_for_message() {
    let mut ours = Side {
        s: sender(None),
        r: Ours::new(None),
        sent: vec![],
    };
    let mut theirs = Side {
        s: sender(None),
        r: boring(None, 1000),
        sent: vec![],
    };
    let keep = |_: &mut Vec<u8>| {};
    // The handshake, confirmed.
    let (io, it) = (ours.initiation(), theirs.initiation());
    assert_eq!(ours.deliver(io, keep), Verdict::Answered(2));
    assert_eq!(theirs.deliver(it, keep), Verdict::Answered(2));
    // Data, in order, then a replay, then reordered, then mutated.
    let data: Vec<(usize, usize)> = (0..16u8).map(|t| (ours.data(t), theirs.data(t))).collect();
    for (n, (o, t)) in data[..10].iter().enumerate() {
        let v = (ours.deliver(*o, keep), theirs.deliver(*t, keep));
        assert_eq!(v, (Verdict::Opened, Verdict::Opened), "data {n}");
    }
    let cases: [(&str, usize, Change, Verdict); 9] = [
        ("a replayed data message", 3, &keep, Verdict::Refused),
        ("a later one first", 11, &keep, Verdict::Opened),
        ("then the earlier one", 10, &keep, Verdict::Opened),
        (
            "a changed ciphertext byte",
            12,
            &|m| m[20] ^= 1,
            Verdict::Refused,
        ),
        (
            "a changed tag byte",
            12,
            &|m| *m.last_mut().unwrap() ^= 1,
            Verdict::Refused,
        ),
        (
            "the unchanged one (a forgery used up no counter)",
            12,
            &keep,
            Verdict::Opened,
        ),
        ("a reserved byte set", 13, &|m| m[2] = 1, Verdict::Refused),
        (
            "another receiver index",
            13,
            &|m| m[4] ^= 0x55,
            Verdict::Refused,
        ),
        ("a changed counter", 13, &|m| m[8] ^= 1, Verdict::Refused),
    ];
    for (what, n, f, want) in cases {
        let (o, t) = data[n];
        let v = (ours.deliver(o, f), theirs.deliver(t, f));
        assert_eq!(v, (want, want), "{what}");
    }
    // The initiation again, and changed in any byte: refused by both.
    assert_eq!(
        (ours.deliver(io, keep), theirs.deliver(it, keep)),
        (Verdict::Refused, Verdict::Refused),
        "a replayed initiation"
    );
    for at in [0, 1, 4, 8, 39, 40, 87, 88, 115, 116, 131, 132, 147] {
        let f = |m: &mut Vec<u8>| m[at] ^= 0x20;
        let v = (ours.deliver(io, f), theirs.deliver(it, f));
        assert_eq!(
            v,
            (Verdict::Refused, Verdict::Refused),
            "initiation byte {at} changed"
        );
    }
    // A configuration change, then the recorded initiation again. The kernel (and weft)
    // keep the peer's newest timestamp through each; boringtun's device makes a new Tunn
    // on a keepalive or PSK change and on remove and add, and answers it.
    ours.r.tunn.set_keepalive(25);
    theirs.r = boring(None, 1000);
    let v = (ours.deliver(io, keep), theirs.deliver(it, keep));
    assert_eq!(
        v,
        (Verdict::Refused, Verdict::Answered(2)),
        "after a keepalive change (kernel: refused)"
    );
    ours.r.tunn.set_psk(Some([5; 32]));
    ours.r.tunn.set_psk(None);
    theirs.r = boring(None, 1000);
    let v = (ours.deliver(io, keep), theirs.deliver(it, keep));
    assert_eq!(
        v,
        (Verdict::Refused, Verdict::Answered(2)),
        "after a PSK change and back (kernel: refused)"
    );
    ours.r.tunn.set_secret(key(3));
    ours.r.tunn.set_secret(key(1));
    theirs
        .r
        .0
        .set_static_private(key(3), PublicKey::from(&key(3)), None);
    theirs
        .r
        .0
        .set_static_private(key(1), PublicKey::from(&key(1)), None);
    let v = (ours.deliver(io, keep), theirs.deliver(it, keep));
    assert_eq!(v.0, Verdict::Refused, "after a private key change and back");
    let latest = ours.r.tunn.latest().unwrap();
    ours.r = Ours::new(None);
    ours.r.tunn.remember(latest);
    theirs.r = boring(None, 1000);
    let v = (ours.deliver(io, keep), theirs.deliver(it, keep));
    assert_eq!(
        v,
        (Verdict::Refused, Verdict::Answered(2)),
        "after remove and add (kernel: refused)"
    );
    // A new handshake from the peer is answered by both, and its session carries data.
    std::thread::sleep(Duration::from_millis(25));
    let (io, it) = (ours.initiation(), theirs.initiation());
    assert_eq!(
        (ours.deliver(io, keep), theirs.deliver(it, keep)),
        (Verdict::Answered(2), Verdict::Answered(2))
    );
    let (o, t) = (ours.data(99), theirs.data(99));
    assert_eq!(
        (ours.deliver(o, keep), theirs.deliver(t, keep)),
        (Verdict::Opened, Verdict::Opened)
    );
}

#[test]
fn under_load_both_want_a_cookie_and_take_the_initiation_that_carries_it() {
    let mut ours = Side {
        s: sender(None),
        r: Ours::new(None),
        sent: vec![],
    };
    ours.r.under_load = true;
    let mut theirs = Side {
        s: sender(None),
        r: boring(None, 0),
        sent: vec![],
    };
    let keep = |_: &mut Vec<u8>| {};
    let (io, it) = (ours.initiation(), theirs.initiation());
    assert_eq!(
        (ours.deliver(io, keep), theirs.deliver(it, keep)),
        (Verdict::Answered(3), Verdict::Answered(3)),
        "a cookie reply"
    );
    // The sender took the cookie (`deliver` gave it the reply): its next one carries mac2.
    let (io, it) = (ours.initiation(), theirs.initiation());
    assert_eq!(
        (ours.deliver(io, keep), theirs.deliver(it, keep)),
        (Verdict::Answered(2), Verdict::Answered(2)),
        "with the cookie"
    );
    let (o, t) = (ours.data(1), theirs.data(1));
    assert_eq!(
        (ours.deliver(o, keep), theirs.deliver(t, keep)),
        (Verdict::Opened, Verdict::Opened)
    );
}

/// Responses to our own initiations, from boringtun as the responder to each side: any
/// changed byte before mac2 (type, reserved, indices, ephemeral, empty AEAD, mac1) is
/// refused by both; one with a changed mac2 (not under load) is confirmed with a
/// keepalive by both, and the response again is refused by both.
#[test]
fn responses_to_our_initiations_meet_the_same_verdicts() {
    let now = Instant::now();
    let mut ours = Ours::new(None);
    let mut theirs = boring(None, 1000);
    let (mut ro, mut rt) = (sender(None), sender(None));
    let mut buf = vec![0u8; 2048];
    let io = match ours.tunn.format_handshake_initiation(now, &mut buf, false) {
        TunnResult::WriteToNetwork(b) => b.to_vec(),
        other => panic!("no initiation: {other:?}"),
    };
    let it = out(theirs.0.format_handshake_initiation(&mut buf, false));
    let response_o = out(ro.decapsulate(Some(FROM.ip()), &io, &mut buf));
    let response_t = out(rt.decapsulate(Some(FROM.ip()), &it, &mut buf));
    for at in [0, 2, 4, 8, 12, 43, 44, 59, 60, 75] {
        let (mut o, mut t) = (response_o.clone(), response_t.clone());
        o[at] ^= 0x10;
        t[at] ^= 0x10;
        let v = (ours.deliver(&o).0, theirs.deliver(&t).0);
        assert_eq!(
            v,
            (Verdict::Refused, Verdict::Refused),
            "response byte {at} changed"
        );
    }
    let v = (ours.deliver(&response_o).0, theirs.deliver(&response_t).0);
    assert_eq!(
        v,
        (Verdict::Answered(4), Verdict::Answered(4)),
        "the response, confirmed"
    );
    let v = (ours.deliver(&response_o).0, theirs.deliver(&response_t).0);
    assert_eq!(
        v,
        (Verdict::Refused, Verdict::Refused),
        "the response again"
    );
}
