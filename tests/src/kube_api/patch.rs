//! The two PATCH flavours the API server applies to Nodes: JSON merge patch (RFC 7386) and
//! strategic merge patch, which differs in lists: a list with a merge key (a Node's
//! `status.conditions` by `type`, `status.addresses` by `type`, …) is merged element by
//! element instead of replaced, and `{"$patch": "delete"}` removes an element.

use serde_json::{Map, Value};

/// RFC 7386: objects merge recursively, `null` removes a key, anything else replaces.
pub fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(target) = target else {
        return;
    };
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// The merge key of a list field in Node, as the API's `x-kubernetes-patch-merge-key`.
fn merge_key(field: &str) -> Option<&'static str> {
    match field {
        "conditions" | "addresses" => Some("type"),
        "taints" => Some("key"),
        _ => None,
    }
}

/// Strategic merge patch for the fields a Node has.
pub fn strategic(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(target) = target else {
        return;
    };
    for (key, value) in patch {
        match (value, merge_key(key)) {
            (Value::Null, _) => {
                target.remove(key);
            }
            (Value::Array(items), Some(mk)) => {
                let list = target
                    .entry(key.clone())
                    .or_insert_with(|| Value::Array(Vec::new()));
                if !list.is_array() {
                    *list = Value::Array(Vec::new());
                }
                if let Value::Array(list) = list {
                    merge_list(list, items, mk);
                }
            }
            (value, _) => strategic(target.entry(key.clone()).or_insert(Value::Null), value),
        }
    }
}

fn merge_list(list: &mut Vec<Value>, items: &[Value], key: &str) {
    for item in items {
        let id = item.get(key).cloned();
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        let found = list
            .iter()
            .position(|e| id.is_some() && e.get(key) == id.as_ref());
        match (found, delete) {
            (Some(i), true) => {
                list.remove(i);
            }
            (Some(i), false) => strategic(&mut list[i], item),
            (None, true) => {}
            (None, false) => list.push(item.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn merge_patch_follows_rfc7386() {
        let mut doc = json!({"a": {"b": 1, "c": 2}, "l": [1, 2]});
        merge(&mut doc, &json!({"a": {"b": null, "d": 3}, "l": [3]}));
        assert_eq!(doc, json!({"a": {"c": 2, "d": 3}, "l": [3]}));
    }

    #[test]
    fn strategic_merge_merges_conditions_by_type() {
        let mut doc = json!({"status": {"conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "NetworkUnavailable", "status": "True", "reason": "NoRouteCreated"}
        ], "images": [{"names": ["a"]}]}});
        strategic(
            &mut doc,
            &json!({"status": {"conditions": [
                {"type": "NetworkUnavailable", "status": "False", "reason": "WeftIsUp"}
            ], "images": []}}),
        );
        assert_eq!(
            doc,
            json!({"status": {"conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "NetworkUnavailable", "status": "False", "reason": "WeftIsUp"}
            ], "images": []}})
        );
        strategic(
            &mut doc,
            &json!({"status": {"conditions": [{"type": "Ready", "$patch": "delete"}]}}),
        );
        assert_eq!(
            doc["status"]["conditions"].as_array().map(Vec::len),
            Some(1)
        );
    }
}
