//! Taking a datagram from the peer's agent: each kind of message in the state it may
//! arrive in, and what it is refused for otherwise.

use super::{fields, Exchange, Installed, Own, Refused, State};
use crate::pq::{
    encapsulate, Body, Ciphertext, Message, RoundInput, RoundSecret, CONFIRM_LEN, FINGERPRINT_LEN,
};

impl Exchange {
    /// A datagram from the peer's agent: the datagrams to answer it with, or why it
    /// changed nothing.
    pub fn receive(&mut self, own: &Own, bytes: &[u8], now: u64) -> Result<Vec<Vec<u8>>, Refused> {
        let result = self.take(own, bytes, now);
        if let Err(e) = &result {
            self.last_refusal = Some(e.clone());
        }
        result
    }

    fn take(&mut self, own: &Own, bytes: &[u8], now: u64) -> Result<Vec<Vec<u8>>, Refused> {
        let msg = Message::decode(bytes, &self.auth)?;
        if msg.to != self.own_key || msg.from != self.peer_key {
            return Err(Refused::NotForUs);
        }
        if matches!(msg.body, Body::Classical) {
            return self.on_classical(msg.round, now);
        }
        let kind = msg.body.name();
        let from_leader = matches!(msg.body, Body::Init { .. } | Body::Commit { .. });
        if from_leader == self.leads {
            let (from, to) = if from_leader {
                ("leader", "follower")
            } else {
                ("follower", "leader")
            };
            return Err(Refused::Role {
                kind,
                from,
                to,
                to_be: if self.leads { "leader" } else { "follower" },
            });
        }
        match msg.body {
            Body::Init { ct } => self.on_init(own, msg.round, &msg.ek, &ct, now),
            Body::Reply { ct, confirm } => {
                self.on_reply(own, msg.round, &msg.ek, &ct, &confirm, now)
            }
            Body::Commit {
                switch_in_ms,
                confirm,
            } => self.on_commit(msg.round, switch_in_ms, &confirm, now),
            Body::Ack { confirm } => self.on_ack(msg.round, &confirm),
            Body::Classical => Ok(Vec::new()),
        }
    }

    /// The peer went back to the classical PSK: so does this node, once per notice, and
    /// only for a notice within `freshness` of this node's clock.
    fn on_classical(&mut self, at: u64, now: u64) -> Result<Vec<Vec<u8>>, Refused> {
        self.fresh(at, now)?;
        if at <= self.notice_seen {
            return Err(Refused::Stale {
                round: at,
                newest: self.notice_seen,
            });
        }
        self.notice_seen = at;
        self.go_classical(now);
        Ok(Vec::new())
    }

    fn on_init(
        &mut self,
        own: &Own,
        round: u64,
        ek: &[u8; FINGERPRINT_LEN],
        ct: &Ciphertext,
        now: u64,
    ) -> Result<Vec<Vec<u8>>, Refused> {
        if let State::Replied {
            round: r, reply, ..
        } = &self.state
        {
            if *r == round {
                return Ok(vec![reply.clone()]);
            }
        }
        self.fresh(round, now)?;
        if round <= self.newest {
            return Err(Refused::Stale {
                round,
                newest: self.newest,
            });
        }
        let kem = own.kem_for(ek).ok_or(Refused::OldKey)?;
        let from_leader = kem.decapsulate(ct);
        let (reply_ct, to_leader) = encapsulate(&self.peer_ek)?;
        let (own_ek, peer_ek) = (kem.encaps_key().fingerprint(), self.peer_ek.fingerprint());
        let secret = RoundSecret::derive(&RoundInput {
            pair: self.auth.pair(),
            round,
            lo_to_hi: &from_leader,
            hi_to_lo: &to_leader,
            ek_hi: &own_ek,
            ek_lo: &peer_ek,
        });
        let confirm = secret.confirm(&fields(b"reply", round, None));
        let body = Body::Reply {
            ct: reply_ct,
            confirm,
        };
        let reply = self
            .message(round, self.peer_ek.short_fingerprint(), body)
            .encode(&self.auth);
        self.newest = round;
        self.state = State::Replied {
            round,
            reply: reply.clone(),
            secret,
        };
        self.last_refusal = None;
        Ok(vec![reply])
    }

    fn on_reply(
        &mut self,
        own: &Own,
        round: u64,
        ek: &[u8; FINGERPRINT_LEN],
        ct: &Ciphertext,
        confirm: &[u8; CONFIRM_LEN],
        now: u64,
    ) -> Result<Vec<Vec<u8>>, Refused> {
        if let State::Committing { round: r, .. } = self.state {
            if r == round {
                // The follower repeats its reply: the commit did not reach it.
                if let State::Committing { next_send, .. } = &mut self.state {
                    *next_send = now;
                }
                return Ok(Vec::new());
            }
        }
        let State::Offered {
            round: offered,
            sent,
            peer_ek,
            ..
        } = &self.state
        else {
            return Err(Refused::NoRound {
                kind: "reply",
                round,
            });
        };
        if *offered != round {
            return Err(Refused::NoRound {
                kind: "reply",
                round,
            });
        }
        let kem = own.kem_for(ek).ok_or(Refused::OldKey)?;
        let stale_key = own.kem.encaps_key().short_fingerprint() != *ek;
        let from_follower = kem.decapsulate(ct);
        let own_ek = kem.encaps_key().fingerprint();
        let secret = RoundSecret::derive(&RoundInput {
            pair: self.auth.pair(),
            round,
            lo_to_hi: sent,
            hi_to_lo: &from_follower,
            ek_hi: peer_ek,
            ek_lo: &own_ek,
        });
        if !secret.confirms(&fields(b"reply", round, None), confirm) {
            // Nothing changes; a new round after the usual pause.
            self.state = State::Idle {
                next_at: now.saturating_add(self.timing.retry),
            };
            return Err(Refused::Confirm);
        }
        let switch_at = now.saturating_add(self.timing.switch_delay);
        self.next = Some(Installed {
            round,
            psk: secret.psk().clone(),
            at_ms: switch_at,
        });
        self.state = State::Committing {
            round,
            switch_at,
            secret,
            sends: 0,
            next_send: now,
            stale_key,
        };
        self.last_refusal = None;
        // The commit goes out at the next poll, which the caller makes at once.
        Ok(Vec::new())
    }

    fn on_commit(
        &mut self,
        round: u64,
        switch_in: u64,
        confirm: &[u8; CONFIRM_LEN],
        now: u64,
    ) -> Result<Vec<Vec<u8>>, Refused> {
        let ack = |secret: &RoundSecret, this: &Exchange| {
            let body = Body::Ack {
                confirm: secret.confirm(&fields(b"ack", round, None)),
            };
            this.message(round, [0; FINGERPRINT_LEN], body)
                .encode(&this.auth)
        };
        let State::Replied {
            round: replied,
            secret,
            ..
        } = &self.state
        else {
            return Err(Refused::NoRound {
                kind: "commit",
                round,
            });
        };
        if *replied != round {
            return Err(Refused::NoRound {
                kind: "commit",
                round,
            });
        }
        if !secret.confirms(&fields(b"commit", round, Some(switch_in)), confirm) {
            return Err(Refused::Confirm);
        }
        let at_ms = now.saturating_add(switch_in.min(self.timing.switch_delay));
        let installed = Installed {
            round,
            psk: secret.psk().clone(),
            at_ms,
        };
        let reply = ack(secret, self);
        if self.next.as_ref().map(|n| n.round) != Some(round)
            && self.current.as_ref().map(|c| c.round) != Some(round)
        {
            self.next = Some(installed);
        }
        Ok(vec![reply])
    }

    fn on_ack(&mut self, round: u64, confirm: &[u8; CONFIRM_LEN]) -> Result<Vec<Vec<u8>>, Refused> {
        let State::Committing {
            round: committing,
            secret,
            stale_key,
            ..
        } = &self.state
        else {
            return Err(Refused::NoRound { kind: "ack", round });
        };
        if *committing != round {
            return Err(Refused::NoRound { kind: "ack", round });
        }
        if !secret.confirms(&fields(b"ack", round, None), confirm) {
            return Err(Refused::Confirm);
        }
        // A secret that still rests on this node's previous ML-KEM key is replaced soon:
        // by then the follower has seen the new key published.
        let wait = if *stale_key {
            self.timing.retry.saturating_mul(STALE_KEY_RETRIES)
        } else {
            self.timing.period
        };
        self.state = State::Idle {
            next_at: round.saturating_add(wait),
        };
        Ok(Vec::new())
    }
}

/// After a round whose follower used this node's previous ML-KEM key, the next one comes
/// this many `Timing::retry`s after it began (the period is the most it waits).
const STALE_KEY_RETRIES: u64 = 5;
