//! A fresh network namespace per test: a dedicated thread calls `unshare(CLONE_NEWNET)`,
//! brings `lo` up, and drives the test's future on a current-thread runtime, so every
//! netlink socket and every child process it opens lives in that namespace. The namespace
//! disappears with the thread. The host namespace is never touched.

use std::future::Future;
use std::io::{self, Read, Write};
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

/// `GET path` on `addr` from inside namespace `ns`: (status code, body).
pub fn http_get(ns: &str, addr: &str, path: &str) -> (u16, String) {
    let (addr, path) = (addr.to_string(), path.to_string());
    let result = in_named_netns(ns, move || -> io::Result<String> {
        let mut s = std::net::TcpStream::connect(&addr)?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    })
    .join();
    let text = match result {
        Ok(Ok(Ok(text))) => text,
        Ok(other) => return (0, format!("{other:?}")),
        Err(_) => return (0, "the HTTP thread panicked".into()),
    };
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    (code, body)
}
