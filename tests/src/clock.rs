//! A process whose wall clock is off: `tests/fixtures/clock_offset.c`, built with the
//! system's C compiler into the lab's directory and preloaded into one agent. The offset
//! (seconds) lives in a file the test rewrites to jump the clock while the agent runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

pub struct ClockOffset {
    pub library: PathBuf,
    pub file: PathBuf,
}

impl ClockOffset {
    /// Builds the library into `dir`, the offset starting at 0.
    pub fn build(dir: &Path) -> anyhow::Result<ClockOffset> {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/clock_offset.c");
        let library = dir.join("clock_offset.so");
        let out = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&library)
            .arg(&source)
            .arg("-ldl")
            .output()
            .context("running cc")?;
        if !out.status.success() {
            bail!(
                "building {}: {}",
                source.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let clock = ClockOffset {
            library,
            file: dir.join("clock_offset"),
        };
        clock.set(0)?;
        Ok(clock)
    }

    /// The environment that moves a process's clock by this offset.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), self.library.display().to_string()),
            (
                "WEFT_CLOCK_OFFSET_FILE".into(),
                self.file.display().to_string(),
            ),
        ]
    }

    /// Jumps the clock to `seconds` off the true time.
    pub fn set(&self, seconds: i64) -> anyhow::Result<()> {
        std::fs::write(&self.file, seconds.to_string())
            .with_context(|| format!("writing {}", self.file.display()))
    }
}
