//! `weft-lab`: the lab's command.
//! - `weft-lab demo [--plan-only]`: the README's demo.
//! - `weft-lab tcp-sink PORT` / `weft-lab tcp-source HOST:PORT BYTES`: the lab's TCP
//!   transfer tool (byte count and SHA-256 at both ends).

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or_default();
    let result = match arg(0) {
        "demo" => tokio::runtime::Runtime::new()
            .map_err(anyhow::Error::from)
            .and_then(|rt| {
                rt.block_on(weft_lab::demo::run(args.iter().any(|a| a == "--plan-only")))
            }),
        "tcp-sink" => arg(1)
            .parse()
            .map_err(anyhow::Error::from)
            .and_then(weft_lab::tcp::sink)
            .map(|out| println!("{out}")),
        "tcp-source" => arg(2)
            .parse()
            .map_err(anyhow::Error::from)
            .and_then(|bytes| weft_lab::tcp::source(arg(1), bytes))
            .map(|out| println!("{out}")),
        _ => {
            eprintln!(
                "usage: weft-lab demo [--plan-only] | tcp-sink PORT | tcp-source HOST:PORT BYTES"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft-lab: {e:#}");
            ExitCode::FAILURE
        }
    }
}
