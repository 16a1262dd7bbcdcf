//! One walk over two maps sorted by the same key: the diffs a pass makes of a map of every
//! node cost a comparison per entry, not a lookup (and a hash) per entry.

use std::cmp::Ordering;
use std::collections::BTreeMap;

/// Where a key stands, comparing an earlier map with a later one.
pub enum Side<'a, K, V, W> {
    /// Only in the earlier map.
    Gone(&'a K, &'a V),
    /// Only in the later map.
    New(&'a K, &'a W),
    /// In both.
    Both(&'a K, &'a V, &'a W),
}

/// Calls `f` for every key of `earlier` and `later`, in key order.
pub fn walk<'a, K: Ord, V, W>(
    earlier: &'a BTreeMap<K, V>,
    later: &'a BTreeMap<K, W>,
    mut f: impl FnMut(Side<'a, K, V, W>),
) {
    let (mut a, mut b) = (earlier.iter().peekable(), later.iter().peekable());
    loop {
        let order = match (a.peek(), b.peek()) {
            (None, None) => return,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some((x, _)), Some((y, _))) => x.cmp(y),
        };
        match order {
            Ordering::Less => {
                if let Some((k, v)) = a.next() {
                    f(Side::Gone(k, v));
                }
            }
            Ordering::Greater => {
                if let Some((k, w)) = b.next() {
                    f(Side::New(k, w));
                }
            }
            Ordering::Equal => {
                if let (Some((k, v)), Some((_, w))) = (a.next(), b.next()) {
                    f(Side::Both(k, v, w));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_once_in_order() {
        let a: BTreeMap<u8, char> = [(1, 'a'), (3, 'c'), (5, 'e')].into();
        let b: BTreeMap<u8, u8> = [(2, 20), (3, 30), (6, 60)].into();
        let mut seen = Vec::new();
        walk(&a, &b, |side| {
            seen.push(match side {
                Side::Gone(k, v) => format!("-{k}{v}"),
                Side::New(k, w) => format!("+{k}:{w}"),
                Side::Both(k, v, w) => format!("={k}{v}{w}"),
            })
        });
        assert_eq!(seen, ["-1a", "+2:20", "=3c30", "-5e", "+6:60"]);
    }
}
