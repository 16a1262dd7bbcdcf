//! The admission policy of deploy/kubernetes/admission-policy.yaml, evaluated with a CEL
//! interpreter against admission requests as the API server builds them: weft's
//! ServiceAccount may change its own Node's weft and flannel annotations and its
//! NetworkUnavailable condition, and nothing else; other users are not matched. An
//! expression that fails to evaluate denies, as `failurePolicy: Fail` does.

use cel_interpreter::{Context, Program, Value as Cel};
use serde_json::{json, Value};

const WEFT_SA: &str = "system:serviceaccount:kube-flannel:weft";

fn policy() -> Value {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/kubernetes/admission-policy.yaml"),
    )
    .unwrap();
    let docs: Vec<Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let binding = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicyBinding")
        .expect("a binding");
    let policy = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicy")
        .expect("a policy")
        .clone();
    assert_eq!(binding["spec"]["policyName"], policy["metadata"]["name"]);
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
    assert_eq!(policy["spec"]["failurePolicy"], "Fail");
    // The user it matches is the DaemonSet's ServiceAccount.
    let rbac = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/rbac.yaml"),
    )
    .unwrap();
    let account = serde_yaml::Deserializer::from_str(&rbac)
        .map(|d| <Value as serde::Deserialize>::deserialize(d).unwrap())
        .find(|d| d["kind"] == "ServiceAccount")
        .expect("a ServiceAccount");
    let name = format!(
        "system:serviceaccount:{}:{}",
        account["metadata"]["namespace"].as_str().unwrap(),
        account["metadata"]["name"].as_str().unwrap()
    );
    assert_eq!(name, WEFT_SA);
    policy
}

/// True, false, or an evaluation error (which denies).
fn eval(expression: &str, request: &Value) -> Result<bool, String> {
    let program = Program::compile(expression).map_err(|e| format!("{expression}: {e:?}"))?;
    let mut ctx = Context::default();
    for name in ["request", "object", "oldObject"] {
        ctx.add_variable(name, &request[name])
            .map_err(|e| format!("{name}: {e:?}"))?;
    }
    match program.execute(&ctx) {
        Ok(Cel::Bool(b)) => Ok(b),
        other => Err(format!("{expression}: {other:?}")),
    }
}

/// `None` when the policy does not apply to the request; else the message of the first
/// failed validation, or `Some("")` when all pass.
fn verdict(policy: &Value, request: &Value) -> Option<String> {
    for condition in policy["spec"]["matchConditions"].as_array().unwrap() {
        let expression = condition["expression"].as_str().unwrap();
        if !eval(expression, request).unwrap_or_else(|e| panic!("{e}")) {
            return None;
        }
    }
    for v in policy["spec"]["validations"].as_array().unwrap() {
        let expression = v["expression"].as_str().unwrap();
        match eval(expression, request) {
            Ok(true) => {}
            Ok(false) => return Some(v["message"].as_str().unwrap().to_string()),
            Err(e) => return Some(format!("evaluation failed: {e}")),
        }
    }
    Some(String::new())
}

fn node(name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "topology.kubernetes.io/zone": "a"},
            "annotations": {
                "flannel.alpha.coreos.com/kube-subnet-manager": "true",
                "flannel.alpha.coreos.com/backend-data": "{\"PublicKey\":\"old\",\"Port\":51820}",
                "flannel.alpha.coreos.com/public-ip": "198.51.100.2",
                "node.alpha.kubernetes.io/ttl": "0"
            }
        },
        "spec": {"podCIDR": "10.244.2.0/24", "podCIDRs": ["10.244.2.0/24"]},
        "status": {
            "addresses": [{"type": "InternalIP", "address": "198.51.100.2"}],
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady"},
                {"type": "NetworkUnavailable", "status": "True", "reason": "NoRouteCreated"}
            ]
        }
    })
}

/// An update of Node `name` by `user` (on node `on`, as its token says), from `node(name)`
/// to what `change` makes of it.
fn request(user: &str, on: Option<&str>, name: &str, change: impl FnOnce(&mut Value)) -> Value {
    let old = node(name);
    let mut new = old.clone();
    change(&mut new);
    let mut extra = json!({"authentication.kubernetes.io/pod-name": ["weft-abcde"]});
    if let Some(on) = on {
        extra["authentication.kubernetes.io/node-name"] = json!([on]);
    }
    json!({
        "request": {
            "operation": "UPDATE",
            "subResource": "status",
            "userInfo": {"username": user, "extra": extra}
        },
        "object": new,
        "oldObject": old
    })
}

fn annotate(key: &str, value: &str) -> impl FnOnce(&mut Value) {
    let (key, value) = (key.to_string(), value.to_string());
    move |n| n["metadata"]["annotations"][key] = json!(value)
}

#[test]
fn weft_may_change_only_its_own_nodes_weft_annotations_and_network_condition() {
    let policy = policy();
    let weft = |on: Option<&str>, name: &str, change: Box<dyn FnOnce(&mut Value)>| {
        verdict(&policy, &request(WEFT_SA, on, name, change))
    };
    let allowed = Some(String::new());

    // What the agent does on its own node.
    assert_eq!(
        weft(
            Some("n1"),
            "n1",
            Box::new(annotate(
                "flannel.alpha.coreos.com/backend-data",
                "{\"PublicKey\":\"new\",\"Port\":51820}"
            ))
        ),
        allowed
    );
    assert_eq!(
        weft(
            Some("n1"),
            "n1",
            Box::new(annotate("weft.dev/next-key", "{\"PublicKey\":\"next\"}"))
        ),
        allowed
    );
    let clear_network_unavailable = |n: &mut Value| {
        n["status"]["conditions"][1] =
            json!({"type": "NetworkUnavailable", "status": "False", "reason": "WeftIsUp"});
    };
    assert_eq!(
        weft(Some("n1"), "n1", Box::new(clear_network_unavailable)),
        allowed
    );
    let remove_own = |n: &mut Value| {
        n["metadata"]["annotations"]
            .as_object_mut()
            .unwrap()
            .remove("flannel.alpha.coreos.com/public-ip");
    };
    assert_eq!(weft(Some("n1"), "n1", Box::new(remove_own)), allowed);

    // What a compromised node must not do.
    let denied = |v: Option<String>, why: &str| {
        let v = v.expect("the policy must apply to weft");
        assert!(
            v.contains(why),
            "expected a denial containing {why:?}, got {v:?}"
        );
    };
    denied(
        weft(
            Some("n1"),
            "n2",
            Box::new(annotate(
                "flannel.alpha.coreos.com/public-ip-overwrite",
                "203.0.113.66",
            )),
        ),
        "only the Node it runs on",
    );
    denied(
        weft(
            None,
            "n1",
            Box::new(annotate(
                "flannel.alpha.coreos.com/public-ip",
                "203.0.113.66",
            )),
        ),
        "only the Node it runs on",
    );
    denied(
        weft(
            Some("n1"),
            "n1",
            Box::new(annotate("example.com/owner", "x")),
        ),
        "only flannel.alpha.coreos.com/ and weft.dev/ annotations",
    );
    let remove_foreign = |n: &mut Value| {
        n["metadata"]["annotations"]
            .as_object_mut()
            .unwrap()
            .remove("node.alpha.kubernetes.io/ttl");
    };
    denied(
        weft(Some("n1"), "n1", Box::new(remove_foreign)),
        "only flannel.alpha.coreos.com/ and weft.dev/ annotations",
    );
    denied(
        weft(
            Some("n1"),
            "n1",
            Box::new(|n: &mut Value| n["metadata"]["labels"]["role"] = json!("gateway")),
        ),
        "labels",
    );
    denied(
        weft(
            Some("n1"),
            "n1",
            Box::new(|n: &mut Value| n["spec"]["unschedulable"] = json!(true)),
        ),
        "spec",
    );
    denied(
        weft(
            Some("n1"),
            "n1",
            Box::new(|n: &mut Value| n["status"]["conditions"][0]["status"] = json!("False")),
        ),
        "NetworkUnavailable",
    );
    denied(
        weft(
            Some("n1"),
            "n1",
            Box::new(|n: &mut Value| {
                n["status"]["addresses"][0]["address"] = json!("203.0.113.66")
            }),
        ),
        "NetworkUnavailable",
    );

    // Anyone else is not this policy's business.
    for user in [
        "system:node:n1",
        "kubernetes-admin",
        "system:serviceaccount:kube-flannel:other",
    ] {
        let r = request(user, Some("n1"), "n2", annotate("example.com/owner", "x"));
        assert_eq!(verdict(&policy, &r), None, "{user}");
    }
}
