//! The relay's routes in a file (tmpfs, `/run/weft/relay.state`), so a gateway whose agent
//! restarts carries its pairs on at once instead of waiting for each to handshake again.
//! Text, one line per route (`r index from to left_ms confirmed from_key to_key bytes`)
//! or learned address (`m key address left_ms`); written atomically (temp file and
//! rename), read once at start. A line that does not parse is skipped.

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
    let mut out = String::new();
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

/// What `render` wrote, at `now`.
pub(crate) fn parse(text: &str, now: Instant) -> (SavedRoutes, SavedLearned) {
    let (mut routes, mut learned) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f.as_slice() {
            ["r", index, from, to, left, confirmed, fk, tk, bytes] => {
                let parsed = (|| {
                    let left = Duration::from_millis(left.parse().ok()?);
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
                        Duration::from_millis(left.parse().ok()?),
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
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(text.as_bytes())?;
    drop(f);
    std::fs::rename(&tmp, path)
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
