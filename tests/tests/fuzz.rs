//! Every parser of outside data, fuzzed briefly on every test run (`weft-lab fuzz` runs a
//! million cases per parser; BENCHMARKS.md has the last run): no panic, bounded
//! allocation, errors that name what was bad without echoing it, and a 1 MB value refused
//! by its size. Also, that the fuzzer finds what it should: a parser that panics, echoes
//! its input or allocates without bound is reported.

use weft_lab::fuzz::alloc::{self, Counting};
use weft_lab::fuzz::{run, targets, Target, Verdict};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const CASES: u64 = 20_000;

/// The allocation counters are the process's: one test at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn every_parser_of_outside_data_survives_its_fuzz_cases() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = tempfile::tempdir().unwrap();
    assert!(alloc::counting(), "this test binary counts its allocations");
    let mut names = Vec::new();
    for target in targets() {
        match run(&target, CASES, 0x5eed, out.path()) {
            Ok(report) => {
                eprintln!("{report:?}");
                assert!(
                    report.refused < report.cases,
                    "{}: every case refused",
                    target.name
                );
                names.push(target.name);
            }
            Err(f) => panic!(
                "{}: {} (input: {:?})",
                f.target,
                f.problem,
                String::from_utf8_lossy(&std::fs::read(&f.input).unwrap_or_default())
                    .chars()
                    .take(400)
                    .collect::<String>()
            ),
        }
    }
    assert_eq!(
        names,
        [
            "net-conf",
            "etcd-lease",
            "node-annotations",
            "cni-stdin",
            "cni-env",
            "subnet-env",
            "uapi-answer",
            "psk-etcd",
            "psk-files",
            "rotation-state",
            "control-socket"
        ]
    );
}

fn planted(parse: fn(&[u8]) -> Verdict) -> Target {
    Target {
        name: "planted",
        words: &["field"],
        tokens: &["x"],
        seeds: || vec![b"field=1".to_vec()],
        oversized: || vec![b'a'; weft_lab::fuzz::OVERSIZED],
        parse: Box::new(parse),
    }
}

fn finds(parse: fn(&[u8]) -> Verdict) -> String {
    let out = tempfile::tempdir().unwrap();
    match run(&planted(parse), 5_000, 1, out.path()) {
        Ok(r) => panic!("the fuzzer found nothing: {r:?}"),
        Err(f) => {
            assert!(f.input.exists(), "the input is saved");
            f.problem
        }
    }
}

fn by_size(i: &[u8]) -> Option<Verdict> {
    (i.len() > 4096).then(|| Verdict::Refused(format!("field is {} bytes", i.len())))
}

#[test]
fn the_fuzzer_reports_panics_echoes_and_unbounded_allocation() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let panics = finds(|i| {
        by_size(i).unwrap_or_else(|| {
            assert!(!i.contains(&b'}'), "a planted panic");
            Verdict::Accepted
        })
    });
    assert!(panics.contains("panicked: a planted panic"), "{panics}");

    let echoes = finds(|i| {
        by_size(i).unwrap_or_else(|| match i.len() > 40 {
            true => Verdict::Refused(format!("field {:?}", String::from_utf8_lossy(i).repeat(40))),
            false => Verdict::Accepted,
        })
    });
    assert!(echoes.contains("it echoes its input"), "{echoes}");

    let allocates = finds(|i| {
        by_size(i).unwrap_or_else(|| {
            if i.contains(&b'{') {
                std::hint::black_box(vec![0u8; 64 << 20]);
            }
            Verdict::Accepted
        })
    });
    assert!(allocates.contains("allocated"), "{allocates}");

    let not_by_size = run(
        &planted(|_| Verdict::Refused("field bad".into())),
        10,
        1,
        tempfile::tempdir().unwrap().path(),
    )
    .unwrap_err();
    assert!(
        not_by_size.problem.contains("not by its size"),
        "{}",
        not_by_size.problem
    );
}

/// The coverage-guided corpus of the agent's parsers (`scripts/fuzz --only
/// agent_parsers`), replayed: every input judged as libFuzzer judged it.
#[test]
fn the_agent_parsers_corpus_replays_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/agent_parsers");
    let all = targets();
    let mut inputs = weft_lab::fuzz::picked_seeds(&all);
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.unwrap().path();
        inputs.push(std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    }
    assert!(inputs.len() > all.len() * 2, "only {} inputs", inputs.len());
    for input in &inputs {
        if let Err(problem) = weft_lab::fuzz::judge_picked(&all, input) {
            panic!("{problem} (input: {:?})", String::from_utf8_lossy(input));
        }
    }
}
