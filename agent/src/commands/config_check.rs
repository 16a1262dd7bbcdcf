//! `weft config check [PATH]`: the effective config on stdout, or one line per problem on
//! stderr and exit code 1.

use std::io::{self, Read, Write};
use std::path::Path;

use anyhow::Context;
use weft_backends::netconf;

/// Exit code for a config that parsed but is invalid.
pub const INVALID: i32 = 1;

pub fn run(path: &Path, out: &mut dyn Write, err: &mut dyn Write) -> anyhow::Result<i32> {
    let (text, shown) = if path == Path::new("-") {
        let mut text = String::new();
        io::stdin()
            .read_to_string(&mut text)
            .context("reading net-conf.json from standard input")?;
        (text, "standard input".to_string())
    } else {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading net-conf.json at {}", path.display()))?;
        (text, path.display().to_string())
    };
    match netconf::parse(&text) {
        Ok(conf) => {
            writeln!(out, "{conf}")?;
            Ok(0)
        }
        Err(errors) => {
            writeln!(err, "{shown}: {errors}")?;
            Ok(INVALID)
        }
    }
}
