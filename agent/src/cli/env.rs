//! Environment fallbacks for the agent's flags: `WEFT_<NAME>`, then `FLANNELD_<NAME>`
//! (flannel's own convention), e.g. `--ip-masq` ← `WEFT_IP_MASQ` ← `FLANNELD_IP_MASQ`.
//!
//! clap's own `env` takes one variable per flag, so both are resolved here into the flag's
//! default value; a value on the command line still wins. The lookup is passed in so tests
//! do not touch the process environment.

use clap::Command;

/// `ip-masq` → `IP_MASQ`.
pub fn env_suffix(long: &str) -> String {
    long.to_ascii_uppercase().replace('-', "_")
}

/// Adds the environment fallbacks to every long flag of `command`.
pub fn with_env_fallbacks(command: Command, env: &dyn Fn(&str) -> Option<String>) -> Command {
    let longs: Vec<(clap::Id, String)> = command
        .get_arguments()
        .filter_map(|a| a.get_long().map(|l| (a.get_id().clone(), l.to_string())))
        .filter(|(_, long)| long != "help" && long != "version")
        .collect();
    longs.into_iter().fold(command, |command, (id, long)| {
        let suffix = env_suffix(&long);
        let weft = format!("WEFT_{suffix}");
        let flanneld = format!("FLANNELD_{suffix}");
        let found = env(&weft).or_else(|| env(&flanneld));
        command.mut_arg(id, |arg| {
            let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
            let arg = arg.help(format!("{help} [env: {weft}, {flanneld}]"));
            match found {
                Some(value) => arg.default_value(value),
                None => arg,
            }
        })
    })
}
