//! A reader over one JSON object that records a `ConfigError` for every bad or unknown
//! field instead of stopping at the first. Keys match case-insensitively, as Go's
//! `encoding/json` (and so flannel) does.

use serde_json::{Map, Value};

use super::error::ConfigError;

pub(super) struct Fields<'m, 'e> {
    prefix: &'static str,
    map: &'m Map<String, Value>,
    valid: &'static [&'static str],
    errors: &'e mut Vec<ConfigError>,
}

impl<'m, 'e> Fields<'m, 'e> {
    /// `prefix` is `""` at the top level, or e.g. `"Backend."`.
    pub fn new(
        prefix: &'static str,
        map: &'m Map<String, Value>,
        valid: &'static [&'static str],
        errors: &'e mut Vec<ConfigError>,
    ) -> Self {
        let fields = Fields {
            prefix,
            map,
            valid,
            errors,
        };
        fields.check_keys()
    }

    fn check_keys(self) -> Self {
        for key in self.map.keys() {
            if !self.valid.iter().any(|v| v.eq_ignore_ascii_case(key)) {
                self.errors.push(ConfigError::UnknownKey {
                    key: format!("{}{key}", self.prefix),
                    within: (!self.prefix.is_empty()).then(|| self.prefix.trim_end_matches('.')),
                    valid: self.valid,
                    suggestion: suggest(key, self.valid),
                });
            }
        }
        self
    }

    pub fn path(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The value for `key`, `None` when absent or `null` (Go leaves the zero value then).
    pub fn get(&self, key: &str) -> Option<&'m Value> {
        let value = self.map.get(key).or_else(|| {
            self.map
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(key))
                .map(|(_, v)| v)
        })?;
        (!value.is_null()).then_some(value)
    }

    pub fn string(&mut self, key: &str) -> Option<&'m str> {
        let value = self.get(key)?;
        match value.as_str() {
            Some(s) => Some(s),
            None => {
                self.errors.push(ConfigError::invalid(
                    self.path(key),
                    value,
                    "expected a string",
                ));
                None
            }
        }
    }

    pub fn bool(&mut self, key: &str) -> Option<bool> {
        let value = self.get(key)?;
        match value.as_bool() {
            Some(b) => Some(b),
            None => {
                self.errors.push(ConfigError::invalid(
                    self.path(key),
                    value,
                    "expected true or false",
                ));
                None
            }
        }
    }

    /// An integer in `min..=max`; `what` names the range in the error ("a port").
    pub fn integer(&mut self, key: &str, min: u64, max: u64, what: &str) -> Option<u64> {
        let value = self.get(key)?;
        match value.as_u64() {
            Some(n) if (min..=max).contains(&n) => Some(n),
            Some(_) => {
                self.errors.push(ConfigError::invalid(
                    self.path(key),
                    value,
                    format!("out of range for {what}; valid: {min}–{max}"),
                ));
                None
            }
            None => {
                let problem = if value.is_number() {
                    format!("out of range for {what}; valid: {min}–{max}")
                } else {
                    format!("expected a whole number ({what}, {min}–{max})")
                };
                self.errors
                    .push(ConfigError::invalid(self.path(key), value, problem));
                None
            }
        }
    }

    pub fn push(&mut self, error: ConfigError) {
        self.errors.push(error);
    }
}

/// The valid key closest to a misspelt one, if it is close enough to be a likely typo.
fn suggest(key: &str, valid: &'static [&'static str]) -> Option<&'static str> {
    let key = key.to_ascii_lowercase();
    valid
        .iter()
        .map(|v| (edit_distance(&key, &v.to_ascii_lowercase()), *v))
        .filter(|(d, v)| *d <= 2.max(v.len() / 4))
        .min_by_key(|(d, _)| *d)
        .map(|(_, v)| v)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_near_misses_only() {
        const VALID: &[&str] = &["Network", "SubnetLen", "Backend"];
        assert_eq!(suggest("Netwrok", VALID), Some("Network"));
        assert_eq!(suggest("subentlen", VALID), Some("SubnetLen"));
        assert_eq!(suggest("Colour", VALID), None);
    }
}
