//! The relay's routes in a file (tmpfs, `/run/weft/relay.state`), so a gateway whose agent
//! restarts carries its pairs on at once instead of waiting for each to handshake again.
//! Text: when it was written (`t unix_ms`), then one line per confirmed route (`r index
//! from to left_ms confirmed from_key to_key bytes`) or learned address (`m key address
//! left_ms`); written atomically (temp file and rename), read once at start, each
//! lifetime less the time since it was written (a relay that comes back after a while
//! takes back only what is still alive). A line that does not parse is skipped.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use super::table::{Key, Route, SavedLearned, SavedRoutes, Table};

fn hex(key: Option<&Key>) -> String {
    match key {
        None => "-".into(),
        Some(k) => k.iter().fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        }),
    }
}

fn unhex(text: &str) -> Option<Option<Key>> {
    if text == "-" {
        return Some(None);
    }
    let mut key = [0u8; 32];
    if text.len() != 64 {
        return None;
    }
    for (i, b) in key.iter_mut().enumerate() {
        *b = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(Some(key))
}

/// The table as text.
pub(crate) fn render(table: &Table, now: Instant) -> String {
    let (routes, learned) = table.snapshot(now);
    let mut out = format!("t {}\n", unix_ms());
    for ((index, from), r, left) in routes {
        let _ = writeln!(
            out,
            "r {index} {from} {} {} {} {} {} {}",
            r.to,
            left.as_millis(),
            u8::from(r.confirmed),
            hex(r.from_key.as_ref()),
            hex(r.to_key.as_ref()),
            r.bytes
        );
    }
    for (key, addr, left) in learned {
        let _ = writeln!(out, "m {} {addr} {}", hex(Some(&key)), left.as_millis());
    }
    out
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What `render` wrote, at `now`: each lifetime at most its kind's, less the time since
/// the file was written.
pub(crate) fn parse(text: &str, now: Instant) -> (SavedRoutes, SavedLearned) {
    let (mut routes, mut learned) = (Vec::new(), Vec::new());
    let mut since = Duration::ZERO;
    let left = |ms: &str, most: Duration, since: Duration| -> Option<Duration> {
        Duration::from_millis(ms.parse().ok()?)
            .min(most)
            .checked_sub(since)
            .filter(|d| !d.is_zero())
    };
    for line in text.lines() {
        let left_of = |ms: &str, most: Duration| left(ms, most, since);
        let f: Vec<&str> = line.split(' ').collect();
        match f.as_slice() {
            ["t", at] => {
                if let Ok(at) = at.parse::<u64>() {
                    since = Duration::from_millis(unix_ms().saturating_sub(at));
                }
            }
            ["r", index, from, to, left, confirmed, fk, tk, bytes] => {
                let parsed = (|| {
                    let left = left_of(left, super::table::ROUTE_LIFE)?;
                    Some((
                        (index.parse().ok()?, from.parse().ok()?),
                        Route {
                            to: to.parse().ok()?,
                            until: now + left,
                            confirmed: *confirmed == "1",
                            from_key: unhex(fk)?,
                            to_key: unhex(tk)?,
                            bytes: bytes.parse().ok()?,
                        },
                        left,
                    ))
                })();
                routes.extend(parsed);
            }
            ["m", key, addr, left] => {
                let parsed = (|| {
                    Some((
                        unhex(key)??,
                        addr.parse().ok()?,
                        left_of(left, super::table::LEARNED_LIFE)?,
                    ))
                })();
                learned.extend(parsed);
            }
            _ => {}
        }
    }
    (routes, learned)
}

/// Writes `text` to `path` atomically, readable by its owner only.
pub fn save(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    crate::replay_file::write_private(path, text.as_bytes())
}

/// Loads `path` into `table` (nothing if it is missing).
pub fn load(path: &Path, table: &mut Table, now: Instant) -> usize {
    let Ok(text) = std::fs::read_to_string(path) else {
        return 0;
    };
    let (routes, learned) = parse(&text, now);
    let n = routes.len();
    table.restore(routes, learned, now);
    n
}
