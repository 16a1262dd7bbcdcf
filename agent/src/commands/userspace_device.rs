//! `weft userspace-device <dev>`: the process that runs one userspace WireGuard device.

use anyhow::Context;
use tracing::info;
use weft_backends::apply::wireguard::userspace::run_device;

pub fn run(device: &str) -> anyhow::Result<i32> {
    crate::node::init_tracing();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    info!(
        device,
        pid = std::process::id(),
        "userspace WireGuard device starting"
    );
    let why = runtime
        .block_on(run_device(device))
        .with_context(|| format!("running userspace WireGuard device {device}"))?;
    info!(device, why, "userspace WireGuard device stopped");
    Ok(0)
}
