//! An error and its causes as one line, as the CLI prints it and a rotation refusal says
//! it: each cause after a colon, unless the text before already holds it (many errors
//! here name their source in their own message, and `{:#}` then said it twice).

pub fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("{path}: {source}")]
    struct Named {
        path: String,
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn a_cause_already_in_the_message_is_said_once() {
        let io = std::io::Error::from_raw_os_error(28);
        let e = anyhow::Error::new(Named {
            path: "/var/lib/weft/agent.lock".into(),
            source: io,
        })
        .context("taking the agent lock");
        assert_eq!(
            super::error_text(&e),
            "taking the agent lock: /var/lib/weft/agent.lock: No space left on device (os error 28)"
        );
    }
}
