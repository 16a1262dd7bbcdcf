//! `weft`: parse the command line once, run the subcommand, print errors as `anyhow`
//! chains (`{:#}`) and exit non-zero.

use std::io;
use std::process::ExitCode;

use weft::cli::{Cli, Command, ConfigCommand, KeysCommand};
use weft::commands;

fn main() -> ExitCode {
    // Before any TLS: the control plane's links run on aws-lc-rs (hybrid X25519MLKEM768).
    weft::registry::tls_link::provider();
    let cli = match Cli::parse_with_env(std::env::args_os(), &|k| std::env::var(k).ok()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let result = match cli.command {
        Command::Config {
            command: ConfigCommand::Check { path },
        } => commands::config_check::run(&path, &mut io::stdout(), &mut io::stderr()),
        Command::Keys {
            command: KeysCommand::Rotate(args),
        } => commands::rotate::run(&args, &mut io::stdout()),
        Command::Keys { command } => {
            commands::keys::run(&command, &mut io::stdin(), &mut io::stdout()).map(|()| 0)
        }
        Command::Agent(args) => weft::node::run(*args),
        Command::Status(args) => commands::status::run(&args, &mut io::stdout()),
        Command::Doctor(args) => commands::doctor::run(&args, &mut io::stdout()),
        Command::Cleanup(args) => commands::cleanup::run(&args, &mut io::stdout()),
        Command::InstallCni(args) => commands::install_cni::run(&args, &mut io::stdout()),
        Command::UserspaceDevice { device } => commands::userspace_device::run(&device),
    };
    match result {
        Ok(0) => ExitCode::SUCCESS,
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("weft: error: {}", weft::report::error_text(&e));
            ExitCode::from(1)
        }
    }
}
