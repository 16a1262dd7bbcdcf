//! The masquerade rule set in nftables (docs/architecture.md): tables `ip flannel-ipv4` and
//! `ip6 flannel-ipv6`, chains `postrtg` (nat, postrouting) and `forward` (filter). Read with
//! `nft -j list table`, compared rule by rule with what the plan wants, and, only if they
//! differ, replaced as one atomic `nft -j -f -` transaction. Tables of a family the plan no
//! longer wants are deleted; no other table is ever touched.

use std::collections::BTreeSet;
use std::future::Future;
use std::process::Stdio;

use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use super::ApplyError;
use crate::model::{Family, MasqueradeTable, Match, NatRule};

pub const TABLES: [(Family, &str); 2] = [
    (Family::Ipv4, "flannel-ipv4"),
    (Family::Ipv6, "flannel-ipv6"),
];
const POSTROUTING: &str = "postrtg";
const FORWARD: &str = "forward";

/// `nft` as the reconciler sees it; `NftCli` runs the real binary.
pub trait Nft {
    /// The table as `nft -j list table` prints it, or `None` if it does not exist.
    fn list(
        &mut self,
        family: Family,
        table: &str,
    ) -> impl Future<Output = Result<Option<Value>, ApplyError>>;
    /// Runs one JSON batch as one transaction.
    fn apply(&mut self, what: &str, batch: Value) -> impl Future<Output = Result<(), ApplyError>>;
    fn writes(&self) -> u64;
    /// A new round of listings begins (a pass, a check): what an implementation learnt in
    /// the last round about which tables exist is forgotten.
    fn new_round(&mut self) {}
}

#[derive(Debug, Default)]
pub struct NftCli {
    writes: u64,
    /// The tables that exist, (family, name), from one `nft -j list tables` per round: a
    /// table not among them is not listed on its own. Weft's five tables cost five `nft`
    /// runs a round otherwise (each about 0.15 s under the VM's emulation), most of them
    /// for tables that exist only on other backends or families. Forgotten at a new round
    /// and after every write.
    present: Option<BTreeSet<(String, String)>>,
}

impl NftCli {
    /// Whether `family table` may exist: false only if this round's `nft -j list tables`
    /// did not name it. A failure to list the tables is no answer (each table is listed).
    async fn may_exist(&mut self, family: Family, table: &str) -> bool {
        if self.present.is_none() {
            let out = run_nft(&["-j", "list", "tables"], None, "listing nftables tables").await;
            self.present = out
                .ok()
                .filter(|o| o.status.success())
                .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
                .map(|listing| table_names(&listing));
        }
        let key = (family.nft().to_string(), table.to_string());
        self.present.as_ref().is_none_or(|p| p.contains(&key))
    }
}

/// The (family, name) of every table in `nft -j list tables`'s output.
fn table_names(listing: &Value) -> BTreeSet<(String, String)> {
    let items = listing["nftables"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    items
        .iter()
        .filter_map(|item| {
            let table = item.get("table")?;
            let family = table["family"].as_str()?;
            Some((family.to_string(), table["name"].as_str()?.to_string()))
        })
        .collect()
}

async fn run_nft(
    args: &[&str],
    stdin: Option<String>,
    what: &str,
) -> Result<std::process::Output, ApplyError> {
    let io = |source| ApplyError::Io {
        op: format!("{what}: running nft"),
        source,
    };
    let mut child = tokio::process::Command::new("nft")
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io)?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).await.map_err(io)?;
    }
    child.wait_with_output().await.map_err(io)
}

impl Nft for NftCli {
    async fn list(&mut self, family: Family, table: &str) -> Result<Option<Value>, ApplyError> {
        if !self.may_exist(family, table).await {
            return Ok(None);
        }
        let what = format!("listing nftables table {} {table}", family.nft());
        let out = run_nft(&["-j", "list", "table", family.nft(), table], None, &what).await?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            if err.contains("No such file or directory") {
                return Ok(None);
            }
            return Err(ApplyError::Nft {
                op: what,
                detail: err.trim().to_string(),
            });
        }
        serde_json::from_slice(&out.stdout)
            .map(Some)
            .map_err(|e| ApplyError::Nft {
                op: what,
                detail: format!("unreadable output: {e}"),
            })
    }

    async fn apply(&mut self, what: &str, batch: Value) -> Result<(), ApplyError> {
        self.writes += 1;
        self.present = None;
        let out = run_nft(&["-j", "-f", "-"], Some(batch.to_string()), what).await?;
        if out.status.success() {
            Ok(())
        } else {
            Err(ApplyError::Nft {
                op: what.to_string(),
                detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            })
        }
    }

    fn writes(&self) -> u64 {
        self.writes
    }

    fn new_round(&mut self) {
        self.present = None;
    }
}

pub(super) fn addr_match(family: Family, field: &str, m: &Match) -> Value {
    let (op, net) = match m {
        Match::In(n) => ("==", n),
        Match::NotIn(n) => ("!=", n),
    };
    json!({"match": {"op": op, "left": {"payload": {"protocol": family.nft(), "field": field}},
                     "right": {"prefix": {"addr": net.network().to_string(), "len": net.prefix_len()}}}})
}

/// Rule expressions in the canonical form `nft -j list` prints them back, so an unchanged
/// rule compares equal.
fn nat_expr(family: Family, rule: &NatRule) -> Vec<Value> {
    match rule {
        NatRule::ReturnIfMarked { mark } => vec![
            json!({"match": {"op": "==", "left": {"&": [{"meta": {"key": "mark"}}, mark]}, "right": mark}}),
            json!({"return": null}),
        ],
        NatRule::Return { src, dst } => vec![
            addr_match(family, "saddr", src),
            addr_match(family, "daddr", dst),
            json!({"return": null}),
        ],
        NatRule::Masquerade {
            src,
            dst,
            fully_random,
        } => {
            let masq = if *fully_random {
                json!({"masquerade": {"flags": "fully-random"}})
            } else {
                json!({"masquerade": null})
            };
            vec![
                addr_match(family, "saddr", src),
                addr_match(family, "daddr", dst),
                masq,
            ]
        }
    }
}

/// The chains and their rules' expressions, as the plan wants them.
fn wanted(t: &MasqueradeTable) -> Vec<(Value, Vec<Vec<Value>>)> {
    let fam = t.family.nft();
    let chain = |name: &str, kind: &str, hook: &str, prio: i32| json!({"family": fam, "table": t.table, "name": name, "type": kind, "hook": hook, "prio": prio, "policy": "accept"});
    let nat = t
        .postrouting
        .iter()
        .map(|r| nat_expr(t.family, r))
        .collect();
    let forward = t
        .forward
        .iter()
        .map(|r| {
            let m = match (r.src, r.dst) {
                (Some(s), _) => addr_match(t.family, "saddr", &Match::In(s)),
                (_, d) => addr_match(t.family, "daddr", &Match::In(d.unwrap_or_default())),
            };
            vec![m, json!({"accept": null})]
        })
        .collect();
    vec![
        (chain(POSTROUTING, "nat", "postrouting", 100), nat),
        (chain(FORWARD, "filter", "forward", 0), forward),
    ]
}

/// The same shape read back from `nft -j list table` (handles dropped).
/// The chains and rules of `t` in the form compared against a listing (`weft doctor`).
pub fn expected_rules(t: &MasqueradeTable) -> Value {
    json!(wanted(t))
}

/// The chains and rules of an `nft -j list table` listing, in that same form.
pub fn listed_rules(listing: &Value) -> Value {
    json!(observed(listing))
}

pub(super) fn observed(listing: &Value) -> Vec<(Value, Vec<Vec<Value>>)> {
    let items = listing
        .get("nftables")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut chains: Vec<(Value, Vec<Vec<Value>>)> = Vec::new();
    for item in items {
        if let Some(mut c) = item.get("chain").cloned() {
            if let Some(o) = c.as_object_mut() {
                o.remove("handle");
            }
            chains.push((c, Vec::new()));
        } else if let Some(r) = item.get("rule") {
            let chain = r.get("chain").and_then(Value::as_str).unwrap_or_default();
            let expr = r
                .get("expr")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if let Some((_, rules)) = chains
                .iter_mut()
                .find(|(c, _)| c.get("name").and_then(Value::as_str) == Some(chain))
            {
                rules.push(expr);
            }
        }
    }
    chains
}

fn replace_batch(t: &MasqueradeTable) -> Value {
    replace_table(t.family, t.table, wanted(t))
}

/// One transaction that replaces table `name` with `chains` (created if missing).
pub(super) fn replace_table(
    family: Family,
    name: &str,
    chains: Vec<(Value, Vec<Vec<Value>>)>,
) -> Value {
    let fam = family.nft();
    let table = json!({"table": {"family": fam, "name": name}});
    let mut cmds = vec![
        json!({"add": table}),
        json!({"delete": table}),
        json!({"add": table}),
    ];
    for (chain, rules) in chains {
        let chain_name = chain.get("name").cloned().unwrap_or_default();
        cmds.push(json!({"add": {"chain": chain}}));
        for expr in rules {
            cmds.push(json!({"add": {"rule": {"family": fam, "table": name, "chain": chain_name, "expr": expr}}}));
        }
    }
    json!({ "nftables": cmds })
}

/// What the nftables pass did, one line per table replaced or deleted.
#[derive(Debug, Default)]
pub struct NftReport {
    pub applied: Vec<String>,
    pub failed: Vec<ApplyError>,
}

/// Makes weft's nftables tables match `desired` (empty = none wanted).
pub async fn reconcile_nft<N: Nft>(
    nft: &mut N,
    desired: &[MasqueradeTable],
) -> Result<NftReport, ApplyError> {
    let mut report = NftReport::default();
    for (family, name) in TABLES {
        let Some((what, batch)) = table_change(nft, desired, family, name).await? else {
            continue;
        };
        match nft.apply(&what, batch).await {
            Ok(()) => report.applied.push(what),
            Err(e) => report.failed.push(e),
        }
    }
    Ok(report)
}

/// What table `family name` needs to match `desired` (its description and batch), or
/// `None` if it does already.
async fn table_change<N: Nft>(
    nft: &mut N,
    desired: &[MasqueradeTable],
    family: Family,
    name: &str,
) -> Result<Option<(String, Value)>, ApplyError> {
    let want = desired
        .iter()
        .find(|t| t.family == family && t.table == name);
    let have = nft.list(family, name).await?;
    Ok(match (want, have) {
        (Some(t), Some(listing)) if observed(&listing) == wanted(t) => None,
        (Some(t), _) => Some((
            format!("replace nftables table {} {name}", family.nft()),
            replace_batch(t),
        )),
        (None, Some(_)) => Some((
            format!("delete nftables table {} {name}", family.nft()),
            json!({"nftables": [{"delete": {"table": {"family": family.nft(), "name": name}}}]}),
        )),
        (None, None) => None,
    })
}

/// Whether weft's tables hold what `masquerade` and `guard` plan, by listing them and
/// changing nothing: the check that may run beside the control loop, which repairs
/// (`reconcile_nft`, the guard's pass) only when this finds a difference.
pub async fn tables_as_planned<N: Nft>(
    nft: &mut N,
    masquerade: &[MasqueradeTable],
    guard: &[crate::model::GuardSpec],
) -> Result<bool, ApplyError> {
    for (family, name) in TABLES {
        if table_change(nft, masquerade, family, name).await?.is_some() {
            return Ok(false);
        }
    }
    super::guard::as_planned(nft, guard).await
}
