//! The fuzzer's cases: a seed (or two spliced), then one to eight mutations (half the
//! cases one).

/// xorshift64*: small, fast and reproducible from its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Bytes parsers trip on: JSON's and the line formats' punctuation, ends of ranges.
const INTERESTING: &[u8] = b"\x00\xff\x7f\x80\"{}[],:=\n\r\t /\\.-+0 9eE%";

/// Tokens every target gets, besides its own.
const COMMON: &[&str] = &[
    "null",
    "true",
    "false",
    "[]",
    "{}",
    "\"\"",
    "-1",
    "0",
    "4294967295",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775809",
    "1e999",
    "0.5",
    "::",
    "0.0.0.0/0",
    "::/0",
    "/33",
    "/129",
    "255.255.255.255",
    "ffff::1/128",
    "\\u0000",
    "\\ud800",
    "é",
    "\u{202e}",
    "%00",
];

/// Writes the next case into `out`.
pub fn next_case(rng: &mut Rng, seeds: &[Vec<u8>], tokens: &[&str], out: &mut Vec<u8>) {
    out.clear();
    let seed = &seeds[rng.below(seeds.len())];
    out.extend_from_slice(seed);
    // Mostly one or two mutations (a case still close to a valid input reaches deeper
    // into the parser), sometimes up to eight.
    for _ in 0..1 + rng.next_u64().trailing_ones().min(7) {
        mutate(rng, seeds, tokens, out);
    }
}

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>], tokens: &[&str], out: &mut Vec<u8>) {
    let len = out.len();
    let at = if len == 0 { 0 } else { rng.below(len + 1) };
    match rng.below(9) {
        0 if len > 0 => {
            let i = rng.below(len);
            out[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = rng.below(len);
            out[i] = INTERESTING[rng.below(INTERESTING.len())];
        }
        2 => out.insert(at, rng.next_u64() as u8),
        3 if len > 0 => {
            let end = (at + 1 + rng.below(16)).min(len);
            out.drain(at.min(end)..end);
        }
        4 => {
            let token = if rng.below(3) == 0 || tokens.is_empty() {
                COMMON[rng.below(COMMON.len())]
            } else {
                tokens[rng.below(tokens.len())]
            };
            splice_in(out, at, token.as_bytes());
        }
        5 if len > 0 => {
            // Repeat a piece: deep nesting, long values, many fields.
            let start = rng.below(len);
            let end = (start + 1 + rng.below(32)).min(len);
            let piece = out[start..end].to_vec();
            for _ in 0..1 + rng.below(64) {
                splice_in(out, at, &piece);
            }
        }
        6 => out.truncate(at),
        7 => {
            // Splice: the head of this case, the tail of another seed.
            let other = &seeds[rng.below(seeds.len())];
            if !other.is_empty() {
                let from = rng.below(other.len());
                out.truncate(at);
                out.extend_from_slice(&other[from..]);
            }
        }
        _ => {
            let token = tokens
                .get(rng.below(tokens.len().max(1)))
                .copied()
                .unwrap_or("0");
            // Replace a number or word under `at` with a token.
            let start = out[..at.min(len)]
                .iter()
                .rposition(|b| !b.is_ascii_alphanumeric())
                .map_or(0, |p| p + 1);
            let end = out[start..]
                .iter()
                .position(|b| !b.is_ascii_alphanumeric())
                .map_or(len, |p| start + p);
            out.splice(start..end, token.bytes());
        }
    }
}

fn splice_in(out: &mut Vec<u8>, at: usize, piece: &[u8]) {
    let at = at.min(out.len());
    out.splice(at..at, piece.iter().copied());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_are_reproducible_from_the_seed_and_vary() {
        let seeds = vec![br#"{"a": 1}"#.to_vec()];
        let run = |seed| {
            let mut rng = Rng::new(seed);
            let mut out = Vec::new();
            (0..100)
                .map(|_| {
                    next_case(&mut rng, &seeds, &["\"a\""], &mut out);
                    out.clone()
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        let distinct: std::collections::HashSet<_> = run(7).into_iter().collect();
        assert!(distinct.len() > 80, "{}", distinct.len());
    }
}
