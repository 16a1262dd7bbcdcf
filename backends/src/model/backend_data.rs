//! What can be wrong with a node's published `backend-data`, for every backend's decoder.

/// Why a node's published backend data cannot be used; the message names the field and
/// the value as published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendDataError {
    #[error("it is missing")]
    Missing,
    #[error("expected an object like {example}, got {got}")]
    NotAnObject { example: &'static str, got: String },
    #[error("it has no {0}")]
    NoField(&'static str),
    #[error("{field} is {got}, expected {expected}")]
    WrongType {
        field: &'static str,
        got: String,
        expected: &'static str,
    },
    /// Another node publishes the same value; `by` names it ("node x", "another node").
    #[error("{field} {} is also published by {by}", super::clip(value))]
    Duplicate {
        field: &'static str,
        value: String,
        by: String,
    },
    /// `value` as published (JSON).
    #[error("{field} {}: {source}", super::clip(value))]
    BadKey {
        field: &'static str,
        value: String,
        #[source]
        source: weft_crypto::KeyError,
    },
    /// `value` as published (JSON).
    #[error("{field} {} {problem}", super::clip(value))]
    BadValue {
        field: &'static str,
        value: String,
        problem: String,
    },
}

impl BackendDataError {
    /// `field` holds `value` (any JSON), which is wrong because of `problem`.
    pub fn bad(
        field: &'static str,
        value: impl std::fmt::Display,
        problem: impl Into<String>,
    ) -> Self {
        BackendDataError::BadValue {
            field,
            value: value.to_string(),
            problem: problem.into(),
        }
    }
}

/// The object in a node's published data, whose shape `example` shows.
pub fn object<'v>(
    value: Option<&'v serde_json::Value>,
    example: &'static str,
) -> Result<&'v serde_json::Map<String, serde_json::Value>, BackendDataError> {
    let value = value.ok_or(BackendDataError::Missing)?;
    value
        .as_object()
        .ok_or_else(|| BackendDataError::NotAnObject {
            example,
            got: value.to_string(),
        })
}

/// The `PublicKey` field of a published object (WireGuard's, ipsec's).
pub fn public_key(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> Result<weft_crypto::PublicKey, BackendDataError> {
    match obj.get("PublicKey") {
        Some(published @ serde_json::Value::String(s)) => {
            s.parse().map_err(|source| BackendDataError::BadKey {
                field: "PublicKey",
                value: published.to_string(),
                source,
            })
        }
        Some(other) => Err(BackendDataError::WrongType {
            field: "PublicKey",
            got: other.to_string(),
            expected: "a base64 string",
        }),
        None => Err(BackendDataError::NoField("PublicKey")),
    }
}
