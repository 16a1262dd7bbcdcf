//! `IfName`: a network device's name held inline. The kernel's names are at most 15 bytes
//! (`IFNAMSIZ` less its NUL), so one fits in 16 bytes with no heap string behind it. Maps
//! keyed by (device, peer) hold one entry per peer of the cluster and are made, copied and
//! joined on every pass: a `String` there was an allocation, a free and a pointer chase per
//! peer; this is a copy and a 16-byte compare.

use std::fmt;

/// The kernel's longest device name, in bytes.
const MOST: usize = 15;

/// A device's name, ordered as its text is.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct IfName {
    /// The name's bytes, zero after its end: compared as bytes, the same order as the
    /// names' text (a name holds no NUL).
    bytes: [u8; MOST + 1],
}

impl IfName {
    /// `name` as a device name. A name past the kernel's 15 bytes (which no device can
    /// have) keeps its first 15 bytes, cut at a character's edge.
    pub fn new(name: &str) -> IfName {
        let mut end = name.len().min(MOST);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        let mut bytes = [0u8; MOST + 1];
        bytes[..end].copy_from_slice(&name.as_bytes()[..end]);
        IfName { bytes }
    }

    pub fn as_str(&self) -> &str {
        let len = self.bytes.iter().position(|b| *b == 0).unwrap_or(MOST);
        // Made from a `&str` cut at a character's edge: always UTF-8.
        std::str::from_utf8(&self.bytes[..len]).unwrap_or_default()
    }
}

impl From<&str> for IfName {
    fn from(name: &str) -> IfName {
        IfName::new(name)
    }
}

impl PartialEq<str> for IfName {
    fn eq(&self, other: &str) -> bool {
        *self == IfName::new(other) && other.len() <= MOST
    }
}

impl fmt::Display for IfName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for IfName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_reads_back_and_orders_as_its_text() {
        let names = [
            "",
            "a",
            "ab",
            "b",
            "flannel-wg",
            "flannel-wg-v6",
            "wg0",
            "zzzzzzzzzzzzzzz",
        ];
        for n in names {
            assert_eq!(IfName::new(n).as_str(), n);
            assert!(IfName::new(n) == *n);
        }
        for a in names {
            for b in names {
                assert_eq!(IfName::new(a).cmp(&IfName::new(b)), a.cmp(b), "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn a_name_past_the_kernels_limit_is_cut_at_a_character() {
        assert_eq!(
            IfName::new("0123456789abcdefgh").as_str(),
            "0123456789abcde"
        );
        // 14 ASCII bytes, then a two-byte character that would end past byte 15.
        assert_eq!(IfName::new("0123456789abcdé").as_str(), "0123456789abcd");
        assert!(IfName::new("0123456789abcdefgh") != *"0123456789abcdefgh");
        assert_eq!(format!("{:?}", IfName::new("wg0")), "\"wg0\"");
    }
}
