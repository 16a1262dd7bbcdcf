//! Stopping one thread of a process, and only that one: a packet loop that hangs while the
//! rest of its process (the UAPI socket, the timers) carries on. Through ptrace: a thread
//! of this process seizes the target thread and interrupts it, then waits on it until it
//! exits (its process ended) or the freeze is released (`thaw`), so nothing is left
//! traced or unreaped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub struct Frozen {
    release: Arc<AtomicBool>,
    tracer: JoinHandle<()>,
}

/// The thread of process `pid` whose name (`/proc/<pid>/task/<tid>/comm`) starts with
/// `name`.
pub fn thread_named(pid: u32, name: &str) -> Option<i32> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    tasks.flatten().find_map(|t| {
        let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
        comm.trim()
            .starts_with(name)
            .then(|| t.file_name().to_str()?.parse().ok())
            .flatten()
    })
}

/// Stops thread `tid` until the returned freeze is thawed or the thread exits.
pub fn freeze(tid: i32) -> anyhow::Result<Frozen> {
    let release = Arc::new(AtomicBool::new(false));
    let releasing = release.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let tracer = std::thread::spawn(move || {
        // SAFETY: ptrace(2) on a thread id, no data; every later call is from this thread,
        // the tracer.
        let seized = unsafe {
            libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0) == 0
                && libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0) == 0
        };
        let _ = ready_tx.send(if seized {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        });
        if !seized {
            return;
        }
        loop {
            let mut status = 0;
            // SAFETY: waitpid(2) on the traced thread, without blocking.
            let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG) };
            if r < 0 || (r == tid && (libc::WIFEXITED(status) || libc::WIFSIGNALED(status))) {
                return; // it ended with its process, and is reaped
            }
            // A stop (our interrupt, a signal for it) keeps it stopped until released.
            if releasing.load(Ordering::Relaxed) {
                // SAFETY: detaching resumes a thread in a ptrace stop; an error if gone.
                unsafe { libc::ptrace(libc::PTRACE_DETACH, tid, 0, 0) };
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    ready_rx
        .recv_timeout(Duration::from_secs(5))
        .map_err(|_| anyhow::anyhow!("the tracer did not start"))?
        .map_err(|e| anyhow::anyhow!("cannot stop thread {tid}: {e}"))?;
    Ok(Frozen { release, tracer })
}

impl Frozen {
    /// Lets the thread go on (or confirms it ended), and waits for the tracer.
    pub fn thaw(self) {
        self.release.store(true, Ordering::Relaxed);
        let _ = self.tracer.join();
    }
}
