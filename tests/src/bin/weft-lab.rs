//! `weft-lab`: the lab's command.
//! - `weft-lab demo [wireguard|vxlan|host-gw] [--plan-only]`: the README's demo.
//! - `weft-lab tcp-sink PORT` / `weft-lab tcp-source HOST:PORT BYTES`: the lab's TCP
//!   transfer tool (byte count and SHA-256 at both ends).
//! - `weft-lab bench control-plane [--registry etcd|kube] [--nodes 100,1000,5000] [--churn-secs 10] [--rate 50] [--runs 1] [--check]`
//!   `weft-lab bench data-plane [--runs 3] [--bytes N] [--only-wireguard] [--baseline WEFT] [--wireguard-go BIN] [--kernel | --vm]`, `weft-lab bench flood [--runs 3]`, `weft-lab bench path-mtu
//!   [--runs 3]`, `weft-lab bench liveness [--runs 3]` and `weft-lab bench rotation
//!   [--runs 5]` and `weft-lab bench soak [--minutes 30] [--nodes 1000] [--rate 50]`: the
//!   benchmarks of BENCHMARKS.md.
//! - `weft-lab fuzz [--cases N] [--seed S] [--target NAME,…]`: every parser of outside data
//!   fuzzed (`weft_lab::fuzz`), with allocations counted.
//! - `weft-lab vm SCRIPT`: runs a `sh` script as root in the VM (a Debian kernel with
//!   WireGuard, this machine's root read-only); prints its output, exits with its status.

use std::process::ExitCode;

/// Counted, for the fuzzer's allocation bound; a pass-through to the system allocator.
#[global_allocator]
static ALLOCATOR: weft_lab::fuzz::alloc::Counting = weft_lab::fuzz::alloc::Counting;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `--help` anywhere: the verb's usage and nothing else; an unknown flag: named.
    match weft_lab::usage::check(&args) {
        Ok(Some(usage)) => {
            println!("{usage}");
            return ExitCode::SUCCESS;
        }
        Ok(None) => {}
        Err(why) => {
            eprintln!("weft-lab: {why}");
            return ExitCode::from(2);
        }
    }
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or_default();
    let result = match arg(0) {
        "demo" => tokio::runtime::Runtime::new()
            .map_err(anyhow::Error::from)
            .and_then(|rt| {
                let backend = args[1..]
                    .iter()
                    .find(|a| !a.starts_with("--"))
                    .map_or("wireguard", String::as_str);
                rt.block_on(weft_lab::demo::run(
                    args.iter().any(|a| a == "--plan-only"),
                    backend,
                ))
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
        "bench" => bench(&args[1..]),
        "fuzz" => weft_lab::fuzz::command(&args[1..]),
        "vm" => match vm(arg(1)) {
            Ok(code) => return ExitCode::from(code),
            Err(e) => Err(e),
        },
        _ => {
            eprintln!("{}", weft_lab::usage::all());
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

fn vm(script: &str) -> anyhow::Result<u8> {
    let vm = weft_lab::vm::Vm::prepare()?;
    let run = vm.run(script, std::time::Duration::from_secs(3600))?;
    print!("{}", run.log);
    eprintln!(
        "weft-lab: {} ({}) ran {:.1?}, status {:?}",
        vm.package, vm.accel, run.elapsed, run.status
    );
    Ok(run.status.and_then(|s| u8::try_from(s).ok()).unwrap_or(1))
}

/// `bench data-plane --kernel` inside the VM runner's kernel (WireGuard and ESP), with
/// this build's binaries; prints the VM's table.
fn data_plane_in_vm(runs: &str, bytes: &str) -> anyhow::Result<()> {
    let me = std::env::current_exe()?;
    let mut vm = weft_lab::vm::Vm::prepare()?;
    // The target directory, wherever it lives, is visible inside the VM.
    if let Some(dir) = me.ancestors().nth(2) {
        vm.keep.push(dir.to_path_buf());
    }
    let script = format!(
        "cd /tmp && env WEFT_LAB_IMPLEMENTATION=kernel {} bench data-plane --kernel --runs {runs} --bytes {bytes}\n",
        me.display()
    );
    let run = vm.run(&script, std::time::Duration::from_secs(3600))?;
    let table: Vec<&str> = run.log.lines().filter(|l| l.starts_with('|')).collect();
    if run.status != Some(0) || table.is_empty() {
        anyhow::bail!("the benchmark failed inside the VM:\n{}", run.log);
    }
    println!("{}", table.join("\n"));
    eprintln!(
        "weft-lab: {} ({}) ran {:.1?}",
        vm.package, vm.accel, run.elapsed
    );
    Ok(())
}

/// The value after `--name` in `args`.
fn opt<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).map(String::as_str)
}

fn bench(args: &[String]) -> anyhow::Result<()> {
    use anyhow::Context;
    use weft_lab::bench::control_plane::Registry;
    let weft = std::env::current_exe()?.with_file_name("weft");
    match args.first().map(String::as_str) {
        Some("control-plane") => {
            let nodes: Vec<usize> = opt(args, "--nodes")
                .unwrap_or("100,1000,5000")
                .split(',')
                .map(|n| n.trim().parse().context("--nodes: a list like 100,1000"))
                .collect::<anyhow::Result<_>>()?;
            let churn: f64 = opt(args, "--churn-secs").unwrap_or("10").parse()?;
            let rate: f64 = opt(args, "--rate").unwrap_or("50").parse()?;
            let registry = match opt(args, "--registry").unwrap_or("etcd") {
                "etcd" => Registry::Etcd,
                "kube" => Registry::Kube,
                other => anyhow::bail!("--registry: etcd or kube, not {other:?}"),
            };
            let runs: usize = opt(args, "--runs").unwrap_or("1").parse()?;
            use weft_lab::bench::control_targets as targets;
            let mut results = Vec::new();
            for n in nodes {
                let mut of_size = Vec::new();
                for run in 1..=runs {
                    eprintln!(
                        "control plane ({}): {n} nodes, run {run} of {runs}...",
                        registry.name()
                    );
                    of_size.push(weft_lab::bench::control_plane::run(
                        &weft,
                        registry,
                        n,
                        std::time::Duration::from_secs_f64(churn),
                        rate,
                    )?);
                }
                results.extend(targets::summarize(&of_size));
            }
            print!("{}", targets::report(&results));
            if args.iter().any(|a| a == "--check") {
                let missed = targets::check(&results);
                for m in &missed {
                    eprintln!("weft-lab: target missed: {m}");
                }
                anyhow::ensure!(missed.is_empty(), "{} target(s) missed", missed.len());
                eprintln!("weft-lab: every target met");
            }
            Ok(())
        }
        Some("data-plane") if args.iter().any(|a| a == "--vm") => {
            let runs = opt(args, "--runs").unwrap_or("3");
            let bytes = opt(args, "--bytes").unwrap_or("67108864");
            data_plane_in_vm(runs, bytes)
        }
        Some("data-plane") => {
            let runs: usize = opt(args, "--runs").unwrap_or("3").parse()?;
            let bytes: u64 = opt(args, "--bytes").unwrap_or("268435456").parse()?;
            let table = if args.iter().any(|a| a == "--kernel") {
                weft_lab::bench::data_plane::run_kernel(&weft, runs, bytes)?
            } else {
                let baseline = opt(args, "--baseline").map(std::path::PathBuf::from);
                if let Some(b) = &baseline {
                    anyhow::ensure!(
                        b.is_file(),
                        "--baseline: {} is not a weft binary",
                        b.display()
                    );
                }
                let opts = weft_lab::bench::data_plane::Options {
                    runs,
                    bytes,
                    baseline,
                    only_wireguard: args.iter().any(|a| a == "--only-wireguard"),
                    wireguard_go: opt(args, "--wireguard-go").map(std::path::PathBuf::from),
                };
                weft_lab::bench::data_plane::run(&weft, &opts)?
            };
            print!("{table}");
            Ok(())
        }
        Some("flood") => {
            let runs: usize = opt(args, "--runs").unwrap_or("3").parse()?;
            print!("{}", weft_lab::bench::flood::run(&weft, runs)?);
            Ok(())
        }
        Some("path-mtu") => {
            let runs: usize = opt(args, "--runs").unwrap_or("3").parse()?;
            print!("{}", weft_lab::bench::path_mtu::run(&weft, runs)?);
            Ok(())
        }
        Some("liveness") => {
            let runs: usize = opt(args, "--runs").unwrap_or("3").parse()?;
            print!("{}", weft_lab::bench::liveness::run(&weft, runs)?);
            Ok(())
        }
        Some("post-quantum") => {
            let rounds: usize = opt(args, "--rounds").unwrap_or("200").parse()?;
            let peers: usize = opt(args, "--peers").unwrap_or("1000").parse()?;
            print!("{}", weft_lab::bench::post_quantum::run(rounds, peers)?);
            // The agent's own task with that many peers, for a few (shortened) periods.
            let periods: u32 = opt(args, "--agent-periods").unwrap_or("3").parse()?;
            let period: u64 = opt(args, "--period").unwrap_or("20").parse()?;
            if periods > 0 {
                let period = std::time::Duration::from_secs(period);
                print!(
                    "{}",
                    weft_lab::bench::post_quantum_agent::run(peers, period, periods)?
                );
            }
            Ok(())
        }
        Some("relay") => {
            let runs: usize = opt(args, "--runs").unwrap_or("3").parse()?;
            let nodes: usize = opt(args, "--nodes").unwrap_or("1000").parse()?;
            let zones: usize = opt(args, "--zones").unwrap_or("10").parse()?;
            print!(
                "{}",
                weft_lab::bench::relay::run(&weft, runs, nodes, zones)?
            );
            Ok(())
        }
        Some("rollout") => {
            let runs: usize = opt(args, "--runs").unwrap_or("3").parse()?;
            let pace: u64 = opt(args, "--pace").unwrap_or("8").parse()?;
            let baseline = opt(args, "--baseline").map(std::path::PathBuf::from);
            print!(
                "{}",
                weft_lab::bench::rollout::run(
                    &weft,
                    baseline.as_deref(),
                    runs,
                    std::time::Duration::from_secs(pace)
                )?
            );
            Ok(())
        }
        Some("rotation") => {
            let runs: usize = opt(args, "--runs").unwrap_or("5").parse()?;
            print!("{}", weft_lab::bench::rotation::run(&weft, runs)?);
            Ok(())
        }
        Some("soak") => {
            let minutes: u64 = opt(args, "--minutes").unwrap_or("30").parse()?;
            let nodes: usize = opt(args, "--nodes").unwrap_or("1000").parse()?;
            let rate: f64 = opt(args, "--rate").unwrap_or("50").parse()?;
            print!(
                "{}",
                weft_lab::bench::soak::run(&weft, nodes, minutes, rate)?
            );
            Ok(())
        }
        _ => {
            anyhow::bail!(
                "usage: weft-lab bench control-plane|data-plane|flood|liveness|path-mtu|post-quantum|relay|rollout|rotation|soak [options]"
            )
        }
    }
}
