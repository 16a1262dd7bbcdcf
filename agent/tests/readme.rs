//! The README's commands, as a reader copies them: every `sh` block's command lines are
//! checked for what they name. The two set-up scripts exist and parse (`bash -n`); each
//! `weft …` line parses as the agent's own command line; `kubectl apply -f|-k` and
//! `docker build -f` name files that exist; the etcd-mode example's config passes `weft
//! config check`. A line the test cannot check is counted, not passed silently: the four
//! the issue names (set-up, Kubernetes install, etcd mode) must all be among the checked.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use weft::cli::Cli;

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Splits a shell line into words: whitespace, with single- and double-quoted parts kept.
fn words(line: &str) -> Vec<String> {
    let (mut out, mut cur, mut quote, mut any) = (Vec::new(), String::new(), None, false);
    for c in line.chars() {
        match (quote, c) {
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (Some(q), c) if c == q => quote = None,
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            (_, c) => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// The command lines of every ```sh block: continuation lines joined, comments and `$ `
/// prompts taken off, output lines (after a prompt) left out.
fn commands(readme: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_block = false;
    let mut prompted = false;
    let mut pending = String::new();
    for raw in readme.lines() {
        let line = raw.trim();
        if line.starts_with("```") {
            in_block = line == "```sh" && !in_block;
            prompted = false;
            continue;
        }
        if !in_block {
            continue;
        }
        let line = match line.strip_prefix("$ ") {
            Some(l) => {
                prompted = true;
                l
            }
            None if prompted => continue,
            None => line,
        };
        let line = line.split(" # ").next().unwrap_or_default().trim_end();
        match line.strip_suffix('\\') {
            Some(head) => pending += head,
            None => {
                pending += line;
                if !pending.trim().is_empty() {
                    out.push(std::mem::take(&mut pending).trim().to_string());
                }
                pending.clear();
            }
        }
    }
    out
}

#[test]
fn the_readmes_commands_exist_and_parse() {
    let readme = std::fs::read_to_string(workspace().join("README.md")).unwrap();
    let lines = commands(&readme);
    let mut checked = Vec::new();
    let mut unchecked = Vec::new();
    for line in &lines {
        let w = words(line);
        let w: Vec<&str> = w.iter().map(String::as_str).collect();
        match w.as_slice() {
            [script] if script.starts_with("scripts/") => {
                let path = workspace().join(script);
                let ok = Command::new("bash").arg("-n").arg(&path).status().unwrap();
                assert!(ok.success(), "{script} does not parse");
                checked.push(line.clone());
            }
            ["weft", ..] => {
                if let Err(e) = Cli::try_parse_from(&w) {
                    panic!("README: `{line}` does not parse: {e}");
                }
                checked.push(line.clone());
            }
            ["kubectl", "apply", flag @ ("-f" | "-k"), path] => {
                let p = workspace().join(path);
                assert!(
                    p.exists(),
                    "README: `{line}` names {} which does not exist",
                    p.display()
                );
                if *flag == "-k" {
                    assert!(
                        p.join("Kustomization").exists() || p.join("kustomization.yaml").exists(),
                        "{line}"
                    );
                }
                checked.push(line.clone());
            }
            ["docker", "build", "-f", file, ..] => {
                assert!(workspace().join(file).is_file(), "README: `{line}`");
                checked.push(line.clone());
            }
            ["etcdctl", "put", key, value] if key.ends_with("/config") => {
                let dir = tempfile::tempdir().unwrap();
                let conf = dir.path().join("net-conf.json");
                std::fs::write(&conf, value).unwrap();
                let out = Command::new(WEFT)
                    .args(["config", "check"])
                    .arg(&conf)
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "README: `{line}`: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                checked.push(line.clone());
            }
            _ => unchecked.push(line.clone()),
        }
    }
    for needed in [
        "scripts/demo",
        "scripts/test",
        "kubectl apply -f deploy/kubernetes/",
        "etcdctl put /coreos.com/network/config",
        "weft agent --etcd-endpoints=http://127.0.0.1:2379",
    ] {
        assert!(
            checked.iter().any(|c| c.starts_with(needed)),
            "the README has no checked command starting `{needed}`; checked: {checked:#?}"
        );
    }
    println!(
        "README: {} commands checked, {} not checkable here: {unchecked:#?}",
        checked.len(),
        unchecked.len()
    );
}

#[test]
fn the_words_of_a_line_keep_their_quotes_together() {
    assert_eq!(
        words(r#"etcdctl put /a '{"N": "x y"}'"#),
        ["etcdctl", "put", "/a", r#"{"N": "x y"}"#]
    );
    let readme = "```sh\nweft agent --a \\\n  --b   # c\n$ weft config check x\n{\n```\n";
    assert_eq!(
        commands(readme),
        ["weft agent --a --b", "weft config check x"]
    );
}
