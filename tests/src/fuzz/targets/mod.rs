//! The parsers of outside data, each as a fuzz target: its seeds (valid inputs), tokens
//! (its own field names and values), the words one of which every error must hold, and a
//! 1 MB input it must refuse by size.

use std::collections::BTreeMap;

use weft::keys::psk;
use weft::registry::etcd::kv;
use weft::registry::kube::node::SlimNode;

use super::{Verdict, OVERSIZED};

mod control;
mod files;

/// A parser under test: bytes in, what it made of them out.
pub type Parse = Box<dyn Fn(&[u8]) -> Verdict>;

pub struct Target {
    pub name: &'static str,
    pub words: &'static [&'static str],
    pub tokens: &'static [&'static str],
    pub seeds: fn() -> Vec<Vec<u8>>,
    pub oversized: fn() -> Vec<u8>,
    pub parse: Parse,
}

fn verdict<T, E: std::fmt::Display>(r: Result<T, E>) -> Verdict {
    match r {
        Ok(_) => Verdict::Accepted,
        Err(e) => Verdict::Refused(e.to_string()),
    }
}

fn text(input: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(input)
}

/// `before`, then 1 MB of `fill`, then `after`.
fn big(before: &str, fill: u8, after: &str) -> Vec<u8> {
    let mut v = before.as_bytes().to_vec();
    v.resize(v.len() + OVERSIZED, fill);
    v.extend_from_slice(after.as_bytes());
    v
}

fn seeds_of(list: &[&str]) -> Vec<Vec<u8>> {
    list.iter().map(|s| s.as_bytes().to_vec()).collect()
}

const KEY: &str = "6cbaN2lXHDb4Ct1qce3ldikADzLRKuAS6oDLw5M+QzI=";
const PREFIX: &str = "flannel.alpha.coreos.com";

/// Every target.
pub fn all() -> Vec<Target> {
    let mut targets = vec![
        net_conf_target(),
        etcd_lease_target(),
        node_annotations_target(),
        cni_stdin_target(),
        cni_env_target(),
        subnet_env_target(),
        uapi_answer_target(),
        psk_etcd_target(),
    ];
    targets.extend(files::targets());
    targets.push(control::target());
    targets
}

fn net_conf_target() -> Target {
    Target {
        name: "net-conf",
        words: &[
            "Network",
            "Backend",
            "Subnet",
            "IPv6",
            "IPv4",
            "Type",
            "Port",
            "VNI",
            "PSK",
            "MTU",
            "Mode",
            "JSON",
            "net-conf",
            "config",
            "Directrouting",
            "DirectRouting",
            "PersistentKeepaliveInterval",
            "Implementation",
            "bytes",
        ],
        tokens: &[
            "\"Network\"",
            "\"Backend\"",
            "\"Type\"",
            "\"wireguard\"",
            "\"vxlan\"",
            "\"host-gw\"",
            "\"SubnetLen\"",
            "\"SubnetMin\"",
            "\"SubnetMax\"",
            "\"EnableIPv6\"",
            "\"EnableIPv4\"",
            "\"IPv6Network\"",
            "\"ListenPort\"",
            "\"VNI\"",
            "\"Port\"",
            "\"PSK\"",
            "\"DirectRouting\"",
            "\"Mode\"",
            "\"separate\"",
            "\"MTU\"",
            "\"10.244.0.0/16\"",
            "\"fd00::/56\"",
            "\"PersistentKeepaliveInterval\"",
        ],
        seeds: || {
            seeds_of(&[
                r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#,
                r#"{"Network": "10.244.0.0/16", "SubnetLen": 24, "SubnetMin": "10.244.1.0", "SubnetMax": "10.244.200.0", "EnableIPv6": true, "IPv6Network": "fd00:10:244::/56", "IPv6SubnetLen": 64, "Backend": {"Type": "wireguard", "ListenPort": 51820, "PSK": "6cbaN2lXHDb4Ct1qce3ldikADzLRKuAS6oDLw5M+QzI=", "PersistentKeepaliveInterval": 25, "Mode": "separate", "MTU": 1420}}"#,
                r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan", "VNI": 1, "Port": 8472, "DirectRouting": true, "GBP": false, "MTU": 1450}}"#,
                r#"{"Network": "10.244.0.0/16", "EnableNFTables": true, "Backend": {"Type": "host-gw"}}"#,
            ])
        },
        oversized: || {
            big(
                r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "Note": ""#,
                b'a',
                r#""}}"#,
            )
        },
        parse: Box::new(|i| verdict(weft_backends::netconf::parse(&text(i)))),
    }
}

fn etcd_lease_target() -> Target {
    Target {
        name: "etcd-lease",
        words: &["/coreos.com/network/subnets/", "key", "lease"],
        tokens: &[
            "\"PublicIP\"",
            "\"PublicIPv6\"",
            "\"BackendType\"",
            "\"BackendData\"",
            "\"BackendV6Data\"",
            "\"PublicKey\"",
            "\"VtepMAC\"",
            "\"WeftNextKey\"",
            "\"SwitchAt\"",
            "\"Generation\"",
            "\"WeftEndpoints\"",
            "10.244.1.0-24",
            "fd00::-64",
            "&",
        ],
        seeds: || {
            seeds_of(&[
            &format!("/coreos.com/network/subnets/10.244.1.0-24\n{{\"PublicIP\":\"198.51.100.1\",\"BackendType\":\"wireguard\",\"BackendData\":{{\"PublicKey\":\"{KEY}\",\"Port\":51820}}}}"),
            &format!("/coreos.com/network/subnets/10.244.2.0-24\n{{\"PublicIP\":\"198.51.100.2\",\"BackendType\":\"wireguard\",\"BackendData\":{{\"PublicKey\":\"{KEY}\"}},\"WeftNextKey\":{{\"PublicKey\":\"{KEY}\",\"SwitchAt\":4000000000000,\"Generation\":2}}}}"),
            "/coreos.com/network/subnets/10.244.3.0-24\n{\"PublicIP\":\"198.51.100.3\",\"BackendType\":\"vxlan\",\"BackendData\":{\"VNI\":1,\"VtepMAC\":\"0a:00:00:00:00:03\"}}",
            "/coreos.com/network/subnets/10.244.4.0-24&fd00:10:244:4::-64\n{\"PublicIP\":\"198.51.100.4\",\"PublicIPv6\":\"2001:db8::4\",\"BackendType\":\"host-gw\"}",
        ])
        },
        oversized: || {
            big("/coreos.com/network/subnets/10.244.1.0-24\n{\"PublicIP\":\"198.51.100.1\",\"BackendType\":\"host-gw\",\"X\":\"", b'a', "\"}")
        },
        parse: Box::new(|i| {
            let (key, value) = split_once(i, b'\n');
            verdict(kv::parse_lease("/coreos.com/network/subnets/", key, value))
        }),
    }
}

fn node_annotations_target() -> Target {
    Target {
        name: "node-annotations",
        words: &["node n1", "annotation", PREFIX, "spec.podCIDR"],
        tokens: &[
            "\"PublicKey\"",
            "\"VtepMAC\"",
            "\"VNI\"",
            "\"internal\"",
            "\"external\"",
            "wireguard",
            "vxlan",
            "host-gw",
            "198.51.100.1",
            "2001:db8::1",
            "10.244.1.0/24",
            "\"Port\"",
            "\"SwitchAt\"",
        ],
        seeds: || {
            seeds_of(&[
            &format!("10.244.1.0/24\nwireguard\n{{\"PublicKey\":\"{KEY}\",\"Port\":51820}}\n198.51.100.1\n\n{{\"internal\":\"10.0.1.5\",\"external\":\"203.0.113.5\"}}\n{{\"PublicKey\":\"{KEY}\",\"SwitchAt\":4000000000000,\"Generation\":2}}\n2001:db8::1"),
            "10.244.2.0/24\nvxlan\n{\"VNI\":1,\"VtepMAC\":\"0a:00:00:00:00:02\"}\n198.51.100.2\n198.51.100.9\n\n\n",
            "10.244.3.0/24\nhost-gw\nnull\n198.51.100.3\n\n{}\n\n",
        ])
        },
        oversized: || {
            big(
                &format!("10.244.1.0/24\nwireguard\n{{\"PublicKey\":\"{KEY}\",\"X\":\""),
                b'a',
                "\"}\n198.51.100.1",
            )
        },
        parse: Box::new(node_annotations),
    }
}

fn cni_stdin_target() -> Target {
    Target {
        name: "cni-stdin",
        words: &[
            "cniVersion",
            "name",
            "type",
            "delegate",
            "subnetFile",
            "dataDir",
            "network configuration",
            "stdin",
            "JSON",
            "bytes",
            "runtimeConfig",
            "ipam",
            "prevResult",
            "agentSocket",
            "cni.dev/valid-attachments",
        ],
        tokens: &[
            "\"cniVersion\"",
            "\"1.0.0\"",
            "\"0.3.1\"",
            "\"name\"",
            "\"type\"",
            "\"flannel\"",
            "\"delegate\"",
            "\"hairpinMode\"",
            "\"isDefaultGateway\"",
            "\"subnetFile\"",
            "\"dataDir\"",
            "\"ipam\"",
            "\"runtimeConfig\"",
            "\"prevResult\"",
            "\"1.1.0\"",
            "\"agentSocket\"",
            "\"cni.dev/valid-attachments\"",
            "\"containerID\"",
            "\"ifname\"",
        ],
        seeds: || {
            seeds_of(&[
                r#"{"cniVersion": "1.0.0", "name": "cbr0", "type": "flannel", "delegate": {"hairpinMode": true, "isDefaultGateway": true}}"#,
                r#"{"cniVersion": "1.1.0", "name": "cbr0", "type": "flannel", "agentSocket": "/run/weft/weft.sock", "cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "eth0"}]}"#,
                r#"{"cniVersion": "0.3.1", "name": "cbr0", "type": "flannel", "subnetFile": "/run/flannel/subnet.env", "dataDir": "/var/lib/cni/flannel", "delegate": {"type": "bridge"}, "runtimeConfig": {"portMappings": []}}"#,
            ])
        },
        oversized: || {
            big(
                r#"{"cniVersion": "1.0.0", "name": "cbr0", "type": "flannel", "x": ""#,
                b'a',
                r#""}"#,
            )
        },
        // The config, and GC's list of valid attachments when it has one.
        parse: Box::new(|i| {
            use weft::cni::gc::{valid_attachments, VALID_ATTACHMENTS};
            if let Err(e) = weft::cni::conf::PluginConf::parse(i) {
                return Verdict::Refused(e.msg);
            }
            let doc: serde_json::Value = serde_json::from_slice(i).unwrap_or_default();
            if doc.get(VALID_ATTACHMENTS).is_none() {
                return Verdict::Accepted;
            }
            match valid_attachments(&doc) {
                Ok(_) => Verdict::Accepted,
                Err(e) => Verdict::Refused(e.msg),
            }
        }),
    }
}

fn cni_env_target() -> Target {
    Target {
        name: "cni-env",
        words: &["CNI_"],
        tokens: &[
            "CNI_COMMAND=",
            "ADD",
            "DEL",
            "CHECK",
            "VERSION",
            "GC",
            "STATUS",
            "CNI_CONTAINERID=",
            "CNI_NETNS=",
            "CNI_IFNAME=",
            "CNI_PATH=",
            "CNI_ARGS=",
            "../",
            "/var/run/netns/x",
        ],
        seeds: || {
            seeds_of(&[
            "CNI_COMMAND=ADD\nCNI_CONTAINERID=abc123\nCNI_NETNS=/var/run/netns/p1\nCNI_IFNAME=eth0\nCNI_PATH=/opt/cni/bin",
            "CNI_COMMAND=DEL\nCNI_CONTAINERID=abc-1.2_x\nCNI_IFNAME=eth0\nCNI_PATH=/opt/cni/bin:/usr/lib/cni",
            "CNI_COMMAND=VERSION",
        ])
        },
        oversized: || {
            big(
                "CNI_COMMAND=ADD\nCNI_CONTAINERID=",
                b'a',
                "\nCNI_NETNS=/x\nCNI_IFNAME=eth0\nCNI_PATH=/x",
            )
        },
        parse: Box::new(|i| {
            let env: BTreeMap<String, String> = text(i)
                .lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            match weft::cni::Invocation::from_env(&|k| env.get(k).cloned(), Vec::new()) {
                Ok(_) => Verdict::Accepted,
                Err(e) => Verdict::Refused(e.msg),
            }
        }),
    }
}

fn subnet_env_target() -> Target {
    Target {
        name: "subnet-env",
        words: &["FLANNEL_", "line", "bytes"],
        tokens: &[
            "FLANNEL_NETWORK=",
            "FLANNEL_SUBNET=",
            "FLANNEL_IPV6_NETWORK=",
            "FLANNEL_IPV6_SUBNET=",
            "FLANNEL_MTU=",
            "FLANNEL_IPMASQ=",
            "true",
            "10.244.0.0/16",
            "10.244.1.1/24",
            ",",
        ],
        seeds: || {
            seeds_of(&[
            "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\nFLANNEL_MTU=1420\nFLANNEL_IPMASQ=true\n",
            "FLANNEL_NETWORK=10.244.0.0/16,10.245.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\nFLANNEL_IPV6_NETWORK=fd00::/56\nFLANNEL_IPV6_SUBNET=fd00:0:0:1::1/64\nFLANNEL_MTU=1450\nFLANNEL_IPMASQ=false\n",
        ])
        },
        oversized: || {
            big(
                "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\nFLANNEL_MTU=1",
                b'0',
                "\n",
            )
        },
        parse: Box::new(|i| verdict(weft::cni::conf::SubnetEnv::parse(&text(i)))),
    }
}

fn uapi_answer_target() -> Target {
    Target {
        name: "uapi-answer",
        words: &["line", "errno", "bytes"],
        tokens: &[
            "private_key=",
            "listen_port=",
            "fwmark=",
            "public_key=",
            "preshared_key=",
            "endpoint=",
            "allowed_ip=",
            "last_handshake_time_sec=",
            "last_handshake_time_nsec=",
            "rx_bytes=",
            "tx_bytes=",
            "persistent_keepalive_interval=",
            "protocol_version=",
            "errno=",
            "[::1]:51820",
            "0000000000000000000000000000000000000000000000000000000000000000",
        ],
        seeds: || {
            seeds_of(&[
            "private_key=e84b5a6d2717c1003a13b431570353dbaca9146cf150c5f8575680feba52027a\nlisten_port=51820\nfwmark=0\npublic_key=b85996fecc9c7f1fc6d2572a76eda11d59bcd20be8e543b15ce4bd85a8e75a33\npreshared_key=0000000000000000000000000000000000000000000000000000000000000000\nendpoint=198.51.100.2:51820\nlast_handshake_time_sec=1700000000\nlast_handshake_time_nsec=5\ntx_bytes=100\nrx_bytes=200\npersistent_keepalive_interval=25\nallowed_ip=10.244.2.0/24\nallowed_ip=fd00::/64\nprotocol_version=1\nerrno=0\n\n",
            "errno=0\n\n",
            "listen_port=51820\nerrno=0\n\n",
        ])
        },
        oversized: || {
            big("listen_port=51820\npublic_key=b85996fecc9c7f1fc6d2572a76eda11d59bcd20be8e543b15ce4bd85a8e75a33\nendpoint=", b'1', "\nerrno=0\n\n")
        },
        parse: Box::new(|i| verdict(weft_backends::apply::wireguard::uapi::parse_get(&text(i)))),
    }
}

fn psk_etcd_target() -> Target {
    Target {
        name: "psk-etcd",
        words: &["PSK", "NextPSK", "SwitchAt", "bytes"],
        tokens: &[
            "\"PSK\"",
            "\"NextPSK\"",
            "\"SwitchAt\"",
            KEY,
            "4000000000000",
        ],
        seeds: || {
            seeds_of(&[
                &format!("{{\"PSK\": \"{KEY}\"}}"),
                &format!(
                    "{{\"PSK\": \"{KEY}\", \"NextPSK\": \"{KEY}\", \"SwitchAt\": 4000000000000}}"
                ),
            ])
        },
        oversized: || big("{\"PSK\": \"", b'A', "\"}"),
        parse: Box::new(|i| verdict(psk::parse_etcd(&text(i)))),
    }
}

fn split_once(i: &[u8], at: u8) -> (&[u8], &[u8]) {
    match i.iter().position(|&b| b == at) {
        Some(p) => (&i[..p], &i[p + 1..]),
        None => (i, &[]),
    }
}

/// Lines as a Node's pod CIDR and annotations, in this order.
const ANNOTATED: &[&str] = &[
    "backend-type",
    "backend-data",
    "public-ip",
    "public-ip-overwrite",
    "weft.dev/endpoints",
    "weft.dev/next-key",
    "public-ipv6",
    "backend-v6-data",
    "weft.dev/zone",
];

fn node_annotations(i: &[u8]) -> Verdict {
    let text = text(i);
    let mut lines = text.split('\n');
    let cidr = lines.next().unwrap_or_default();
    let mut annotations = serde_json::Map::new();
    annotations.insert(format!("{PREFIX}/kube-subnet-manager"), "true".into());
    for (name, value) in ANNOTATED.iter().zip(lines) {
        let key = match name.starts_with("weft.dev/") {
            true => name.to_string(),
            false => format!("{PREFIX}/{name}"),
        };
        if !value.is_empty() {
            annotations.insert(key, value.into());
        }
    }
    let node = serde_json::json!({
        "metadata": {"name": "n1", "annotations": annotations, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"podCIDR": cidr},
    });
    match serde_json::from_value::<SlimNode>(node) {
        Ok(node) => {
            let _ = node.zone();
            verdict(node.lease(PREFIX))
        }
        Err(e) => Verdict::Refused(format!("node n1: {e}")),
    }
}
