//! The operator's tools run on a lab node, as an operator would run them there.

use super::Lab;

impl Lab {
    /// `weft doctor` on node `i`, waiting `handshake_wait` seconds for handshakes: its exit
    /// code (-1 if it could not be read) and its report.
    pub fn doctor(&self, i: usize, handshake_wait: u32) -> (i32, String) {
        let script = format!(
            "{} doctor --handshake-wait={handshake_wait}; echo \"exit=$?\"",
            self.cfg.weft.display()
        );
        let out = self
            .on_node(i, &script)
            .unwrap_or_else(|e| format!("{e:#}"));
        let code = out
            .lines()
            .last()
            .and_then(|l| l.strip_prefix("exit="))
            .and_then(|c| c.parse().ok())
            .unwrap_or(-1);
        (code, out)
    }

    /// Whether node `i`'s `weft doctor` has a line with all of `words`; returns the report.
    pub fn doctor_says(&self, i: usize, words: &[&str]) -> (bool, String) {
        let (_, out) = self.doctor(i, 1);
        let found = out.lines().any(|l| words.iter().all(|w| l.contains(w)));
        (found, out)
    }
}
