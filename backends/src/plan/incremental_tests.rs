//! The incremental planner against the full plan. Random sequences of changes (nodes
//! joining, leaving, changing keys, rotating, publishing bad entries or another node's
//! subnet or key; the clock moving, leases expiring; the device reporting roamed
//! endpoints and handshakes; measured paths; this node's own lease), with one, two or
//! three devices' worth of config: after every step the planner's plan must be `plan()`'s.
//! And the plain changes must have been patched, not planned in full, or the planner
//! would prove nothing.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde_json::json;
use weft_crypto::PublicKey;

use super::tests::{ip, key, lease, NOW};
use super::*;
use crate::apply::wireguard::diff::{apply_to, diff_device, diff_device_peers};
use crate::apply::wireguard::seen::changed_peers;
use crate::apply::wireguard::WgDevice;
use crate::model::{ClusterView, IfName, Lease, NextKey, Observed, PeerObserved};
use crate::netconf::{parse, NetConf};
use crate::test_rng::Rng;

const SINGLE: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#;
const SEPARATE: &str = r#"{"Network": "10.244.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00:10:244::/48", "Backend": {"Type": "wireguard"}}"#;
const AUTO: &str = r#"{"Network": "10.244.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00:10:244::/48", "Backend": {"Type": "wireguard", "Mode": "auto"}}"#;

/// Nodes the sequences draw from, besides this one.
const NODES: u64 = 24;

/// Everything a pass plans from, changed step by step.
struct World {
    rng: Rng,
    keys: Vec<PublicKey>,
    dual: bool,
    config: NetConf,
    options: PlanOptions,
    local: Lease,
    view: Arc<ClusterView>,
    observed: Observed,
    path_mtus: BTreeMap<IpAddr, u32>,
    pair_psks: BTreeMap<PublicKey, crate::model::PairSecret>,
    now: SystemTime,
}

impl World {
    fn new(config: &str, seed: u64, keys: &[PublicKey]) -> World {
        let config = parse(config).unwrap();
        let dual = config.ipv6.is_some();
        let mut local = lease("node-a", "10.244.1.0/24", ip(1), 1);
        local.reach.zone = Some("z1".into());
        if dual {
            dualize(&mut local, 1);
        }
        let mut view = ClusterView::default();
        view.insert(local.clone());
        World {
            rng: Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            keys: keys.to_vec(),
            dual,
            config,
            options: PlanOptions {
                ip_masq: true,
                underlay_mtu: 1500,
                underlay_device: Some("eth0".into()),
                underlay_networks: vec![],
            },
            local,
            view: Arc::new(view),
            observed: Observed::default(),
            path_mtus: BTreeMap::new(),
            pair_psks: BTreeMap::new(),
            now: SystemTime::UNIX_EPOCH + NOW,
        }
    }

    fn chance(&mut self, one_in: u64) -> bool {
        self.rng.below(one_in) == 0
    }

    fn pick_key(&mut self) -> PublicKey {
        if self.chance(8) {
            // A small pool: nodes sharing a key.
            self.keys[self.rng.below(3) as usize]
        } else {
            self.keys[3 + self.rng.below(self.keys.len() as u64 - 3) as usize]
        }
    }

    fn set_key(&mut self, l: &mut Lease, key: PublicKey) {
        l.backend_data = Some(wireguard_backend_data(&key, 51820));
        if self.dual {
            l.backend_v6_data = Some(wireguard_backend_data(&key, 51821));
        }
    }

    /// A lease for node `i`: mostly good, sometimes bad or contending.
    fn node_lease(&mut self, i: u64) -> Lease {
        let k = if self.chance(10) {
            2 + self.rng.below(4)
        } else {
            i + 2
        };
        let subnet = match self.rng.below(40) {
            0 => format!("10.245.{k}.0/24"),
            1 => format!("10.244.{}.0/23", k & !1),
            _ => format!("10.244.{k}.0/24"),
        };
        let mut l = lease(&format!("n{i:02}"), &subnet, ip(k as u8), 0);
        let key = if self.chance(60) {
            super::tests::key(1)
        } else {
            self.pick_key()
        };
        self.set_key(&mut l, key);
        if self.dual {
            dualize(&mut l, k);
        }
        match self.rng.below(30) {
            0 => l.backend_data = Some(json!({"PublicKey": "not a key"})),
            1 => l.backend_type = "vxlan".into(),
            2 => l.public_ip = None,
            _ => {}
        }
        l.created = (!self.chance(5)).then(|| self.rng.below(1000) as i64);
        if self.chance(8) {
            l.expires = Some(self.now + Duration::from_secs(1 + self.rng.below(40)));
        }
        if self.chance(10) {
            l.reach.zone = Some("z1".into());
            l.reach.internal_ip = Some(IpAddr::V4(Ipv4Addr::new(192, 0, 2, k as u8)));
        }
        if self.chance(10) {
            l.next_key = Some(self.next_key());
        }
        l
    }

    fn next_key(&mut self) -> NextKey {
        let at = self.now + Duration::from_millis(self.rng.below(8000));
        NextKey {
            public_key: self.pick_key().to_base64(),
            switch_at_ms: at
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            generation: 1,
        }
    }

    fn change(&mut self, f: impl FnOnce(&mut Self, &mut ClusterView)) {
        let mut view = ClusterView::clone(&self.view);
        f(self, &mut view);
        self.view = Arc::new(view);
    }

    fn a_node(&mut self) -> String {
        format!("n{:02}", self.rng.below(NODES))
    }

    /// A peer of the last plan, by device and key.
    fn a_planned_peer(&mut self, state: &DesiredState) -> Option<(IfName, PublicKey, SocketAddr)> {
        let all: Vec<_> = state
            .tunnels
            .iter()
            .flat_map(|t| {
                t.peers
                    .iter()
                    .map(|p| (t.device.as_str().into(), p.public_key, p.endpoint))
            })
            .collect();
        (!all.is_empty()).then(|| all[self.rng.below(all.len() as u64) as usize])
    }

    /// One random change; its name, for a failure's message.
    fn step(&mut self, last: &DesiredState) -> &'static str {
        match self.rng.below(100) {
            0..=29 => {
                let i = self.rng.below(NODES);
                let l = self.node_lease(i);
                self.change(|_, v| {
                    v.insert(l);
                });
                "a node joins or is replaced"
            }
            30..=44 => {
                let n = self.a_node();
                self.change(|_, v| {
                    v.remove(&n);
                });
                "a node leaves"
            }
            45..=59 => {
                let n = self.a_node();
                let key = self.pick_key();
                self.change(|w, v| {
                    if let Some(mut l) = v.get(&n).cloned() {
                        w.set_key(&mut l, key);
                        v.insert(l);
                    }
                });
                "a node's key changes"
            }
            60..=64 => {
                let n = self.a_node();
                let next = (!self.chance(3)).then(|| self.next_key());
                self.change(|_, v| {
                    if let Some(mut l) = v.get(&n).cloned() {
                        l.next_key = next;
                        v.insert(l);
                    }
                });
                "a node announces a rotation or ends one"
            }
            65..=74 => {
                self.now += Duration::from_millis(100 + self.rng.below(900));
                "a moment passes"
            }
            75..=77 => {
                self.now += Duration::from_secs(5 + self.rng.below(200));
                "time passes"
            }
            78..=87 => {
                let Some((device, key, planned)) = self.a_planned_peer(last) else {
                    return "nothing reported";
                };
                if self.chance(4) {
                    self.observed.peers.remove(&(device, key));
                    return "the device no longer reports a peer";
                }
                let roamed = SocketAddr::new(planned.ip(), 40000 + self.rng.below(1000) as u16);
                let since_epoch = self
                    .now
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default();
                let have = PeerObserved {
                    endpoint: Some(if self.chance(2) { roamed } else { planned }),
                    last_handshake: (!self.chance(3)).then(|| {
                        since_epoch.saturating_sub(Duration::from_secs(self.rng.below(300)))
                    }),
                    planned_before: (!self.chance(3)).then_some(planned),
                    endpoint_set: (!self.chance(3))
                        .then(|| self.now - Duration::from_secs(self.rng.below(300))),
                };
                self.observed.peers.insert((device, key), have);
                "the device reports a peer"
            }
            88..=89 => {
                let key = self.pick_key();
                if !self.observed.next_keys_in_use.remove(&key) {
                    self.observed.next_keys_in_use.insert(key);
                }
                "an announced key handshakes"
            }
            90..=91 => {
                let address = IpAddr::V4(ip(2 + self.rng.below(NODES) as u8));
                self.path_mtus
                    .insert(address, 1280 + self.rng.below(300) as u32);
                "a path is measured"
            }
            92 => {
                self.local.reach.zone = (!self.chance(2)).then(|| "z1".into());
                let local = self.local.clone();
                self.change(|_, v| {
                    v.insert(local);
                });
                "this node's lease changes"
            }
            _ => "nothing changes",
        }
    }

    fn input(&self) -> PlanInput<'_> {
        PlanInput {
            local: &self.local,
            view: &self.view,
            config: &self.config,
            options: &self.options,
            observed: &self.observed,
            now: self.now,
            path_mtus: &self.path_mtus,
            pair_psks: &self.pair_psks,
        }
    }
}

/// `l` with an IPv6 subnet, address and backend data (its IPv4 key, the IPv6 port).
fn dualize(l: &mut Lease, k: u64) {
    l.subnet_v6 = format!("fd00:10:244:{k:x}::/64").parse().ok();
    l.public_ipv6 = Some(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, k as u16));
    l.backend_v6_data = l.backend_data.clone().map(|mut d| {
        d["Port"] = json!(51821);
        d
    });
}

fn pool() -> Vec<PublicKey> {
    (10..60).map(key).collect()
}

#[test]
fn the_incremental_plan_is_the_full_plan_after_any_sequence_of_changes() {
    let keys = pool();
    let (mut passes, mut patched) = (0, 0);
    for config in [SINGLE, SEPARATE, AUTO] {
        for seed in 0..40 {
            let mut world = World::new(config, seed, &keys);
            let mut planner = Planner::default();
            let mut last = DesiredState::default();
            for step in 0..80 {
                let what = world.step(&last);
                let input = world.input();
                let want = plan(&input).unwrap();
                let (got, kind) = planner.plan(&input, &world.view, step % 25 == 24).unwrap();
                assert!(
                    *got == want,
                    "config {config}, seed {seed}, step {step} ({what}, planned {kind:?}):\n\
                     incremental {got:#?}\nfull {want:#?}"
                );
                let stamp = planner.stamp();
                assert_eq!(stamp.generation, Some(step + 1));
                if matches!(kind, PlanKind::Patched(_)) {
                    patched_as_said(&last, &want, planner.patched());
                    assert_eq!(stamp.patched.map(|(from, _)| from), Some(step));
                    devices_diffed_as_in_full(&last, &want, &stamp);
                } else {
                    assert!(stamp.patched.is_none());
                }
                passes += 1;
                patched += usize::from(matches!(kind, PlanKind::Patched(_)));
                last = want;
            }
        }
    }
    eprintln!("{patched} of {passes} passes patched");
    // Most steps change only leases or reports, and most of those are plain (7,100 of
    // 9,600 when written).
    assert!(
        patched * 2 > passes,
        "only {patched} of {passes} passes were patched"
    );
}

/// Devices that hold `before`'s tunnels, given `after`: comparing only the peers the
/// stamp names (`changed_peers`) finds what comparing every peer finds.
fn devices_diffed_as_in_full(before: &DesiredState, after: &DesiredState, stamp: &PlanStamp) {
    let own = pool()[0];
    for (index, (was, now)) in before.tunnels.iter().zip(&after.tunnels).enumerate() {
        let mut device = WgDevice::default();
        let fill = diff_device(was, &own, &device);
        apply_to(&mut device, &fill, &own);
        let from = stamp.patched.map(|(from, _)| from);
        let keys = changed_peers(stamp, from, index).expect("patched from the plan held");
        assert_eq!(
            diff_device_peers(now, &own, &device, &keys),
            diff_device(now, &own, &device),
            "tunnel {index}, keys {keys:?}"
        );
    }
}

/// Each node's tunnel peers in `state`: (tunnel index, key), in the plan's order.
fn peers_by_node(state: &DesiredState) -> BTreeMap<&str, Vec<(usize, PublicKey)>> {
    let mut by_node: BTreeMap<&str, Vec<(usize, PublicKey)>> = BTreeMap::new();
    for (d, tunnel) in state.tunnels.iter().enumerate() {
        for p in &tunnel.peers {
            by_node
                .entry(p.node.as_str())
                .or_default()
                .push((d, p.public_key));
        }
    }
    by_node
}

/// What the planner says a patched pass changed is what changed: the named nodes' peers
/// before and after, and every other node's peers as they were.
fn patched_as_said(before: &DesiredState, after: &DesiredState, said: &[PatchedNode]) {
    let (mut old, mut new) = (peers_by_node(before), peers_by_node(after));
    for n in said {
        assert_eq!(
            old.remove(n.node.as_str()).unwrap_or_default(),
            n.before,
            "{}",
            n.node
        );
        assert_eq!(
            new.remove(n.node.as_str()).unwrap_or_default(),
            n.after,
            "{}",
            n.node
        );
    }
    assert_eq!(old, new, "a node the patch did not name changed");
}

/// A cluster of `n` good nodes, and this node.
fn cluster(n: u8) -> ClusterView {
    let mut view = ClusterView::default();
    view.insert(super::tests::local());
    for i in 2..n + 2 {
        let mut l = lease(&format!("n{i:03}"), &format!("10.244.{i}.0/24"), ip(i), i);
        l.created = Some(i64::from(i % 7));
        view.insert(l);
    }
    view
}

/// One change to a view.
type Change = dyn Fn(&mut ClusterView);

/// Plans `view` of the single-stack config for `node-a` with `planner`, checks the plan
/// is the full plan's, and returns it with how it was made.
fn plan_single(planner: &mut Planner, view: &ClusterView) -> (Arc<DesiredState>, PlanKind) {
    let config = parse(SINGLE).unwrap();
    let options = PlanOptions {
        ip_masq: true,
        underlay_mtu: 1500,
        underlay_device: None,
        underlay_networks: vec![],
    };
    let (observed, mtus, psks) = (Observed::default(), BTreeMap::new(), BTreeMap::new());
    let me = super::tests::local();
    let shared = Arc::new(view.clone());
    let input = PlanInput {
        local: &me,
        view: &shared,
        config: &config,
        options: &options,
        observed: &observed,
        now: SystemTime::UNIX_EPOCH + NOW,
        path_mtus: &mtus,
        pair_psks: &psks,
    };
    let (got, how) = planner.plan(&input, &shared, false).unwrap();
    assert!(*got == plan(&input).unwrap(), "{how:?}: not the full plan");
    (got, how)
}

#[test]
fn a_join_a_key_change_and_a_leave_are_patched_not_planned_in_full() {
    let mut planner = Planner::default();
    let mut view = cluster(200);
    let joiner = lease("n250", "10.244.250.0/24", ip(250), 250);
    let mut rekeyed = view.get("n100").cloned().unwrap();
    rekeyed.backend_data = Some(wireguard_backend_data(&key(251), 51820));
    let steps: Vec<(&str, Box<Change>, PlanKind)> = vec![
        (
            "first",
            Box::new(|_: &mut ClusterView| {}),
            PlanKind::Full("first pass"),
        ),
        (
            "join",
            Box::new(move |v: &mut ClusterView| drop(v.insert(joiner.clone()))),
            PlanKind::Patched(1),
        ),
        (
            "key change",
            Box::new(move |v: &mut ClusterView| drop(v.insert(rekeyed.clone()))),
            PlanKind::Patched(1),
        ),
        (
            "leave",
            Box::new(|v: &mut ClusterView| drop(v.remove("n050"))),
            PlanKind::Patched(1),
        ),
        (
            "nothing changed",
            Box::new(|_: &mut ClusterView| {}),
            PlanKind::Patched(0),
        ),
    ];
    for (what, change, kind) in steps {
        change(&mut view);
        assert_eq!(plan_single(&mut planner, &view).1, kind, "{what}");
    }
}

#[test]
fn a_changed_node_claiming_another_nodes_subnet_is_planned_in_full_and_left_out() {
    let mut planner = Planner::default();
    let mut view = cluster(10);
    plan_single(&mut planner, &view);
    let mut late = lease("n999", "10.244.5.0/24", ip(99), 99);
    late.created = Some(100);
    view.insert(late);
    let (got, kind) = plan_single(&mut planner, &view);
    assert!(got.left_out.iter().any(|l| l.node == "n999"));
    assert_eq!(kind, PlanKind::Full("a changed node's subnet is contended"));
}
