use super::*;

fn view(nodes: &[&str]) -> Arc<ClusterView> {
    let mut view = ClusterView::default();
    for node in nodes {
        view.insert(weft_lab::fixtures::lease(node, "", "", 1));
    }
    Arc::new(view)
}

/// A plan's rows are made when the snapshot is read, from the last plan only, and the
/// changes made in between are kept.
#[test]
fn a_plans_rows_are_written_when_read_and_are_the_last_plans() {
    let shared = Shared::default();
    let state = Arc::new(DesiredState::default());
    let me = view(&["a"]).leases["a"].clone();
    shared.planned(&me, &view(&["a", "b"]), &state);
    shared.update(|s| s.passes = 7);
    shared.planned(&me, &view(&["a", "b", "c"]), &state);
    let got = shared.get();
    assert_eq!(got.node, "a");
    assert_eq!(got.passes, 7);
    assert_eq!(got.registry.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(shared.read(|s| s.registry.len()), Some(3));
}

/// The loop's own reads (`facts`) leave the rows unmade; the post-quantum rows are the
/// manager's status as it is when the snapshot is read, by node.
#[test]
fn facts_make_no_rows_and_pq_rows_are_read_live() {
    let shared = Shared::default();
    let me = view(&["a"]).leases["a"].clone();
    shared.planned(&me, &view(&["a", "b"]), &Arc::new(DesiredState::default()));
    assert_eq!(shared.facts(|s| s.registry.len()), Some(0));
    let status = PqStatus::default();
    shared.post_quantum(&status);
    let key = |n: u8| weft_crypto::PrivateKey::from_bytes([n; 32]).public_key();
    if let Ok(mut s) = status.lock() {
        for (n, node) in [(1, "b"), (2, "a")] {
            let row = PqPairInfo {
                node: node.into(),
                ..Default::default()
            };
            s.insert(key(n), row);
        }
    }
    let nodes: Vec<String> = shared
        .get()
        .post_quantum
        .into_iter()
        .map(|r| r.node)
        .collect();
    assert_eq!(nodes, ["a", "b"]);
    assert_eq!(shared.read(|s| s.registry.len()), Some(2));
}
