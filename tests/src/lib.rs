//! weft's lab: real parts on one machine for tests and the demo. Today: a real etcd and a
//! cuttable TCP proxy; the data-plane issue adds nodes in network namespaces.

pub mod etcd;
pub mod proxy;

pub use etcd::Etcd;
pub use proxy::CutProxy;
pub mod bench;
pub mod clock;
pub mod conformance;
pub mod demo;
pub mod faults;
pub mod fixtures;
pub mod freeze;
pub mod fuzz;
pub mod icmp;
pub mod kube_api;
pub mod lab;
pub mod live_demo;
pub mod netns;
pub mod pinger;
pub mod pki;
pub mod tcp;
pub mod tls_front;
pub mod traffic;
pub mod usage;
pub mod vm;
pub mod wait;

/// Runs `cmd` with `stdin` written to its standard input and its output captured (stdout
/// and stderr piped).
pub fn output_with_stdin(
    cmd: &mut std::process::Command,
    stdin: &[u8],
) -> std::io::Result<std::process::Output> {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let Some(mut pipe) = child.stdin.take() {
        pipe.write_all(stdin)?;
    }
    child.wait_with_output()
}
