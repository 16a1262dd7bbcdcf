//! This crate's decoders of outside data, each as a function of raw bytes, for the
//! coverage-guided fuzzer (`fuzz/`, `scripts/fuzz`) and for the replay of its corpus on
//! every test run (`replay`, from `tests/fuzz_corpus.rs`; the other crates' corpus tests
//! use it too). Each must return for any input without panicking, and panics where an
//! invariant it checks does not hold.
//!
//! - `pq_datagrams`: the post-quantum exchange's datagrams, between two nodes' exchanges
//!   that run their rounds, the input choosing what is delivered, altered (and tagged
//!   again, as only the pair could), reflected, forged, and when the clocks move;
//! - `mlkem_key`: an ML-KEM-768 encapsulation key as a node publishes it (base64) and as
//!   bytes, and a key pair from a seed;
//! - `key_proof`: a node's key proof as published, verified for a name and a key.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use crate::pq::{self, AuthKey, EncapsKey, Exchange, KemKeyPair, Own, Timing};
use crate::{PrivateKey, PublicKey};

/// A fuzz target: bytes in, nothing out.
pub type Target = fn(&[u8]);

/// What makes a target's seeds.
pub type Seeds = fn() -> Vec<Vec<u8>>;

/// Every target, by name (the names of `fuzz/fuzz_targets/*.rs` and of the corpus folders).
pub const TARGETS: &[(&str, Target)] = &[
    ("pq_datagrams", pq_datagrams),
    ("mlkem_key", mlkem_key),
    ("key_proof", key_proof),
];

/// Targets whose seeds are made by code: by name, the seeds.
pub const SEEDS: &[(&str, Seeds)] = &[
    ("pq_datagrams", pq_seeds),
    ("mlkem_key", mlkem_seeds),
    ("key_proof", proof_seeds),
];

/// Runs every input of each target's corpus (`root/<name>/`) through it: the inputs that
/// panicked, or an error naming a corpus that is missing or empty.
pub fn replay(root: &Path, targets: &[(&str, Target)]) -> Result<Vec<String>, String> {
    let mut failures = Vec::new();
    for (name, target) in targets {
        let dir = root.join(name);
        let mut inputs: Vec<_> = std::fs::read_dir(&dir)
            .map_err(|e| format!("the corpus of {name} ({}): {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        inputs.sort();
        if inputs.is_empty() {
            return Err(format!("the corpus of {name} is empty"));
        }
        for input in &inputs {
            let data = std::fs::read(input).map_err(|e| format!("{}: {e}", input.display()))?;
            if catch_unwind(AssertUnwindSafe(|| target(&data))).is_err() {
                failures.push(input.display().to_string());
            }
        }
        eprintln!("{name}: {} inputs replayed", inputs.len());
    }
    Ok(failures)
}

/// Writes each target's seeds into its corpus (`root/<name>/seed-<n>`), or, with `write`
/// false, runs them through the target: the seeds that panicked.
pub fn seeds(
    root: &Path,
    targets: &[(&str, Target)],
    seeds: &[(&str, Seeds)],
    write: bool,
) -> Result<Vec<String>, String> {
    let mut failures = Vec::new();
    for (name, make) in seeds {
        let target = targets.iter().find(|(n, _)| n == name).map(|(_, t)| *t);
        let target = target.ok_or_else(|| format!("seeds for {name}, which is no target"))?;
        for (i, seed) in make().iter().enumerate() {
            if write {
                let dir = root.join(name);
                let path = dir.join(format!("seed-{i}"));
                std::fs::create_dir_all(&dir)
                    .and_then(|()| std::fs::write(&path, seed))
                    .map_err(|e| format!("{}: {e}", path.display()))?;
            } else if catch_unwind(AssertUnwindSafe(|| target(seed))).is_err() {
                failures.push(format!("{name} seed {i}"));
            }
        }
    }
    Ok(failures)
}

/// The fuzzer's input, read a field at a time; past its end every field reads as zero.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    fn bytes(&mut self, n: usize) -> &[u8] {
        let (taken, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        taken
    }
}

/// The clock the two nodes start at (ms since the Unix epoch).
const T0: u64 = 1_800_000_000_000;
const MAX_OPS: usize = 64;
const POOL: usize = 32;
/// Where a message's receiver key starts (after magic, kind and the sender key).
const TO_AT: usize = 8 + crate::KEY_LEN;

/// One node's side of the pair.
struct Side {
    own: Own,
    ex: Exchange,
    auth: AuthKey,
}

impl Side {
    fn key(&self) -> PublicKey {
        self.own.key.public_key()
    }
}

/// The node with X25519 key `key` and ML-KEM seed `seed`, and its exchange with the other.
fn own(key: u8, seed: u8) -> Own {
    Own {
        key: PrivateKey::from_bytes([key; 32]),
        kem: KemKeyPair::from_seed([seed; pq::SEED_LEN]),
        previous_kem: None,
    }
}

/// Two nodes running rounds, and what went between them.
struct Pair {
    sides: [Side; 2],
    now: u64,
    pool: Vec<Vec<u8>>,
    /// Whether a message the pair did not make, tagged with its key, was delivered: from
    /// then on the two may disagree (only the pair's two nodes can tag).
    forged: bool,
}

impl Pair {
    fn new() -> Option<Pair> {
        let (a, b) = (own(1, 11), own(2, 12));
        let (ka, eka) = (a.key.public_key(), a.kem.encaps_key());
        let (kb, ekb) = (b.key.public_key(), b.kem.encaps_key());
        let side = |me: Own, peer: PublicKey, peer_ek: EncapsKey| -> Option<Side> {
            let ex = Exchange::new(&me, peer, peer_ek, Timing::default(), T0).ok()?;
            let auth = AuthKey::new(&me.key, &peer).ok()?;
            Some(Side { own: me, ex, auth })
        };
        let sa = side(a, kb, ekb)?;
        let sb = side(b, ka, eka)?;
        Some(Pair {
            sides: [sa, sb],
            now: T0,
            pool: Vec::new(),
            forged: false,
        })
    }

    fn keep(&mut self, d: Vec<u8>) {
        if self.pool.len() >= POOL {
            self.pool.remove(0);
        }
        self.pool.push(d);
    }

    fn pick(&self, i: u8) -> Option<Vec<u8>> {
        let n = self.pool.len();
        (n > 0).then(|| self.pool[n - 1 - usize::from(i) % n].clone())
    }

    /// The side a datagram is addressed to (the first, for one addressed to neither).
    fn addressee(&self, d: &[u8]) -> usize {
        let to = d.get(TO_AT..TO_AT + crate::KEY_LEN);
        usize::from(to == Some(self.sides[1].key().as_bytes().as_slice()))
    }

    /// Hands `d` to side `to`; its answers are kept. A datagram the pair never tagged
    /// must be refused.
    fn deliver(&mut self, to: usize, d: &[u8], tagged: bool) {
        let side = &mut self.sides[to];
        let result = side.ex.receive(&side.own, d, self.now);
        if !tagged {
            assert!(
                result.is_err(),
                "a datagram the pair did not tag ({} bytes) was taken",
                d.len()
            );
        }
        for reply in result.unwrap_or_default() {
            self.keep(reply);
        }
    }

    fn poll(&mut self) {
        for i in 0..2 {
            let poll = self.sides[i].ex.poll(self.now);
            for d in poll.map(|p| p.send).unwrap_or_default() {
                self.keep(d);
            }
        }
    }

    /// Unless a forgery was delivered, the two nodes agree: a PSK in force for the same
    /// round on both sides is the same PSK.
    fn check(&mut self) {
        if self.forged {
            return;
        }
        let now = self.now;
        let [a, b] = &mut self.sides;
        let (pa, pb) = (a.ex.psk(now).cloned(), b.ex.psk(now).cloned());
        if let (Some(pa), Some(pb)) = (pa, pb) {
            if pa.round == pb.round {
                assert!(pa.psk == pb.psk, "round {}: two different PSKs", pa.round);
            }
        }
    }

    /// Tags `d` again as side `from` would (it must be long enough for a tag).
    fn retag(&self, from: usize, d: &mut [u8]) {
        let Some(at) = d.len().checked_sub(16) else {
            return;
        };
        let tag: [u8; 16] = self.sides[from].auth.tag(&d[..at]);
        d[at..].copy_from_slice(&tag);
    }

    fn step(&mut self, input: &mut Input<'_>) {
        match input.byte() % 7 {
            0 => {
                self.now += u64::from(input.u16()) * 10;
                self.poll();
            }
            1 => {
                let Some(d) = self.pick(input.byte()) else {
                    return;
                };
                let to = self.addressee(&d);
                self.deliver(to, &d, true);
            }
            2 => {
                let Some(mut d) = self.pick(input.byte()) else {
                    return;
                };
                let (at, xor, retag) = (usize::from(input.u16()), input.byte(), input.byte());
                if d.is_empty() || xor == 0 {
                    return;
                }
                let at = at % d.len();
                d[at] ^= xor;
                let to = self.addressee(&d);
                if retag & 1 == 1 {
                    self.retag(1 - to, &mut d);
                    self.forged = true;
                }
                self.deliver(to, &d, retag & 1 == 1);
            }
            3 => {
                // Reflected: back to its own sender.
                let Some(d) = self.pick(input.byte()) else {
                    return;
                };
                let to = 1 - self.addressee(&d);
                self.deliver(to, &d, true);
            }
            4 => self.forge(input),
            5 => {
                let side = usize::from(input.byte() & 1);
                let notice = self.sides[side].ex.fall_back(self.now);
                self.keep(notice);
            }
            _ => {
                let (side, seed) = (usize::from(input.byte() & 1), input.byte());
                let s = &mut self.sides[side];
                let new = KemKeyPair::from_seed([seed; pq::SEED_LEN]);
                let ek = new.encaps_key();
                s.own.previous_kem = Some(std::mem::replace(&mut s.own.kem, new));
                s.ex.own_kem_changed(self.now);
                self.sides[1 - side].ex.peer_ek_changed(ek, self.now);
            }
        }
        self.check();
    }

    /// A message of the fuzzer's making: kind, round, fingerprint and body from the
    /// input, between the pair's keys, tagged as the pair would tag it or not.
    fn forge(&mut self, input: &mut Input<'_>) {
        let (kind, dir, flags) = (
            input.byte() % 6,
            usize::from(input.byte() & 1),
            input.byte(),
        );
        let round = T0 + u64::from(input.u16()) * 10;
        let body_len = [0, pq::CIPHERTEXT_LEN, pq::CIPHERTEXT_LEN + 16, 24, 16, 0];
        let body = input.bytes(body_len[usize::from(kind)]).to_vec();
        let (from, to) = (&self.sides[dir], &self.sides[1 - dir]);
        let mut d = Vec::with_capacity(pq::MAX_LEN);
        d.extend_from_slice(b"wpq1");
        d.extend_from_slice(&[kind, 0, 0, 0]);
        d.extend_from_slice(from.key().as_bytes());
        d.extend_from_slice(to.key().as_bytes());
        d.extend_from_slice(&round.to_be_bytes());
        // The receiver's own key's fingerprint, or zeros.
        let fp = if flags & 2 == 2 {
            to.own.kem.encaps_key().short_fingerprint()
        } else {
            [0; pq::FINGERPRINT_LEN]
        };
        d.extend_from_slice(&fp);
        d.extend_from_slice(&body);
        d.resize(d.len().max(88) + 16, 0);
        let tagged = flags & 1 == 1;
        if tagged {
            self.retag(dir, &mut d);
            self.forged = true;
        }
        self.deliver(1 - dir, &d, tagged);
    }
}

/// See the module's doc.
pub fn pq_datagrams(data: &[u8]) {
    run_pq(data);
}

fn run_pq(data: &[u8]) -> Option<Pair> {
    let mut pair = Pair::new()?;
    let mut input = Input(data);
    for _ in 0..MAX_OPS {
        if input.0.is_empty() {
            break;
        }
        pair.step(&mut input);
    }
    Some(pair)
}

fn pq_seeds() -> Vec<Vec<u8>> {
    let tick = |t: u16| vec![0, t as u8, (t >> 8) as u8];
    let deliver = |i: u8| vec![1, i];
    // A whole round: the init, its reply, the commit, the ack, then the switch.
    let round = [
        tick(0),
        deliver(0),
        deliver(0),
        tick(1),
        deliver(0),
        tick(1),
        deliver(0),
        tick(200),
    ]
    .concat();
    vec![
        round.clone(),
        // The round, then its messages replayed and reflected.
        [round.clone(), deliver(3), vec![3, 0], vec![3, 2]].concat(),
        // The init altered: not tagged again, then tagged again.
        [tick(0), vec![2, 0, 200, 0, 1, 0], vec![2, 0, 200, 0, 1, 1]].concat(),
        // Forgeries of every kind, tagged as the pair would and not.
        [
            tick(0),
            vec![4, 1, 0, 3],
            vec![4, 2, 1, 3],
            vec![4, 3, 0, 1],
            vec![4, 4, 1, 1],
            vec![4, 5, 0, 1],
            vec![4, 1, 1, 0],
        ]
        .concat(),
        // A fall-back notice each way, after a round.
        [
            round.clone(),
            vec![5, 0],
            deliver(0),
            vec![5, 1],
            deliver(0),
        ]
        .concat(),
        // An ML-KEM key rotated in the middle of a round, then the next round.
        [
            tick(0),
            deliver(0),
            vec![6, 1, 33],
            deliver(0),
            tick(1),
            deliver(0),
            tick(1),
            deliver(0),
            tick(12_000),
            deliver(0),
            deliver(0),
            tick(1),
            deliver(0),
            tick(1),
            deliver(0),
            tick(200),
        ]
        .concat(),
    ]
}

/// The input as a published key (text), and as the key's bytes; its first 64 bytes as a
/// key pair's seed, whose key must pass the check its peers make, and whose ciphertext
/// from the rest of the input decapsulates to something.
pub fn mlkem_key(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(ek) = EncapsKey::from_base64(text) {
            let again = EncapsKey::from_base64(&ek.to_base64());
            assert!(
                again.as_ref() == Ok(&ek),
                "a key does not survive its base64"
            );
        }
    }
    if let Ok(ek) = EncapsKey::from_bytes(data) {
        let _ = pq::encapsulate(&ek);
    }
    if let Some(seed) = data.first_chunk::<{ pq::SEED_LEN }>() {
        let pair = KemKeyPair::from_seed(*seed);
        let ek = pair.encaps_key();
        assert!(
            EncapsKey::from_bytes(ek.as_bytes()).is_ok(),
            "a key pair's own key fails the check"
        );
        if let Ok(ct) = pq::Ciphertext::from_bytes(&data[pq::SEED_LEN..]) {
            let _ = pair.decapsulate(&ct);
        }
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = pq::seed_from_base64(text);
    }
}

fn mlkem_seeds() -> Vec<Vec<u8>> {
    let ek = KemKeyPair::from_seed([5; pq::SEED_LEN]).encaps_key();
    let mut not_reduced = ek.as_bytes().to_vec();
    not_reduced[0] = 0xff;
    not_reduced[1] = 0xff;
    vec![
        ek.to_base64().into_bytes(),
        format!(" {}\n", ek.to_base64()).into_bytes(),
        ek.as_bytes().to_vec(),
        not_reduced,
        [[9u8; pq::SEED_LEN].as_slice(), &[1u8; pq::CIPHERTEXT_LEN]].concat(),
        pq::seed_to_base64(&[3; pq::SEED_LEN]).into_bytes(),
    ]
}

/// The input split at its first NUL: a node's name, then its proof as published; a third
/// part (after a second NUL), when 32 bytes, is the key it is verified for (else the
/// fixed key `PROOF_KEY`'s).
pub fn key_proof(data: &[u8]) {
    let mut parts = data.splitn(3, |b| *b == 0);
    let node = String::from_utf8_lossy(parts.next().unwrap_or_default());
    let text = String::from_utf8_lossy(parts.next().unwrap_or_default());
    let key = match parts.next().and_then(|k| <[u8; 32]>::try_from(k).ok()) {
        Some(k) => PublicKey::from_bytes(k),
        None => PrivateKey::from_bytes(PROOF_KEY).public_key(),
    };
    if let Some(proof) = crate::proof::from_text(&text) {
        assert!(
            crate::proof::from_text(&crate::proof::to_text(&proof)) == Some(proof),
            "a proof does not survive its text"
        );
        let _ = crate::proof::verify(&key, &node, &proof);
    }
}

/// The key the proofs of `key_proof`'s seeds are made with.
const PROOF_KEY: [u8; 32] = [42; 32];

fn proof_seeds() -> Vec<Vec<u8>> {
    let key = PrivateKey::from_bytes(PROOF_KEY);
    let mut seeds = Vec::new();
    for node in ["node-a", "", "a-node-with-a-much-longer-name.example"] {
        if let Ok(proof) = crate::proof::prove(&key, node) {
            let text = crate::proof::to_text(&proof);
            seeds.push([node.as_bytes(), &[0], text.as_bytes()].concat());
            let other = *PrivateKey::from_bytes([43; 32]).public_key().as_bytes();
            seeds.push([node.as_bytes(), &[0], text.as_bytes(), &[0], &other].concat());
        }
    }
    seeds.push(b"node-a\0not base64!".to_vec());
    seeds
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rounds (the PSK each side holds) a `pq_datagrams` input leaves.
    fn rounds(seed: &[u8]) -> [Option<u64>; 2] {
        let Some(mut pair) = run_pq(seed) else {
            panic!("no pair")
        };
        let now = pair.now;
        pair.sides
            .each_mut()
            .map(|s| s.ex.psk(now).map(|i| i.round))
    }

    #[test]
    fn the_pq_seeds_complete_rounds_and_their_forgeries_are_refused() {
        let seeds = pq_seeds();
        let [a, b] = rounds(&seeds[0]);
        assert!(a.is_some() && a == b, "one round completes: {a:?} {b:?}");
        let [a, b] = rounds(&seeds[1]);
        assert!(
            a.is_some() && a == b,
            "replays and reflections change nothing"
        );
        assert_eq!(rounds(&seeds[3]), [None, None], "forgeries make no PSK");
        assert_eq!(rounds(&seeds[4]), [None, None], "both fell back");
        let [a, b] = rounds(&seeds[5]);
        assert!(
            a.is_some() && a == b,
            "a round completes across a key rotation"
        );
    }
}
