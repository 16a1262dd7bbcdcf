//! The CNI error object (`{"cniVersion", "code", "msg", "details"}`) with the spec's
//! well-known codes, and a delegate's own error passed on.

use serde_json::{json, Value};

/// A CNI error: the spec's well-known codes, plus whatever a delegate returned.
#[derive(Debug, Clone, PartialEq)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub(crate) fn new(code: u32, msg: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }
    pub fn incompatible(msg: impl Into<String>) -> Self {
        Self::new(1, msg)
    }
    pub fn unknown_container(msg: impl Into<String>) -> Self {
        Self::new(3, msg)
    }
    pub fn env(msg: impl Into<String>) -> Self {
        Self::new(4, msg)
    }
    pub fn io(msg: impl Into<String>) -> Self {
        Self::new(5, msg)
    }
    pub fn decode(msg: impl Into<String>) -> Self {
        Self::new(6, msg)
    }
    pub fn config(msg: impl Into<String>) -> Self {
        Self::new(7, msg)
    }
    /// 11: the plugin cannot serve the request now; the runtime should retry.
    pub fn try_later(msg: impl Into<String>) -> Self {
        Self::new(11, msg)
    }
    /// 50 (STATUS): the plugin cannot serve ADD now.
    pub fn not_available(msg: impl Into<String>) -> Self {
        Self::new(50, msg)
    }

    /// The error a failed delegate printed, or one saying it printed none.
    pub fn from_plugin(plugin: &str, stdout: &[u8], status: Option<i32>) -> Self {
        let parsed: Option<Value> = serde_json::from_slice(stdout).ok();
        match parsed
            .as_ref()
            .and_then(|v| v.get("code"))
            .and_then(Value::as_u64)
        {
            Some(code) => {
                let field = |k: &str| {
                    parsed
                        .as_ref()
                        .and_then(|v| v.get(k))
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string()
                };
                CniError {
                    code: code as u32,
                    msg: field("msg"),
                    details: field("details"),
                }
            }
            None => CniError {
                code: 999,
                msg: format!(
                    "delegate plugin {plugin} failed (exit status {status:?}) without a CNI error"
                ),
                details: String::from_utf8_lossy(stdout).into_owned(),
            },
        }
    }

    pub fn to_json(&self, cni_version: &str) -> Value {
        let version = if cni_version.is_empty() {
            "1.0.0"
        } else {
            cni_version
        };
        let mut v = json!({"cniVersion": version, "code": self.code, "msg": self.msg});
        if !self.details.is_empty() {
            v["details"] = json!(self.details);
        }
        v
    }
}
