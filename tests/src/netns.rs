//! A fresh network namespace per test: a dedicated thread calls `unshare(CLONE_NEWNET)`,
//! brings `lo` up, and drives the test's future on a current-thread runtime, so every
//! netlink socket and every child process it opens lives in that namespace. The namespace
//! disappears with the thread. The host namespace is never touched.

use std::future::Future;
use std::io;
use std::process::Command;

/// Runs `f` in a new network namespace and returns its output; a panic inside is re-raised.
/// Fails (does not skip) without root, saying so.
pub fn in_new_netns<F, Fut, T>(f: F) -> T
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T>,
    T: Send + 'static,
{
    let thread = std::thread::spawn(move || {
        // SAFETY: unshare(2) changes only the calling thread's namespaces; no memory is shared.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert!(
            rc == 0,
            "unshare(CLONE_NEWNET) failed: {} — network-namespace tests must run as root",
            io::Error::last_os_error()
        );
        sh("ip link set lo up");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("building a runtime: {e}"));
        runtime.block_on(f())
    });
    match thread.join() {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Runs a shell command in the current thread's namespace; panics with its stderr if it
/// fails. Returns stdout.
pub fn sh(cmd: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .output()
        .unwrap_or_else(|e| panic!("running `{cmd}`: {e}"));
    assert!(
        out.status.success(),
        "`{cmd}` failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `sh` on the blocking pool, for commands that talk back to services running on this
/// thread's runtime (e.g. `wg show` against weft's own UAPI socket). The pool's threads are
/// started from this thread, so they are in the same network namespace.
pub async fn sh_async(cmd: &str) -> String {
    let cmd = cmd.to_string();
    match tokio::task::spawn_blocking(move || sh(&cmd)).await {
        Ok(out) => out,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Runs `f` on a new thread inside the named network namespace (`/run/netns/<name>`, as
/// made by `ip netns add`), e.g. one end of a TCP transfer inside a lab pod.
pub fn in_named_netns<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<io::Result<T>> {
    let path = format!("/run/netns/{name}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path)?;
        // SAFETY: setns(2) on a namespace file we hold open; affects only this thread.
        let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(f())
    })
}
