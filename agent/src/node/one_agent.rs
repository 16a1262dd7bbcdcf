//! One agent per node: the agent holds an exclusive lock on `agent.lock` in its state
//! directory (`/var/lib/weft`, on the host in every deployment) for as long as it runs. A
//! second agent on the node stops before it touches anything (the key, the control socket,
//! the data plane), naming the one that runs. The lock goes with the process, however it
//! ends; the userspace device process does not inherit it.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another weft agent runs on this node ({holder}, holding {path}); one agent per node: stop it first")]
    Held { path: PathBuf, holder: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The lock, held until dropped (the agent keeps it for its whole run).
#[derive(Debug)]
pub struct AgentLock {
    _file: File,
}

/// Takes the node's agent lock in `dir` (created if missing), or says who holds it.
pub fn take(dir: &Path) -> Result<AgentLock, LockError> {
    let path = dir.join("agent.lock");
    let io = |source| LockError::Io {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    // The lock is held on a read-only descriptor: the agent keeps no file open for writing
    // in the state directory, which can then be remounted read-only under a running agent
    // (a filesystem's errors=remount-ro, an operator); the pid goes in through another,
    // closed at once.
    let write = || {
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)
    };
    drop(write()?);
    let mut file = File::open(&path).map_err(io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut pid = String::new();
            let _ = file.read_to_string(&mut pid);
            let holder = describe(pid.trim());
            return Err(LockError::Held { path, holder });
        }
        Err(TryLockError::Error(e)) => return Err(io(e)),
    }
    let mut pid = write()?;
    pid.set_len(0).map_err(io)?;
    writeln!(pid, "{}", std::process::id()).map_err(io)?;
    Ok(AgentLock { _file: file })
}

fn describe(pid: &str) -> String {
    let Ok(pid) = pid.parse::<u32>() else {
        return "its pid is not recorded".into();
    };
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let words: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|w| !w.is_empty())
        .take(4)
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    if words.is_empty() {
        format!("pid {pid}")
    } else {
        format!("pid {pid}: {:?}", words.join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_freed_when_the_first_goes() {
        let dir = tempfile::tempdir().unwrap();
        let first = take(dir.path()).unwrap();
        let err = take(dir.path()).unwrap_err().to_string();
        let me = std::process::id();
        assert!(
            err.starts_with(&format!("another weft agent runs on this node (pid {me}: "))
                && err.contains("agent.lock")
                && err.ends_with("one agent per node: stop it first"),
            "{err}"
        );
        drop(first);
        let again = take(dir.path()).unwrap();
        drop(again);
    }
}
