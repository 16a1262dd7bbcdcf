//! Fuzzing every parser of outside data (`weft-lab fuzz`, `scripts/fuzz`): each target
//! takes bytes as the outside world would hand them to weft (a file, an etcd value, a
//! Node's annotations, a CNI invocation, a UAPI answer, a request on the control socket),
//! and each case is judged:
//! - no panic (caught, the input saved under the run's directory for a regression test);
//! - bounded allocation: the case's peak heap above the start is at most
//!   `ALLOC_PER_BYTE` times the input plus `ALLOC_SLACK` (checked where the binary counts
//!   allocations, as `weft-lab` does with `alloc::Counting`);
//! - an error names what was bad: it holds one of the target's field words, and it is
//!   short (`MAX_ERROR_CHARS` a line, 16 lines' worth in all): a 1 MB value is never
//!   echoed back;
//! - a value of 1 MB is refused by its size (one case per target, `oversized`).
//!
//! The cases are mutations of valid seeds (bit flips, interesting bytes, the target's own
//! tokens, cuts, repeats, splices), from a seeded generator: a run is reproducible from
//! its seed. No coverage feedback: stable Rust, no nightly toolchain for cargo-fuzz here.

pub mod alloc;
mod mutate;
mod targets;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

pub use mutate::Rng;
pub use targets::{all as targets, Target};

/// At most this many heap bytes per input byte, above `ALLOC_SLACK`.
pub const ALLOC_PER_BYTE: usize = 64;
pub const ALLOC_SLACK: usize = 4 << 20;
/// An error line longer than this echoes too much of its input.
pub const MAX_ERROR_CHARS: usize = 1024;
/// The oversized value every target refuses by size.
pub const OVERSIZED: usize = 1 << 20;

/// What a target's parser made of one input.
pub enum Verdict {
    Accepted,
    /// Refused, with the error as an operator would read it.
    Refused(String),
}

/// One target's run.
#[derive(Debug)]
pub struct Report {
    pub target: &'static str,
    pub cases: u64,
    pub refused: u64,
    pub elapsed: Duration,
    /// The largest per-case heap peak seen (bytes), if allocations are counted.
    pub peak_alloc: Option<usize>,
}

/// A finding: what went wrong, and the saved input.
#[derive(Debug)]
pub struct Finding {
    pub target: &'static str,
    pub problem: String,
    pub input: PathBuf,
}

/// Runs `cases` cases of `target` from `seed`; the first finding ends the run.
pub fn run(target: &Target, cases: u64, seed: u64, out: &Path) -> Result<Report, Finding> {
    let started = Instant::now();
    let mut rng = Rng::new(seed ^ fnv(target.name));
    let mut refused = 0;
    let mut peak_alloc = alloc::counting().then_some(0);
    let oversized = (target.oversized)();
    let judge = |input: &[u8], must_refuse: bool| -> Result<(bool, usize), String> {
        let before = alloc::reset_peak();
        let verdict = catch_unwind(AssertUnwindSafe(|| (target.parse)(input)));
        let peak = alloc::peak().saturating_sub(before);
        let verdict = verdict.map_err(|p| format!("panicked: {}", panic_text(&p)))?;
        let limit = input.len() * ALLOC_PER_BYTE + ALLOC_SLACK;
        if alloc::counting() && peak > limit {
            return Err(format!(
                "allocated {peak} bytes at peak for a {}-byte input (limit {limit})",
                input.len()
            ));
        }
        match verdict {
            Verdict::Accepted if must_refuse => Err(format!(
                "accepted a {}-byte input: a 1 MB value must be refused by size",
                input.len()
            )),
            Verdict::Accepted => Ok((false, peak)),
            Verdict::Refused(e) => {
                check_error(target, &e, must_refuse)?;
                Ok((true, peak))
            }
        }
    };
    let mut case = |input: &[u8], must_refuse: bool| -> Result<(), Finding> {
        match judge(input, must_refuse) {
            Ok((was_refused, peak)) => {
                refused += u64::from(was_refused);
                if let Some(p) = peak_alloc.as_mut() {
                    *p = (*p).max(peak);
                }
                Ok(())
            }
            Err(problem) => Err(Finding {
                target: target.name,
                problem,
                input: save(out, target.name, input),
            }),
        }
    };
    case(&oversized, true)?;
    let seeds = (target.seeds)();
    for s in &seeds {
        case(s, false)?;
    }
    let mut input = Vec::new();
    for _ in 0..cases {
        mutate::next_case(&mut rng, &seeds, target.tokens, &mut input);
        case(&input, false)?;
    }
    Ok(Report {
        target: target.name,
        cases: cases + seeds.len() as u64 + 1,
        refused,
        elapsed: started.elapsed(),
        peak_alloc,
    })
}

/// One input of the coverage-guided fuzzer (`fuzz/fuzz_targets/agent_parsers.rs`) or of
/// its corpus replay: the first byte picks the target (modulo their number), the rest is
/// the target's input. An error must name its field and stay short, as in `run`; a panic
/// is left to propagate, for libFuzzer to catch and save. Empty input: nothing to do.
pub fn judge_picked(targets: &[Target], data: &[u8]) -> Result<(), String> {
    let Some((&pick, input)) = data.split_first() else {
        return Ok(());
    };
    let Some(target) = targets.get(usize::from(pick) % targets.len().max(1)) else {
        return Ok(());
    };
    match (target.parse)(input) {
        Verdict::Accepted => Ok(()),
        Verdict::Refused(e) => {
            check_error(target, &e, false).map_err(|problem| format!("{}: {problem}", target.name))
        }
    }
}

/// The seeds of every target as inputs of `judge_picked` (its index byte first): the
/// starting corpus of the coverage-guided run.
pub fn picked_seeds(targets: &[Target]) -> Vec<Vec<u8>> {
    let mut all = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        let Ok(pick) = u8::try_from(i) else { break };
        for seed in (t.seeds)() {
            let mut input = vec![pick];
            input.extend_from_slice(&seed);
            all.push(input);
        }
    }
    all
}

fn check_error(target: &Target, e: &str, oversized: bool) -> Result<(), String> {
    let shown: String = e.chars().take(300).collect();
    // A message may list several problems, a line each (net-conf.json's do).
    let longest = e.lines().map(|l| l.chars().count()).max().unwrap_or(0);
    if longest > MAX_ERROR_CHARS || e.len() > MAX_ERROR_CHARS * 16 {
        return Err(format!(
            "an error of {} characters, {longest} in one line (it echoes its input): {shown}…",
            e.chars().count()
        ));
    }
    if !target.words.iter().any(|w| e.contains(w)) {
        return Err(format!(
            "the error names none of {:?}: {shown}",
            target.words
        ));
    }
    let lower = e.to_lowercase();
    if oversized
        && !["bytes", "too large", "too long", "size"]
            .iter()
            .any(|w| lower.contains(w))
    {
        return Err(format!(
            "a 1 MB value refused, but not by its size: {shown}"
        ));
    }
    Ok(())
}

fn write_seeds(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let seeds = picked_seeds(&targets());
    for input in &seeds {
        let path = dir.join(format!("seed-{:016x}", fnv_bytes(input)));
        std::fs::write(&path, input).with_context(|| format!("writing {}", path.display()))?;
    }
    println!("fuzz: {} seeds written to {}", seeds.len(), dir.display());
    Ok(())
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic".into())
}

fn save(out: &Path, target: &str, input: &[u8]) -> PathBuf {
    let path = out.join(format!("{target}-{:016x}", fnv_bytes(input)));
    if let Err(e) = std::fs::create_dir_all(out).and_then(|()| std::fs::write(&path, input)) {
        eprintln!("saving the input to {}: {e}", path.display());
    }
    path
}

fn fnv(s: &str) -> u64 {
    fnv_bytes(s.as_bytes())
}

fn fnv_bytes(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

/// `weft-lab fuzz [--cases N] [--seed S] [--target NAME,…] [--out DIR]`: every target (or
/// the named ones), a line per target; fails at the first finding.
/// `weft-lab fuzz --write-seeds DIR`: writes `picked_seeds` into DIR (the coverage-guided
/// target's starting corpus) and does nothing else.
pub fn command(args: &[String]) -> anyhow::Result<()> {
    if let [flag, dir] = args {
        if flag == "--write-seeds" {
            return write_seeds(Path::new(dir));
        }
    }
    let mut cases = 1_000_000u64;
    let mut seed = 1u64;
    let mut only: Vec<String> = Vec::new();
    let mut out = PathBuf::from("target/fuzz-findings");
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--cases" => cases = value.parse().context("--cases")?,
            "--seed" => seed = value.parse().context("--seed")?,
            "--target" => only = value.split(',').map(str::to_string).collect(),
            "--out" => out = value.into(),
            other => bail!(
                "unknown option {other}; the options: --cases N, --seed S, --target NAME,…, --out DIR"
            ),
        }
    }
    let chosen: Vec<Target> = targets()
        .into_iter()
        .filter(|t| only.is_empty() || only.iter().any(|o| o == t.name))
        .collect();
    if chosen.is_empty() {
        bail!(
            "no such target; the targets: {:?}",
            targets().iter().map(|t| t.name).collect::<Vec<_>>()
        );
    }
    println!(
        "fuzz: {cases} cases per target, seed {seed}, allocations counted: {}",
        alloc::counting()
    );
    for t in &chosen {
        match run(t, cases, seed, &out) {
            Ok(r) => println!(
                "{:<16} {:>9} cases  {:>5.1}% refused  {:>6.1} s  peak {}",
                r.target,
                r.cases,
                100.0 * r.refused as f64 / r.cases as f64,
                r.elapsed.as_secs_f64(),
                r.peak_alloc
                    .map_or("-".into(), |p| format!("{} KiB", p / 1024)),
            ),
            Err(f) => bail!(
                "{}: {} (input saved in {})",
                f.target,
                f.problem,
                f.input.display()
            ),
        }
    }
    Ok(())
}
