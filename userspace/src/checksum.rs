//! The Internet checksum (RFC 1071) over byte slices, as TCP, UDP and IPv4 use it.

/// Adds `data`, as big-endian 16-bit words, to the running sum `acc` (unfolded). An odd
/// last byte counts as the high byte of a word.
///
/// Every byte of every packet is summed here (each segment the sending side makes, each
/// one the receiving side checks before merging), so the bulk is summed as native-endian
/// 32-bit words into eight independent 64-bit lanes, which the compiler vectorizes: a
/// ones' complement sum does not depend on byte order (RFC 1071, 2(B)), so the lanes'
/// sum, folded to 16 bits and byte-swapped, is the big-endian words' sum. One word at a
/// time with a byte swap each (`add_words`) was about 1 % of all CPU under a bulk flow.
pub fn add(acc: u64, data: &[u8]) -> u64 {
    const LANES: usize = 8;
    let mut blocks = data.chunks_exact(4 * LANES);
    let mut lanes = [0u64; LANES];
    for block in &mut blocks {
        for (lane, word) in lanes.iter_mut().zip(block.chunks_exact(4)) {
            *lane += u64::from(u32::from_ne_bytes([word[0], word[1], word[2], word[3]]));
        }
    }
    // Each lane holds at most 2^32 per 32 bytes: no overflow below 2^37 bytes.
    let native = lanes.iter().fold(0u64, |sum, lane| {
        let (s, carry) = sum.overflowing_add(*lane);
        s + u64::from(carry)
    });
    let folded = fold(native);
    let network = if cfg!(target_endian = "little") {
        folded.swap_bytes()
    } else {
        folded
    };
    add_words(acc + u64::from(network), blocks.remainder())
}

/// `add`, one big-endian word at a time: for what is left after the lanes, and the
/// reference the lanes are tested against.
fn add_words(mut acc: u64, data: &[u8]) -> u64 {
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        acc += u64::from(u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
    }
    let rest = words.remainder();
    let mut pairs = rest.chunks_exact(2);
    for p in &mut pairs {
        acc += u64::from(u16::from_be_bytes([p[0], p[1]]));
    }
    if let [last] = pairs.remainder() {
        acc += u64::from(*last) << 8;
    }
    acc
}

/// Folds a running sum into 16 bits (not complemented).
pub fn fold(mut acc: u64) -> u16 {
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// The TCP/UDP pseudo-header's sum: addresses, protocol and the transport length.
pub fn pseudo_header(src: &[u8], dst: &[u8], protocol: u8, length: usize) -> u64 {
    let acc = add(add(0, src), dst);
    acc + u64::from(protocol) + (length as u64 & 0xffff_ffff)
}

/// Recomputes an IPv4 header's checksum in place (`header` is exactly the header).
pub fn ipv4_header(header: &mut [u8]) {
    header[10] = 0;
    header[11] = 0;
    let sum = !fold(add(0, header));
    header[10..12].copy_from_slice(&sum.to_be_bytes());
}

/// Whether a TCP or UDP segment's checksum is right: `transport` is the transport header
/// and payload, `src`/`dst` the IP addresses.
pub fn transport_valid(src: &[u8], dst: &[u8], protocol: u8, transport: &[u8]) -> bool {
    let acc = add(
        pseudo_header(src, dst, protocol, transport.len()),
        transport,
    );
    fold(acc) == 0xffff
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_ipv4_header() {
        // The example header from RFC 1071's discussions (Wikipedia's IPv4 checksum).
        let mut h = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xff, 0xff, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        ipv4_header(&mut h);
        assert_eq!(&h[10..12], &[0xb8, 0x61]);
        assert_eq!(fold(add(0, &h)), 0xffff);
    }

    #[test]
    fn the_lanes_sum_as_one_word_at_a_time_does() {
        let mut rng = crate::test_rng::Rng(0x5eed_c5c5_0000_0001);
        for round in 0..2_000 {
            let len = match round % 4 {
                0 => rng.below(64) as usize,
                1 => rng.below(2_000) as usize,
                _ => rng.below(65_536) as usize,
            };
            // Now and then all ones or all zeros: the two zeros of ones' complement.
            let fill = rng.below(8);
            let data: Vec<u8> = (0..len)
                .map(|_| match fill {
                    0 => 0xff,
                    1 => 0,
                    _ => rng.next() as u8,
                })
                .collect();
            let acc = rng.next() & 0xffff_ffff;
            assert_eq!(
                fold(add(acc, &data)),
                fold(add_words(acc, &data)),
                "round {round}, {len} bytes"
            );
        }
    }

    #[test]
    fn odd_lengths_pad_with_zero() {
        assert_eq!(fold(add(0, &[0x12])), 0x1200);
        assert_eq!(fold(add(0, &[0x12, 0x34, 0x56])), 0x1234 + 0x5600);
        assert_eq!(
            fold(add(0, &[1, 2, 3, 4, 5, 6, 7])),
            0x0102 + 0x0304 + 0x0506 + 0x0700
        );
        let big = [0xffu8; 9];
        assert_eq!(fold(add(0, &big)), fold(4 * 0xffff + 0xff00));
    }
}
