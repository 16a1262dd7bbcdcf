//! The exchange's wire format: one UDP datagram per message, fixed-size per kind,
//! authenticated with the pair's `AuthKey`. Sizes are checked before the tag, and the tag
//! before anything is parsed or decapsulated, so a stranger's datagram costs one length
//! check or one HMAC. The largest message is 1216 bytes: with IPv6's and UDP's headers it
//! fits the smallest MTU an IPv6 path may have (1280), unfragmented.
//!
//! ```text
//! 0      4      5       8        40         72      80               96      end-16   end
//! | wpq1 | kind | 0 0 0 | sender | receiver | round | ek fingerprint | body | HMAC-SHA256-128 |
//! ```
//! Bodies: `Init` a ciphertext; `Reply` a ciphertext and a confirmation; `Commit` the
//! delay until the switch (ms) and a confirmation; `Ack` a confirmation; `Classical`
//! none (its round is the sender's clock when it fell back).

use super::{AuthKey, Ciphertext, CIPHERTEXT_LEN};
use crate::{PublicKey, KEY_LEN};

const MAGIC: &[u8; 4] = b"wpq1";
const HEADER_LEN: usize = 4 + 4 + 2 * KEY_LEN + 8 + FINGERPRINT_LEN;
const TAG_LEN: usize = 16;
/// Bytes of a confirmation: HMAC-SHA256 under the round's confirmation key, cut to 128 bits.
pub const CONFIRM_LEN: usize = 16;
/// Bytes of an encapsulation key's fingerprint in a message.
pub const FINGERPRINT_LEN: usize = 16;
/// The kind byte of a `Classical` notice.
pub const CLASSICAL_KIND: u8 = 5;
/// The largest message (a `Reply`); anything longer is refused unread.
pub const MAX_LEN: usize = HEADER_LEN + CIPHERTEXT_LEN + CONFIRM_LEN + TAG_LEN;

/// What a message says; the header's fields are in `Message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// The round's leader: a secret for the follower.
    Init { ct: Ciphertext },
    /// The follower: a secret for the leader, and proof it derived the round's secret.
    Reply {
        ct: Ciphertext,
        confirm: [u8; CONFIRM_LEN],
    },
    /// The leader: it derived the same secret; both switch `switch_in_ms` from now (a
    /// delay, not a moment: the two clocks need not agree).
    Commit {
        switch_in_ms: u64,
        confirm: [u8; CONFIRM_LEN],
    },
    /// The follower: it has the commit (the leader stops sending it).
    Ack { confirm: [u8; CONFIRM_LEN] },
    /// Either node: it went back to the classical PSK (the pair could not handshake), so
    /// that the other does too and the two agree again.
    Classical,
}

impl Body {
    fn kind(&self) -> u8 {
        match self {
            Body::Init { .. } => 1,
            Body::Reply { .. } => 2,
            Body::Commit { .. } => 3,
            Body::Ack { .. } => 4,
            Body::Classical => CLASSICAL_KIND,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Body::Init { .. } => "init",
            Body::Reply { .. } => "reply",
            Body::Commit { .. } => "commit",
            Body::Ack { .. } => "ack",
            Body::Classical => "classical notice",
        }
    }
}

fn body_len(kind: u8) -> Option<usize> {
    match kind {
        1 => Some(CIPHERTEXT_LEN),
        2 => Some(CIPHERTEXT_LEN + CONFIRM_LEN),
        3 => Some(8 + CONFIRM_LEN),
        4 => Some(CONFIRM_LEN),
        CLASSICAL_KIND => Some(0),
        _ => None,
    }
}

/// One exchange message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub from: PublicKey,
    pub to: PublicKey,
    /// The round it belongs to (its leader's clock at the start, ms since the Unix epoch).
    pub round: u64,
    /// The fingerprint of the receiver's encapsulation key the sender used (zeros when the
    /// message carries no ciphertext).
    pub ek: [u8; FINGERPRINT_LEN],
    pub body: Body,
}

/// Why a datagram was refused. Says nothing of its content beyond sizes and kinds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    #[error("{got} bytes: longer than any exchange message ({MAX_LEN})")]
    TooLong { got: usize },
    #[error("{got} bytes: shorter than any exchange message")]
    TooShort { got: usize },
    #[error("not an exchange message (no wpq1 magic)")]
    Magic,
    #[error("unknown message kind {0}")]
    Kind(u8),
    #[error("a kind-{kind} message is {want} bytes, this one {got}")]
    Length { kind: u8, got: usize, want: usize },
    #[error("its authentication tag is wrong (not from the pair's two nodes, or altered)")]
    Tag,
}

impl Message {
    /// Whether `bytes`, if a message at all, is a `Classical` notice (before any check).
    pub fn is_classical_notice(bytes: &[u8]) -> bool {
        bytes.get(4) == Some(&CLASSICAL_KIND)
    }

    /// The datagram, tagged with `auth`.
    pub fn encode(&self, auth: &AuthKey) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAX_LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&[self.body.kind(), 0, 0, 0]);
        out.extend_from_slice(self.from.as_bytes());
        out.extend_from_slice(self.to.as_bytes());
        out.extend_from_slice(&self.round.to_be_bytes());
        out.extend_from_slice(&self.ek);
        match &self.body {
            Body::Init { ct } => out.extend_from_slice(ct.as_bytes()),
            Body::Reply { ct, confirm } => {
                out.extend_from_slice(ct.as_bytes());
                out.extend_from_slice(confirm);
            }
            Body::Commit {
                switch_in_ms,
                confirm,
            } => {
                out.extend_from_slice(&switch_in_ms.to_be_bytes());
                out.extend_from_slice(confirm);
            }
            Body::Ack { confirm } => out.extend_from_slice(confirm),
            Body::Classical => {}
        }
        let tag: [u8; TAG_LEN] = auth.tag(&out);
        out.extend_from_slice(&tag);
        out
    }

    /// The sender and receiver a datagram names, after its size checks and before its
    /// tag: what picks the `AuthKey` to check it with.
    pub fn addressed(bytes: &[u8]) -> Result<(PublicKey, PublicKey), MessageError> {
        check_size(bytes)?;
        let key = |at: usize| {
            let mut k = [0; KEY_LEN];
            k.copy_from_slice(&bytes[at..at + KEY_LEN]);
            PublicKey::from_bytes(k)
        };
        Ok((key(8), key(8 + KEY_LEN)))
    }

    /// A datagram checked with `auth`: sizes, then the tag, then the fields.
    pub fn decode(bytes: &[u8], auth: &AuthKey) -> Result<Message, MessageError> {
        let kind = check_size(bytes)?;
        let (signed, tag) = bytes.split_at(bytes.len() - TAG_LEN);
        if !auth.verify(signed, tag) {
            return Err(MessageError::Tag);
        }
        let (from, to) = Message::addressed(bytes)?;
        let mut at = 8 + 2 * KEY_LEN;
        let mut take = |n: usize| {
            let part = &signed[at..at + n];
            at += n;
            part
        };
        let round = u64::from_be_bytes(array(take(8)));
        let ek: [u8; FINGERPRINT_LEN] = array(take(FINGERPRINT_LEN));
        let body = match kind {
            1 => Body::Init {
                ct: Ciphertext::from_array(array(take(CIPHERTEXT_LEN))),
            },
            2 => Body::Reply {
                ct: Ciphertext::from_array(array(take(CIPHERTEXT_LEN))),
                confirm: array(take(CONFIRM_LEN)),
            },
            3 => Body::Commit {
                switch_in_ms: u64::from_be_bytes(array(take(8))),
                confirm: array(take(CONFIRM_LEN)),
            },
            4 => Body::Ack {
                confirm: array(take(CONFIRM_LEN)),
            },
            _ => Body::Classical,
        };
        Ok(Message {
            from,
            to,
            round,
            ek,
            body,
        })
    }
}

/// The kind of a datagram whose size fits it exactly.
fn check_size(bytes: &[u8]) -> Result<u8, MessageError> {
    if bytes.len() > MAX_LEN {
        return Err(MessageError::TooLong { got: bytes.len() });
    }
    if bytes.len() < HEADER_LEN + TAG_LEN {
        return Err(MessageError::TooShort { got: bytes.len() });
    }
    if &bytes[..4] != MAGIC {
        return Err(MessageError::Magic);
    }
    let kind = bytes[4];
    let body = body_len(kind).ok_or(MessageError::Kind(kind))?;
    let want = HEADER_LEN + body + TAG_LEN;
    if bytes.len() != want {
        return Err(MessageError::Length {
            kind,
            got: bytes.len(),
            want,
        });
    }
    Ok(kind)
}

/// A fixed-size copy of a slice whose length the size checks have fixed.
fn array<const N: usize>(part: &[u8]) -> [u8; N] {
    let mut out = [0; N];
    out.copy_from_slice(part);
    out
}
