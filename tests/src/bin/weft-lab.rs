//! `weft-lab`: the lab's command. `weft-lab demo` runs the README's demo.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("demo") => {
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("weft-lab: starting the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(weft_lab::demo::run()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("weft-lab: demo failed: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        _ => {
            eprintln!("usage: weft-lab demo");
            ExitCode::from(2)
        }
    }
}
