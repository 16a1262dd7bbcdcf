//! `--help` and `-h` everywhere a user types them: every `weft` subcommand (and theirs),
//! every `weft-lab` verb and every `scripts/*` prints its usage and exits 0 at once, doing
//! nothing else (a demo or an install that started would take seconds, and print other
//! things); a flag they do not take is an error that names it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const WEFT_LAB: &str = env!("CARGO_BIN_EXE_weft-lab");

/// The `weft` binary built beside this test (target/<profile>/weft).
fn weft() -> PathBuf {
    let me = std::env::current_exe().expect("the test's path");
    let dir = me
        .parent()
        .and_then(Path::parent)
        .expect("the target directory");
    let weft = dir.join("weft");
    assert!(
        weft.exists(),
        "{} is not built (cargo build -p weft)",
        weft.display()
    );
    weft
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// Runs `program args`: its output, failing if it took longer than a usage takes.
fn run(program: &Path, args: &[&str]) -> Output {
    let started = Instant::now();
    let out = Command::new(program)
        .args(args)
        .current_dir(workspace())
        .output()
        .unwrap_or_else(|e| panic!("running {} {args:?}: {e}", program.display()));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{} {args:?} took {:?}: it did more than print its usage",
        program.display(),
        started.elapsed()
    );
    out
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The subcommands a clap help text lists under "Commands:" (but `help`).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(String::from)
        .collect()
}

#[test]
fn every_weft_subcommand_prints_its_usage_for_help_and_names_an_unknown_flag() {
    let weft = weft();
    let top = text(&run(&weft, &["--help"]).stdout);
    let mut commands: Vec<Vec<String>> = subcommands(&top).into_iter().map(|c| vec![c]).collect();
    assert!(commands.len() >= 7, "{top}");
    let mut i = 0;
    while i < commands.len() {
        let path = commands[i].clone();
        for flag in ["--help", "-h"] {
            let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
            args.push(flag);
            let out = run(&weft, &args);
            let usage = text(&out.stdout);
            assert!(
                out.status.success(),
                "weft {args:?}: {:?}\n{}",
                out.status,
                text(&out.stderr)
            );
            assert!(usage.contains("Usage: weft"), "weft {args:?}:\n{usage}");
            if flag == "--help" && path.len() == 1 {
                commands.extend(
                    subcommands(&usage)
                        .into_iter()
                        .map(|c| vec![path[0].clone(), c]),
                );
            }
        }
        let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
        args.push("--no-such-flag");
        let out = run(&weft, &args);
        assert!(!out.status.success(), "weft {args:?} succeeded");
        assert!(
            text(&out.stderr).contains("--no-such-flag"),
            "weft {args:?}: {}",
            text(&out.stderr)
        );
        i += 1;
    }
}

#[test]
fn every_weft_lab_verb_prints_its_usage_for_help_and_names_an_unknown_flag() {
    let lab = Path::new(WEFT_LAB);
    let verbs = [
        "demo",
        "tcp-sink",
        "tcp-source",
        "fuzz",
        "vm",
        "bench",
        "bench control-plane",
        "bench data-plane",
        "bench flood",
        "bench path-mtu",
        "bench liveness",
        "bench post-quantum",
        "bench relay",
        "bench rotation",
        "bench soak",
    ];
    for verb in verbs {
        for flag in ["--help", "-h"] {
            let mut args: Vec<&str> = verb.split(' ').collect();
            args.push(flag);
            let out = run(lab, &args);
            assert!(
                out.status.success(),
                "weft-lab {args:?}: {}",
                text(&out.stderr)
            );
            assert!(
                text(&out.stdout).contains("usage"),
                "weft-lab {args:?}: {}",
                text(&out.stdout)
            );
        }
    }
    let out = run(lab, &["demo", "--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("unknown flag --no-such-flag"),
        "{}",
        text(&out.stderr)
    );
    let out = run(lab, &["bench", "relay", "--no-such-flag"]);
    assert!(
        text(&out.stderr).contains("--no-such-flag"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn every_script_prints_its_usage_for_help_and_refuses_what_it_does_not_take() {
    let dir = workspace().join("scripts");
    let mut scripts: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("scripts/")
        .flatten()
        .map(|e| e.path())
        .collect();
    scripts.sort();
    assert!(scripts.len() >= 7, "{scripts:?}");
    for script in &scripts {
        for flag in ["--help", "-h"] {
            let out = run(script, &[flag]);
            assert!(
                out.status.success(),
                "{} {flag}: {}",
                script.display(),
                text(&out.stderr)
            );
            let usage = text(&out.stdout);
            assert!(
                usage.lines().count() >= 2 && !usage.contains("#!"),
                "{} {flag}:\n{usage}",
                script.display()
            );
        }
    }
    for (script, arg) in [
        ("test", "--no-such-flag"),
        ("install-deps", "--no-such-flag"),
        ("image", "--no-such-flag"),
        ("fresh-check", "--no-such-flag"),
        ("fuzz", "--no-such-flag"),
    ] {
        let out = run(&dir.join(script), &[arg]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "scripts/{script} {arg}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(arg),
            "scripts/{script} {arg}: {}",
            text(&out.stderr)
        );
    }
}
