//! Errors in net-conf.json. Each names the key (as a path like `Backend.ListenPort`), echoes
//! the bad value and says what is valid.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid JSON at line {line}, column {column}: {message}")]
    Json {
        line: usize,
        column: usize,
        message: String,
    },
    #[error("unknown key `{}`{}; valid keys{}: {}", crate::model::clip(key), Suggestion(suggestion), Within(within), valid.join(", "))]
    UnknownKey {
        key: String,
        within: Option<&'static str>,
        valid: &'static [&'static str],
        suggestion: Option<&'static str>,
    },
    #[error("`{key}` is required: {why}")]
    Missing { key: String, why: String },
    #[error("`{key}` = {}: {problem}", crate::model::clip(value))]
    Invalid {
        key: String,
        value: String,
        problem: String,
    },
}

impl ConfigError {
    pub fn invalid(
        key: impl Into<String>,
        value: impl fmt::Display,
        problem: impl Into<String>,
    ) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            value: value.to_string(),
            problem: problem.into(),
        }
    }

    /// The key path the error is about (`""` for a JSON syntax error).
    pub fn key(&self) -> &str {
        match self {
            ConfigError::Json { .. } => "",
            ConfigError::UnknownKey { key, .. }
            | ConfigError::Missing { key, .. }
            | ConfigError::Invalid { key, .. } => key,
        }
    }
}

struct Suggestion<'a>(&'a Option<&'static str>);
impl fmt::Display for Suggestion<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(s) => write!(f, " (did you mean `{s}`?)"),
            None => Ok(()),
        }
    }
}

struct Within<'a>(&'a Option<&'static str>);
impl fmt::Display for Within<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(s) => write!(f, " in {s}"),
            None => Ok(()),
        }
    }
}

/// All the problems found in one net-conf.json, in document order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len();
        write!(
            f,
            "net-conf.json has {n} problem{}:",
            if n == 1 { "" } else { "s" }
        )?;
        // A file of junk has a problem per key: the first ones say enough.
        const SHOWN: usize = 10;
        for e in self.0.iter().take(SHOWN) {
            write!(f, "\n  - {e}")?;
        }
        if n > SHOWN {
            write!(f, "\n  - and {} more", n - SHOWN)?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}
