//! One pair's exchange, from one node's side, as a state machine without I/O: the caller
//! hands it the clock and the datagrams that arrive, and sends what it returns.
//!
//! The node with the pair's lower X25519 key leads. A round:
//! 1. the leader encapsulates a secret to the follower's ML-KEM key (`Init`);
//! 2. the follower decapsulates it, encapsulates one of its own to the leader, derives the
//!    round's secret from both and proves it (`Reply`);
//! 3. the leader derives the same, checks the proof, and says how soon both switch to the
//!    new PSK, proving it holds the secret too (`Commit`); it switches then;
//! 4. the follower checks the proof, switches as soon as it was told, and says so (`Ack`).
//!    A delay rather than a moment: the two switch together however far apart their
//!    clocks are (by the commit's one-way delay).
//!
//! A lost message is sent again (the leader's `Init` and `Commit` until answered; the
//! follower answers a repeated message again). Replays are refused: a round is its
//! leader's clock in milliseconds and only a newer round than the last one taken, within
//! `Timing::freshness` of this node's clock, is taken. A round that fails (a proof that
//! does not hold, an encapsulation key that changed) changes nothing: the pair keeps the
//! PSK it has until a round completes.
//!
//! The leader picks each round's number with the parity the last one did not have, so two
//! PSKs that follow each other always have different `Installed::slot`s: the ipsec backend
//! keeps the SAs of both side by side while the pair switches.

use super::{
    encapsulate, AuthKey, Body, Ciphertext, EncapsKey, KemKeyPair, Message, MessageError,
    PairKeyError, RoundSecret, SharedSecret, FINGERPRINT_LEN,
};
use crate::{KeyError, PresharedKey, PrivateKey, PublicKey};

/// This node's keys, as every exchange of the node uses them.
pub struct Own {
    pub key: PrivateKey,
    pub kem: KemKeyPair,
    /// The ML-KEM key pair before the last rotation: rounds begun under it still complete.
    pub previous_kem: Option<KemKeyPair>,
}

impl Own {
    /// The key pair a message's fingerprint names: the current one or the previous one.
    fn kem_for(&self, fingerprint: &[u8; FINGERPRINT_LEN]) -> Option<&KemKeyPair> {
        std::iter::once(&self.kem)
            .chain(self.previous_kem.as_ref())
            .find(|k| k.encaps_key().short_fingerprint() == *fingerprint)
    }
}

/// How often rounds run and how patiently messages are repeated (milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// A new round this long after the last one began.
    pub period: u64,
    /// The first repeat of an unanswered message; each next waits twice as long, up to
    /// `max_retry`.
    pub retry: u64,
    pub max_retry: u64,
    /// A round unanswered this long is given up and a new one begun (a fresh
    /// encapsulation, inside the follower's `freshness`).
    pub round_lifetime: u64,
    /// The switch to a round's PSK is this far after the leader derives it: the commit
    /// reaches the follower first, so both switch at the same moment.
    pub switch_delay: u64,
    /// A round more than this far from this node's clock is refused.
    pub freshness: u64,
    /// A round a key change calls for begins no sooner than this after the last PSK took
    /// over. PSKs alternate between two slots, so the one after next takes the slot (and
    /// on ipsec the SPIs) of the one before: each node must have stopped sending with that
    /// one by then, which it does 2 s after the next took over, in its next pass.
    pub min_gap: u64,
}

impl Default for Timing {
    fn default() -> Timing {
        Timing {
            period: 120_000,
            retry: 1_000,
            max_retry: 30_000,
            round_lifetime: 60_000,
            switch_delay: 1_000,
            freshness: 300_000,
            min_gap: MIN_GAP,
        }
    }
}

/// `Timing::min_gap` by default: the 2 s after which a node sends with a new PSK, and 3 s
/// for a pass that is slow to do so.
pub const MIN_GAP: u64 = 5_000;

/// A PSK from a completed round, and the moment it is (or was) put in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    pub round: u64,
    pub psk: PresharedKey,
    pub at_ms: u64,
}

impl Installed {
    /// 1 or 2, from the round's parity: two PSKs in a row never share it (the leader
    /// alternates the parity), so SAs keyed from the two can stand side by side.
    pub fn slot(&self) -> u8 {
        slot(self.round)
    }
}

/// The slot of `round`: 1 for an even one, 2 for an odd one.
pub fn slot(round: u64) -> u8 {
    1 + u8::from(round & 1 == 1)
}

/// Why a datagram changed nothing. Names what was wrong, never a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error(transparent)]
    Message(#[from] MessageError),
    #[error("it is addressed to another key")]
    NotForUs,
    #[error("a {kind} goes from the pair's {from} to its {to}, and this node is the {to_be}")]
    Role {
        kind: &'static str,
        from: &'static str,
        to: &'static str,
        to_be: &'static str,
    },
    #[error("round {round} is {skew_ms} ms away from this node's clock (more than {freshness} ms): a replay, or clocks far apart")]
    NotFresh {
        round: u64,
        skew_ms: u64,
        freshness: u64,
    },
    #[error("round {round} is not newer than round {newest}, the last one taken: a replay")]
    Stale { round: u64, newest: u64 },
    #[error("its ciphertext is for an ML-KEM key this node no longer holds")]
    OldKey,
    #[error("a {kind} for round {round}, which is not in progress")]
    NoRound { kind: &'static str, round: u64 },
    #[error(
        "its proof of the round's secret does not hold (the two nodes derived different secrets)"
    )]
    Confirm,
    #[error("the system random number generator failed")]
    Random,
}

impl From<KeyError> for Refused {
    fn from(_: KeyError) -> Refused {
        Refused::Random
    }
}

enum State {
    /// Leader: no round in progress; the next one at `next_at`.
    Idle { next_at: u64 },
    /// Leader: `Init` sent, waiting for the `Reply`.
    Offered {
        round: u64,
        ct: Ciphertext,
        sent: SharedSecret,
        peer_ek: [u8; 32],
        sends: u32,
        next_send: u64,
    },
    /// Leader: `Commit` sent, until the `Ack` (or `sends` runs out). `stale_key`: the
    /// follower encapsulated to this node's previous ML-KEM key (it has not seen the new
    /// one yet), so the next round comes soon rather than a period later.
    Committing {
        round: u64,
        switch_at: u64,
        secret: RoundSecret,
        sends: u32,
        next_send: u64,
        stale_key: bool,
    },
    /// Follower: waiting for the leader's `Init` (or for the `Commit` of `round`).
    Following,
    /// Follower: `Reply` sent for `round`; the secret kept until its `Commit`.
    Replied {
        round: u64,
        reply: Vec<u8>,
        secret: RoundSecret,
    },
}

/// One pair's exchange from this node's side.
pub struct Exchange {
    auth: AuthKey,
    own_key: PublicKey,
    peer_key: PublicKey,
    peer_ek: EncapsKey,
    leads: bool,
    timing: Timing,
    state: State,
    /// The newest round taken (follower) or begun (leader).
    newest: u64,
    current: Option<Installed>,
    next: Option<Installed>,
    /// The PSK `current` replaced, until the round after it completes.
    previous: Option<Installed>,
    /// Why the last round failed, for `weft status`.
    last_refusal: Option<Refused>,
    /// The newest `Classical` notice taken from the peer (its clock): an older one, or
    /// the same again, is a replay.
    notice_seen: u64,
}

/// What `poll` asks of the caller.
#[derive(Debug, Default)]
pub struct Poll {
    /// Datagrams for the peer's agent.
    pub send: Vec<Vec<u8>>,
    /// Call `poll` again at this moment (ms since the Unix epoch) at the latest.
    pub wake_at: u64,
}

impl Exchange {
    /// The exchange of `own` with the peer of `peer_key` that publishes `peer_ek`. The
    /// pair starts with no post-quantum PSK; a leader begins its first round at once.
    pub fn new(
        own: &Own,
        peer_key: PublicKey,
        peer_ek: EncapsKey,
        timing: Timing,
        now: u64,
    ) -> Result<Exchange, PairKeyError> {
        let auth = AuthKey::new(&own.key, &peer_key)?;
        let own_key = own.key.public_key();
        let leads = auth.pair().is_lo(&own_key);
        Ok(Exchange {
            auth,
            own_key,
            peer_key,
            peer_ek,
            leads,
            timing,
            state: if leads {
                State::Idle { next_at: now }
            } else {
                State::Following
            },
            newest: 0,
            current: None,
            next: None,
            previous: None,
            last_refusal: None,
            notice_seen: 0,
        })
    }

    /// Puts what was saved before a restart back: the PSK in force (`current`) and the one
    /// committed to follow it at its moment (`next`). The next round follows the newest of
    /// them by the period, as if the agent had not stopped.
    pub fn restore(&mut self, current: Option<Installed>, next: Option<Installed>) {
        let newest = [&current, &next]
            .into_iter()
            .flatten()
            .map(|i| i.round)
            .max();
        let Some(newest) = newest else {
            return;
        };
        self.newest = self.newest.max(newest);
        if self.leads {
            self.state = State::Idle {
                next_at: newest.saturating_add(self.timing.period),
            };
        }
        self.current = current;
        self.next = next;
        self.previous = None;
    }

    pub fn leads(&self) -> bool {
        self.leads
    }

    pub fn peer_key(&self) -> &PublicKey {
        &self.peer_key
    }

    /// The peer published another ML-KEM key: a leader begins a round to it at once; the
    /// PSK in force stays until that round completes.
    pub fn peer_ek_changed(&mut self, ek: EncapsKey, now: u64) {
        if ek == self.peer_ek {
            return;
        }
        self.peer_ek = ek;
        if self.leads {
            self.state = State::Idle { next_at: now };
        }
    }

    /// This node rotated its ML-KEM key: a leader begins a round at once, so the pair's
    /// secret no longer depends on the old key.
    pub fn own_kem_changed(&mut self, now: u64) {
        if self.leads {
            self.state = State::Idle { next_at: now };
        }
    }

    /// The pair cannot complete a handshake while a post-quantum PSK is in force (the two
    /// nodes hold different ones, after a state lost on one side): back to the classical
    /// PSK, and a leader begins a round at once. Returns the `Classical` notice for the
    /// peer: the peer may not see the pair fail (it sends nothing), and without the notice
    /// would keep its PSK; with it, both are classical, the pair handshakes, and a round
    /// brings the protection back.
    pub fn fall_back(&mut self, now: u64) -> Vec<u8> {
        self.go_classical(now);
        self.message(now, [0; FINGERPRINT_LEN], Body::Classical)
            .encode(&self.auth)
    }

    fn go_classical(&mut self, now: u64) {
        self.current = None;
        self.next = None;
        self.previous = None;
        self.state = if self.leads {
            State::Idle { next_at: now }
        } else {
            State::Following
        };
    }

    /// The post-quantum PSK in force at `now`, if a round has completed.
    pub fn psk(&mut self, now: u64) -> Option<&Installed> {
        if self.next.as_ref().is_some_and(|n| n.at_ms <= now) {
            self.previous = std::mem::replace(&mut self.current, self.next.take());
        }
        self.current.as_ref()
    }

    /// The PSK the one in force replaced (none for a pair that was classical before it):
    /// the ipsec backend still receives on it while the pair switches.
    pub fn previous(&self) -> Option<&Installed> {
        self.previous.as_ref()
    }

    /// The PSK committed and not yet in force, with its moment.
    pub fn pending(&self) -> Option<&Installed> {
        self.next.as_ref()
    }

    /// Why the last datagram or round failed, if the last one did.
    pub fn last_refusal(&self) -> Option<&Refused> {
        self.last_refusal.as_ref()
    }

    /// What to send now, and when to be called again.
    pub fn poll(&mut self, now: u64) -> Result<Poll, Refused> {
        let timing = self.timing;
        if let State::Idle { next_at } = self.state {
            if now >= next_at {
                match self.gap_until().filter(|t| now < *t) {
                    Some(later) => self.state = State::Idle { next_at: later },
                    None => self.begin(now)?,
                }
            }
        }
        if let State::Offered { round, .. } = self.state {
            if now.saturating_sub(round) >= timing.round_lifetime {
                self.begin(now)?;
            }
        }
        // A commit is sent until it is acknowledged (the leader has switched: the follower
        // must too), or until the next round, which supersedes it, is due.
        if let State::Committing { round, .. } = self.state {
            if now >= round.saturating_add(timing.period) {
                self.begin(now)?;
            }
        }
        // What is due now: (round, the fingerprint it names, body).
        let mut due: Option<(u64, [u8; FINGERPRINT_LEN], Body)> = None;
        let wake_at = match &mut self.state {
            State::Idle { next_at } => *next_at,
            State::Offered {
                round,
                ct,
                sends,
                next_send,
                ..
            } => {
                if now >= *next_send {
                    let body = Body::Init { ct: ct.clone() };
                    due = Some((*round, self.peer_ek.short_fingerprint(), body));
                    *sends += 1;
                    *next_send = now.saturating_add(backoff(&timing, *sends));
                }
                (*next_send).min(round.saturating_add(timing.round_lifetime))
            }
            State::Committing {
                round,
                switch_at,
                secret,
                sends,
                next_send,
                ..
            } => {
                if now >= *next_send {
                    let delay = switch_at.saturating_sub(now);
                    let body = Body::Commit {
                        switch_in_ms: delay,
                        confirm: secret.confirm(&fields(b"commit", *round, Some(delay))),
                    };
                    due = Some((*round, [0; FINGERPRINT_LEN], body));
                    *sends += 1;
                    *next_send = now.saturating_add(backoff(&timing, *sends));
                }
                *next_send
            }
            State::Following | State::Replied { .. } => now.saturating_add(timing.period),
        };
        let send = due
            .map(|(round, ek, body)| self.message(round, ek, body).encode(&self.auth))
            .into_iter()
            .collect();
        let wake_at = self.next.as_ref().map_or(wake_at, |n| wake_at.min(n.at_ms));
        Ok(Poll { send, wake_at })
    }

    /// The moment `Timing::min_gap` after the newest PSK takes or took over, if any.
    fn gap_until(&self) -> Option<u64> {
        [&self.current, &self.next]
            .into_iter()
            .flatten()
            .map(|i| i.at_ms.saturating_add(self.timing.min_gap))
            .max()
    }

    /// Leader: a new round, its secret encapsulated to the peer's key.
    fn begin(&mut self, now: u64) -> Result<(), Refused> {
        let mut round = now.max(self.newest.saturating_add(1));
        // Another slot than the PSK this round will follow.
        let last = self.next.as_ref().or(self.current.as_ref());
        if last.is_some_and(|l| l.slot() == slot(round)) {
            round += 1;
        }
        let (ct, sent) = encapsulate(&self.peer_ek)?;
        self.newest = round;
        self.state = State::Offered {
            round,
            ct,
            sent,
            peer_ek: self.peer_ek.fingerprint(),
            sends: 0,
            next_send: now,
        };
        Ok(())
    }

    /// A round within `freshness` of `now`.
    fn fresh(&self, round: u64, now: u64) -> Result<(), Refused> {
        let skew_ms = round.abs_diff(now);
        if skew_ms > self.timing.freshness {
            return Err(Refused::NotFresh {
                round,
                skew_ms,
                freshness: self.timing.freshness,
            });
        }
        Ok(())
    }

    fn message(&self, round: u64, ek: [u8; FINGERPRINT_LEN], body: Body) -> Message {
        Message {
            from: self.own_key,
            to: self.peer_key,
            round,
            ek,
            body,
        }
    }
}

/// What a confirmation covers: the message's kind, its round, and a commit's delay.
fn fields(kind: &[u8], round: u64, switch_in: Option<u64>) -> Vec<u8> {
    let mut out = kind.to_vec();
    out.extend_from_slice(&round.to_be_bytes());
    if let Some(delay) = switch_in {
        out.extend_from_slice(&delay.to_be_bytes());
    }
    out
}

mod receive;

/// The wait before the `sends`+1-th send of an unanswered message.
fn backoff(timing: &Timing, sends: u32) -> u64 {
    let doubled = timing
        .retry
        .saturating_mul(1 << sends.saturating_sub(1).min(16));
    doubled.min(timing.max_retry)
}
