//! The HTTP side: the Node (and Pod) endpoints of the Kubernetes API, in its wire protocol.
//!
//! - `GET /api/v1/nodes`: a `NodeList` with `metadata.resourceVersion`, paged by `limit` /
//!   `continue`;
//! - `GET /api/v1/nodes?watch=true&resourceVersion=N`: a chunked stream of JSON lines,
//!   `ADDED`/`MODIFIED`/`DELETED` after N, `BOOKMARK`s when asked for, ended after
//!   `timeoutSeconds`; a resourceVersion older than the kept history gets the API server's
//!   `ERROR` event with a `410 Expired` Status, which forces the client to list again;
//! - `GET /api/v1/nodes/{name}`, `GET /api/v1/namespaces/{ns}/pods/{name}`;
//! - `PATCH /api/v1/nodes/{name}[/status]` as merge or strategic-merge patch; a patch that
//!   names a `metadata.resourceVersion` other than the current one gets `409 Conflict`; the
//!   status subresource changes metadata and status only, the main resource not status.
//!
//! Every request needs the bearer token; every (verb, resource) served is recorded, so a
//! test can hold the RBAC rules against what a client really did.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};

use super::patch;
use super::store::{status, Event};
use super::{Fault, Shared, TOKEN};

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/api/v1/nodes", get(nodes))
        .route("/api/v1/nodes/{name}", get(get_node).patch(patch_node))
        .route(
            "/api/v1/nodes/{name}/status",
            get(get_node).patch(patch_status),
        )
        .route("/api/v1/namespaces/{ns}/pods/{name}", get(get_pod))
        .fallback(|| async {
            reply(
                StatusCode::NOT_FOUND,
                status(
                    404,
                    "NotFound",
                    "the server could not find the requested resource",
                ),
            )
        })
        .layer(axum::middleware::from_fn_with_state(shared.clone(), faults))
        .with_state(shared)
}

/// `Fault::Errors` and `Fault::Hang` answer for every route.
async fn faults(
    State(shared): State<Arc<Shared>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match shared.fault() {
        Fault::Errors => failure(500, "InternalError", "an injected server error"),
        Fault::Hang => {
            // Unanswered while the fault lasts; then failed, as a stalled server that
            // recovers fails what it held.
            while shared.fault() == Fault::Hang {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            failure(503, "ServiceUnavailable", "the server was stalled")
        }
        _ => next.run(request).await,
    }
}

fn reply(code: StatusCode, body: Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn failure(code: u16, reason: &str, message: &str) -> Response {
    reply(
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        status(code, reason, message),
    )
}

/// Checks the token and records the request; `Some` is the 401 to send.
fn admit(shared: &Shared, headers: &HeaderMap, verb: &str, resource: &str) -> Option<Response> {
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if auth != Some(&format!("Bearer {TOKEN}")) {
        return Some(failure(401, "Unauthorized", "Unauthorized"));
    }
    shared.record(verb, resource);
    None
}

async fn nodes(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let watching = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    if let Some(r) = admit(
        &shared,
        &headers,
        if watching { "watch" } else { "list" },
        "nodes",
    ) {
        return r;
    }
    if watching {
        watch(shared, &q)
    } else {
        list(&shared, &q)
    }
}

fn list(shared: &Shared, q: &HashMap<String, String>) -> Response {
    let store = shared.lock();
    let limit = q
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let after = match q.get("continue").filter(|c| !c.is_empty()) {
        None => None,
        Some(token) => match token.split_once('/') {
            Some((rv, name))
                if rv
                    .parse::<u64>()
                    .is_ok_and(|rv| rv >= store.oldest_watchable) =>
            {
                Some(name.to_string())
            }
            _ => return failure(
                410,
                "Expired",
                "The provided continue parameter is too old to display a consistent list result.",
            ),
        },
    };
    let mut items: Vec<&Value> = store
        .nodes
        .iter()
        .filter(|(name, _)| after.as_ref().is_none_or(|a| name.as_str() > a.as_str()))
        .map(|(_, n)| n)
        .collect();
    let mut next = String::new();
    if let Some(limit) = limit {
        if items.len() > limit {
            items.truncate(limit);
            let last = items
                .last()
                .and_then(|n| n["metadata"]["name"].as_str())
                .unwrap_or_default();
            next = format!("{}/{last}", store.rv);
        }
    }
    // List items carry no kind/apiVersion, as the API server sends them.
    let items: Vec<Value> = items
        .into_iter()
        .map(|n| {
            let mut n = n.clone();
            if let Some(o) = n.as_object_mut() {
                o.remove("kind");
                o.remove("apiVersion");
            }
            n
        })
        .collect();
    reply(
        StatusCode::OK,
        json!({
            "kind": "NodeList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": store.rv.to_string(), "continue": next},
            "items": items
        }),
    )
}

fn line(kind: &str, object: &Value) -> Bytes {
    let mut text = json!({"type": kind, "object": object}).to_string();
    text.push('\n');
    Bytes::from(text)
}

fn watch(shared: Arc<Shared>, q: &HashMap<String, String>) -> Response {
    let from = q
        .get("resourceVersion")
        .and_then(|rv| rv.parse::<u64>().ok())
        .unwrap_or(0);
    let asked = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(Duration::from_secs(300), Duration::from_secs)
        .min(Duration::from_secs(300));
    let timeout = match shared.fault() {
        Fault::ShortWatches(cut) => asked.min(cut),
        _ => asked,
    };
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let (initial, mut events, mut last) = {
        let store = shared.lock();
        let initial: Vec<Bytes> = if from == 0 {
            // "Start at most recent": every current object as ADDED first.
            store.nodes.values().map(|n| line("ADDED", n)).collect()
        } else {
            match store.since(from) {
                Some(events) => events
                    .iter()
                    .filter_map(|e| match e {
                        Event::Node { kind, object, .. } => Some(line(kind, object)),
                        Event::EndWatches => None,
                    })
                    .collect(),
                None => {
                    let gone = status(
                        410,
                        "Expired",
                        &format!(
                            "too old resource version: {from} ({})",
                            store.oldest_watchable
                        ),
                    );
                    vec![line("ERROR", &gone)]
                }
            }
        };
        let expired = from != 0 && store.since(from).is_none();
        let events = (!expired).then(|| store.events.subscribe());
        (initial, events, store.rv.max(from))
    };
    tokio::spawn(async move {
        for l in initial {
            if tx.send(l).await.is_err() {
                return;
            }
        }
        let Some(events) = events.as_mut() else {
            return;
        };
        let deadline = tokio::time::Instant::now() + timeout;
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            let out = tokio::select! {
                () = tokio::time::sleep_until(deadline) => return,
                _ = tick.tick(), if bookmarks => {
                    line("BOOKMARK", &json!({"kind": "Node", "apiVersion": "v1", "metadata": {"resourceVersion": last.to_string()}}))
                }
                event = events.recv() => match event {
                    Ok(Event::Node { rv, kind, object }) if rv > last => {
                        last = rv;
                        line(kind, &object)
                    }
                    Ok(Event::Node { .. }) => continue,
                    Ok(Event::EndWatches) | Err(broadcast::error::RecvError::Closed) => return,
                    // Too slow to keep up: end the watch; the client resumes from `last`.
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                },
            };
            if tx.send(out).await.is_err() {
                return;
            }
        }
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(body),
    )
        .into_response()
}

async fn get_node(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    if let Some(r) = admit(&shared, &headers, "get", "nodes") {
        return r;
    }
    match shared.lock().nodes.get(&name) {
        Some(node) => reply(StatusCode::OK, node.clone()),
        None => failure(404, "NotFound", &format!("nodes \"{name}\" not found")),
    }
}

async fn get_pod(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    if let Some(r) = admit(&shared, &headers, "get", "pods") {
        return r;
    }
    match shared.lock().pods.get(&(ns, name.clone())) {
        Some(pod) => reply(StatusCode::OK, pod.clone()),
        None => failure(404, "NotFound", &format!("pods \"{name}\" not found")),
    }
}

async fn patch_node(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    apply_patch(&shared, &headers, &name, false, &body)
}

async fn patch_status(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    apply_patch(&shared, &headers, &name, true, &body)
}

fn apply_patch(
    shared: &Shared,
    headers: &HeaderMap,
    name: &str,
    status_sub: bool,
    body: &[u8],
) -> Response {
    let resource = if status_sub { "nodes/status" } else { "nodes" };
    if let Some(r) = admit(shared, headers, "patch", resource) {
        return r;
    }
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let strategic = match content_type {
        "application/merge-patch+json" => false,
        "application/strategic-merge-patch+json" => true,
        other => {
            return failure(415, "UnsupportedMediaType", &format!("the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json (got {other:?})"))
        }
    };
    let patch_doc: Value = match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => return failure(400, "BadRequest", "the patch must be a JSON object"),
        Err(e) => return failure(400, "BadRequest", &format!("error decoding patch: {e}")),
    };
    let mut store = shared.lock();
    if !store.nodes.contains_key(name) {
        return failure(404, "NotFound", &format!("nodes \"{name}\" not found"));
    }
    let wanted_rv = patch_doc["metadata"]["resourceVersion"]
        .as_str()
        .map(str::to_string);
    if wanted_rv.is_some() && store.conflicts_to_inject > 0 {
        // Another writer gets in first, as on a busy cluster.
        store.conflicts_to_inject -= 1;
        if let Some(mut other) = store.nodes.get(name).cloned() {
            let n = other["metadata"]["labels"]["lab.weft.dev/concurrent-writes"]
                .as_str()
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
            other["metadata"]["labels"]["lab.weft.dev/concurrent-writes"] =
                json!((n + 1).to_string());
            store.put_node(other);
        }
    }
    let Some(old) = store.nodes.get(name).cloned() else {
        return failure(404, "NotFound", &format!("nodes \"{name}\" not found"));
    };
    if let Some(rv) = wanted_rv {
        if old["metadata"]["resourceVersion"].as_str() != Some(rv.as_str()) {
            shared.count_conflict();
            return failure(409, "Conflict", &format!("Operation cannot be fulfilled on nodes \"{name}\": the object has been modified; please apply your changes to the latest version and try again"));
        }
    }
    let mut new = old.clone();
    if strategic {
        patch::strategic(&mut new, &patch_doc);
    } else {
        patch::merge(&mut new, &patch_doc);
    }
    new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
    new["metadata"]["name"] = json!(name);
    let keep = if status_sub { "spec" } else { "status" };
    new[keep] = old[keep].clone();
    if new == old {
        return reply(StatusCode::OK, old);
    }
    let stored = store.put_node(new);
    reply(StatusCode::OK, stored)
}
