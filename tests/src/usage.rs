//! `weft-lab`'s usage, verb by verb: `--help`/`-h` anywhere prints the verb's usage and
//! nothing else runs; a flag the verb does not take is an error that names it.

/// A verb (or `bench` subverb): its usage line, and the flags it takes (those followed by
/// a value, then those alone).
struct Verb {
    path: &'static [&'static str],
    usage: &'static str,
    valued: &'static [&'static str],
    alone: &'static [&'static str],
}

const VERBS: &[Verb] = &[
    Verb { path: &["demo"], usage: "weft-lab demo [wireguard|vxlan|host-gw] [--plan-only]\n  The README's demo: a real etcd, three nodes acquiring leases, each node's plan.", valued: &[], alone: &["--plan-only"] },
    Verb { path: &["tcp-sink"], usage: "weft-lab tcp-sink PORT\n  Accepts one TCP connection, reads to EOF, prints the byte count and SHA-256.", valued: &[], alone: &[] },
    Verb { path: &["tcp-source"], usage: "weft-lab tcp-source HOST:PORT BYTES\n  Sends BYTES pseudo-random bytes, prints the byte count, SHA-256 and seconds.", valued: &[], alone: &[] },
    Verb { path: &["bench", "control-plane"], usage: "weft-lab bench control-plane [--nodes 100,1000,5000] [--churn-secs 10] [--rate 50] [--registry etcd|kube] [--runs 1] [--check]", valued: &["--nodes", "--churn-secs", "--rate", "--registry", "--runs"], alone: &["--check"] },
    Verb { path: &["bench", "data-plane"], usage: "weft-lab bench data-plane [--runs 3] [--bytes N] [--only-wireguard] [--baseline WEFT] [--wireguard-go BIN] [--kernel | --vm]", valued: &["--runs", "--bytes", "--baseline", "--wireguard-go"], alone: &["--only-wireguard", "--kernel", "--vm"] },
    Verb { path: &["bench", "flood"], usage: "weft-lab bench flood [--runs 3]", valued: &["--runs"], alone: &[] },
    Verb { path: &["bench", "path-mtu"], usage: "weft-lab bench path-mtu [--runs 3]", valued: &["--runs"], alone: &[] },
    Verb { path: &["bench", "liveness"], usage: "weft-lab bench liveness [--runs 3]", valued: &["--runs"], alone: &[] },
    Verb { path: &["bench", "post-quantum"], usage: "weft-lab bench post-quantum [--rounds 200] [--peers 1000] [--agent-periods 3] [--period 20]", valued: &["--rounds", "--peers", "--agent-periods", "--period"], alone: &[] },
    Verb { path: &["bench", "relay"], usage: "weft-lab bench relay [--runs 3] [--nodes 1000] [--zones 10]", valued: &["--runs", "--nodes", "--zones"], alone: &[] },
    Verb { path: &["bench", "rollout"], usage: "weft-lab bench rollout [--runs 3] [--pace 8] [--baseline WEFT]", valued: &["--runs", "--pace", "--baseline"], alone: &[] },
    Verb { path: &["bench", "rotation"], usage: "weft-lab bench rotation [--runs 5]", valued: &["--runs"], alone: &[] },
    Verb { path: &["bench", "soak"], usage: "weft-lab bench soak [--minutes 30] [--nodes 1000] [--rate 50]", valued: &["--minutes", "--nodes", "--rate"], alone: &[] },
    Verb { path: &["fuzz"], usage: "weft-lab fuzz [--cases N] [--seed S] [--target NAME,…] [--out DIR] [--write-seeds DIR]\n  Every parser of outside data fuzzed by a seeded mutator, with allocations counted.", valued: &["--cases", "--seed", "--target", "--out", "--write-seeds"], alone: &[] },
    Verb { path: &["vm"], usage: "weft-lab vm SCRIPT\n  Runs a sh script as root in the VM (a Debian kernel with WireGuard); exits with its status.", valued: &[], alone: &[] },
];

/// Every verb's usage: what `weft-lab` alone, or an unknown verb, prints.
pub fn all() -> String {
    let lines: Vec<&str> = VERBS
        .iter()
        .map(|v| v.usage.lines().next().unwrap_or_default())
        .collect();
    format!(
        "usage:\n  {}\n(`weft-lab VERB --help` for one)",
        lines.join("\n  ")
    )
}

/// What `args` (after the program name) ask before anything runs: `Ok(Some(usage))` for
/// `--help`/`-h`, `Err(why)` for an unknown verb or flag, `Ok(None)` to go on.
pub fn check(args: &[String]) -> Result<Option<String>, String> {
    let help = args.iter().any(|a| a == "--help" || a == "-h");
    let words: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .take_while(|a| !a.starts_with('-'))
        .collect();
    let verb = VERBS
        .iter()
        .filter(|v| words.len() >= v.path.len() && words[..v.path.len()] == *v.path)
        .max_by_key(|v| v.path.len());
    let Some(verb) = verb else {
        // `bench --help`, or `weft-lab --help`: the verbs under it.
        let under: Vec<&str> = VERBS
            .iter()
            .filter(|v| words.first().is_none_or(|w| v.path[0] == *w))
            .map(|v| v.usage.lines().next().unwrap_or_default())
            .collect();
        if help && !under.is_empty() {
            return Ok(Some(format!("usage:\n  {}", under.join("\n  "))));
        }
        return Err(format!("unknown verb {:?}\n{}", words.join(" "), all()));
    };
    if help {
        return Ok(Some(format!("usage: {}", verb.usage)));
    }
    let mut rest = args.iter().skip(verb.path.len());
    while let Some(a) = rest.next() {
        if verb.valued.contains(&a.as_str()) {
            if rest.next().is_none() {
                return Err(format!("{a} needs a value\nusage: {}", verb.usage));
            }
        } else if a.starts_with('-') && !verb.alone.contains(&a.as_str()) {
            return Err(format!(
                "unknown flag {a} for weft-lab {}\nusage: {}",
                verb.path.join(" "),
                verb.usage
            ));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn help_is_usage_and_an_unknown_flag_is_named() {
        assert!(check(&args("demo --help"))
            .unwrap()
            .unwrap()
            .contains("weft-lab demo"));
        assert!(check(&args("bench relay -h"))
            .unwrap()
            .unwrap()
            .contains("--zones"));
        assert!(check(&args("bench --help"))
            .unwrap()
            .unwrap()
            .contains("bench soak"));
        assert!(check(&args("--help"))
            .unwrap()
            .unwrap()
            .contains("weft-lab vm"));
        assert_eq!(check(&args("demo vxlan --plan-only")), Ok(None));
        assert_eq!(check(&args("bench relay --runs 1")), Ok(None));
        let e = check(&args("demo --bogus")).unwrap_err();
        assert!(e.contains("unknown flag --bogus"), "{e}");
        let e = check(&args("bench relay --runs")).unwrap_err();
        assert!(e.contains("--runs needs a value"), "{e}");
        assert!(check(&args("nonsense"))
            .unwrap_err()
            .contains("unknown verb"));
    }
}
