//! Table tests: every `config check` error the issue names, with the exact message an
//! operator sees, plus the defaults flannel's configs rely on.

use super::*;

fn errors(text: &str) -> Vec<String> {
    match parse(text) {
        Ok(conf) => panic!("expected errors for {text}, got {conf:?}"),
        Err(ConfigErrors(errs)) => errs.iter().map(ToString::to_string).collect(),
    }
}

#[test]
fn each_bad_input_names_key_value_and_what_is_valid() {
    let cases: &[(&str, &str)] = &[
        (r#"{"Network": "10.244.0.0/16", "Netwrok": 1}"#,
         "unknown key `Netwrok` (did you mean `Network`?); valid keys: Network, IPv6Network, EnableIPv4, EnableIPv6, SubnetLen, SubnetMin, SubnetMax, IPv6SubnetLen, IPv6SubnetMin, IPv6SubnetMax, EnableNFTables, Backend"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "ListenPrt": 1}}"#,
         "unknown key `Backend.ListenPrt` (did you mean `ListenPort`?); valid keys in Backend: Type, ListenPort, ListenPortV6, MTU, PSK, PersistentKeepaliveInterval, Mode, Implementation, PostQuantum, RefuseClear"),
        (r#"{"Network": "10.244.0.0/33"}"#,
         "`Network` = \"10.244.0.0/33\": not a CIDR; expected an IPv4 network such as \"10.244.0.0/16\""),
        (r#"{"Network": "ten.244/16"}"#,
         "`Network` = \"ten.244/16\": not a CIDR; expected an IPv4 network such as \"10.244.0.0/16\""),
        (r#"{"Network": "fd00::/48"}"#,
         "`Network` = \"fd00::/48\": an IPv6 network, but `Network` takes IPv4; put it in `IPv6Network` (and set `EnableIPv6` to true)"),
        (r#"{"EnableIPv6": true, "Network": "10.244.0.0/16", "IPv6Network": "10.245.0.0/16"}"#,
         "`IPv6Network` = \"10.245.0.0/16\": an IPv4 network, but `IPv6Network` takes IPv6; put it in `Network` (and set `EnableIPv4` to true)"),
        (r#"{"Network": "10.244.0.0/16", "SubnetLen": 17}"#,
         "`SubnetLen` = 17: valid for Network 10.244.0.0/16: /18 (so it holds at least four subnets) to /30"),
        (r#"{"Network": "10.244.0.0/16", "SubnetLen": 31}"#,
         "`SubnetLen` = 31: valid for Network 10.244.0.0/16: /18 (so it holds at least four subnets) to /30"),
        (r#"{"EnableIPv6": true, "Network": "10.244.0.0/16", "IPv6Network": "fd00::/56", "IPv6SubnetLen": 127}"#,
         "`IPv6SubnetLen` = 127: valid for IPv6Network fd00::/56: /58 (so it holds at least four subnets) to /126"),
        (r#"{"Network": "10.244.0.0/16", "SubnetMin": "10.245.1.0"}"#,
         "`SubnetMin` = \"10.245.1.0\": outside Network 10.244.0.0/16"),
        (r#"{"Network": "10.244.0.0/16", "SubnetMax": "10.0.0.0"}"#,
         "`SubnetMax` = \"10.0.0.0\": outside Network 10.244.0.0/16"),
        (r#"{"Network": "10.244.0.0/16", "SubnetMin": "10.244.3.7"}"#,
         "`SubnetMin` = \"10.244.3.7\": not the start of a /24 subnet; did you mean \"10.244.3.0\"?"),
        (r#"{"Network": "10.244.0.0/16", "SubnetMin": "10.244.9.0", "SubnetMax": "10.244.2.0"}"#,
         "`SubnetMin` = \"10.244.9.0\": is above `SubnetMax` \"10.244.2.0\": the range is reversed; swap them"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "PSK": "c2hvcnQ="}}"#,
         "`Backend.PSK` = <8 characters, not shown>: decodes to 5 bytes, but a WireGuard key is exactly 32 bytes (44 base64 characters); generate one with `weft keys psk` or `wg genpsk`"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "PSK": "not base64 at all!!"}}"#,
         "`Backend.PSK` = <19 characters, not shown>: not valid base64 (Invalid symbol 32, offset 3.); a WireGuard key is 44 characters of standard base64, as printed by `wg genkey`; generate one with `weft keys psk` or `wg genpsk`"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "geneve"}}"#,
         "`Backend.Type` = \"geneve\": unknown backend type \"geneve\"; valid types: wireguard, vxlan, host-gw, ipip, ipsec"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "udp"}}"#,
         "`Backend.Type` = \"udp\": flannel's `udp` backend is not implemented by weft; valid types: wireguard, vxlan, host-gw, ipip, ipsec (wireguard and ipsec encrypt, vxlan, host-gw and ipip do not)"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipip", "DirectRouting": "yes"}}"#,
         "`Backend.DirectRouting` = \"yes\": expected true or false"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipip", "VNI": 1}}"#,
         "unknown key `Backend.VNI`; valid keys in Backend: Type, DirectRouting, MTU"),
        (r#"{"Network": "10.244.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00::/56", "Backend": {"Type": "ipip"}}"#,
         "`Backend.Type` = \"ipip\": ipip carries IPv4 only (as flannel's): with EnableIPv6, or EnableIPv4 false, use wireguard, vxlan or host-gw"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "PSK": "too short"}}"#,
         "`Backend.PSK` = <9 characters, not shown>: an ipsec PSK must be at least 96 characters (flannel's rule); generate one with `openssl rand -hex 48`"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "UDPEncap": "yes"}}"#,
         "`Backend.UDPEncap` = \"yes\": expected true or false"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "ESPProposal": "aes128-sha256-modp2048"}}"#,
         "`Backend.ESPProposal` = \"aes128-sha256-modp2048\": valid: aes128gcm16…, aes256gcm16…, chacha20poly1305… (a strongSwan ESP proposal such as \"aes128gcm16-sha256-prfsha256-ecp256\"; the first word picks the algorithm)"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "MTU": 100}}"#,
         "`Backend.MTU` = 100: out of range for an IPv4 underlay MTU; valid: 576–65535"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "RekeyAfter": 5}}"#,
         "`Backend.RekeyAfter` = 5: out of range for seconds after which a node starts a new epoch by itself; valid: 10–4294967295"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "VNI": 1}}"#,
         "unknown key `Backend.VNI`; valid keys in Backend: Type, PSK, UDPEncap, ESPProposal, MTU, RekeyAfter, PostQuantum, RefuseClear"),
        (r#"{"Network": "10.244.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00::/56", "Backend": {"Type": "ipsec"}}"#,
         "`Backend.Type` = \"ipsec\": ipsec carries IPv4 only (as flannel's): with EnableIPv6, or EnableIPv4 false, use wireguard, vxlan or host-gw"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "Mode": "both"}}"#,
         "`Backend.Mode` = \"both\": valid: separate, auto, ipv4, ipv6"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "Implementation": "ebpf"}}"#,
         "`Backend.Implementation` = \"ebpf\": valid: auto, kernel, userspace"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "PostQuantum": "yes"}}"#,
         "`Backend.PostQuantum` = \"yes\": expected true or false"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec", "PostQuantum": 1}}"#,
         "`Backend.PostQuantum` = 1: expected true or false"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan", "PostQuantum": true}}"#,
         "unknown key `Backend.PostQuantum`; valid keys in Backend: Type, VNI, Port, GBP, Learning, DirectRouting, MTU"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "ListenPort": 70000}}"#,
         "`Backend.ListenPort` = 70000: out of range for a UDP port; valid: 1–65535"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "ListenPortV6": 0}}"#,
         "`Backend.ListenPortV6` = 0: out of range for a UDP port; valid: 1–65535"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan", "Port": -1}}"#,
         "`Backend.Port` = -1: out of range for a UDP port (0 = kernel default); valid: 0–65535"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "ListenPort": "51820"}}"#,
         "`Backend.ListenPort` = \"51820\": expected a whole number (a UDP port, 1–65535)"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard", "MTU": 500}}"#,
         "`Backend.MTU` = 500: out of range for an IPv4 underlay MTU; valid: 576–65535"),
        (r#"{"EnableIPv6": true, "Network": "10.244.0.0/16", "IPv6Network": "fd00::/56", "Backend": {"Type": "vxlan", "MTU": 1200}}"#,
         "`Backend.MTU` = 1200: out of range for an underlay MTU with IPv6 enabled (IPv6 needs at least 1280); valid: 1280–65535"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan", "VNI": 16777216}}"#,
         "`Backend.VNI` = 16777216: out of range for a VXLAN network identifier; valid: 0–16777215"),
        (r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "host-gw", "VNI": 1}}"#,
         "unknown key `Backend.VNI`; valid keys in Backend: Type"),
        ("{\n  \"Network\": \"10.244.0.0/16\",\n  \"Backend\": {\"Type\": \"wireguard\",}\n}",
         "invalid JSON at line 3, column 35: trailing comma"),
        (r#"{"Backend": {"Type": "wireguard"}}"#,
         "`Network` is required: `EnableIPv4` is true (the default); give the pod network as a CIDR such as \"10.244.0.0/16\", or set EnableIPv4 to false for an IPv6-only cluster"),
        (r#"{"EnableIPv4": false, "EnableIPv6": true}"#,
         "`IPv6Network` is required: `EnableIPv6` is true; give the pod network as a CIDR such as \"fd00:10:244::/56\""),
        (r#"{"Network": "10.244.0.0/16", "EnableIPv6": "yes"}"#,
         "`EnableIPv6` = \"yes\": expected true or false"),
        (r#"["10.244.0.0/16"]"#,
         "`(top level)` = [\"10.244.0.0/16\"]: net-conf.json must be a JSON object such as {\"Network\": \"10.244.0.0/16\", \"Backend\": {\"Type\": \"wireguard\"}}"),
    ];
    for (input, expected) in cases {
        let got = errors(input);
        assert_eq!(got, vec![expected.to_string()], "input: {input}");
    }
}

#[test]
fn reports_every_problem_at_once() {
    let got = errors(
        r#"{"Network": "10.244.0.0/33", "Colour": "blue",
            "Backend": {"Type": "wireguard", "ListenPort": 0, "Mode": "x", "PSK": ""}}"#,
    );
    assert_eq!(got.len(), 5, "{got:#?}");
    let keys: Vec<_> =
        parse(r#"{"Network": "x", "Backend": {"Type": "vxlan", "VNI": -1, "GBP": 1}}"#)
            .unwrap_err()
            .0
            .iter()
            .map(|e| e.key().to_string())
            .collect();
    assert_eq!(keys, ["Network", "Backend.VNI", "Backend.GBP"]);
}

#[test]
fn flannel_minimal_config_gets_defaults() {
    let conf = parse(r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#).unwrap();
    let v4 = conf.ipv4.unwrap();
    assert_eq!(v4.network.to_string(), "10.244.0.0/16");
    assert_eq!(v4.subnet_len, 24);
    assert_eq!(v4.subnet_min.to_string(), "10.244.1.0");
    assert_eq!(v4.subnet_max.to_string(), "10.244.255.0");
    assert!(conf.ipv6.is_none());
    assert!(!conf.enable_nftables);
    let Backend::Wireguard(wg) = conf.backend else {
        panic!("not wireguard")
    };
    assert_eq!((wg.listen_port, wg.listen_port_v6), (51820, 51821));
    assert_eq!((wg.mtu, wg.persistent_keepalive), (None, 0));
    assert_eq!(
        (wg.mode, wg.implementation),
        (WireguardMode::Separate, Implementation::Auto)
    );
    assert!(wg.psk.is_none());
}

#[test]
fn missing_backend_means_wireguard() {
    let conf = parse(r#"{"Network": "10.244.0.0/16"}"#).unwrap();
    assert_eq!(conf.backend.kind(), BackendKind::Wireguard);
}

#[test]
fn go_style_case_insensitive_keys_and_host_bits_are_accepted() {
    let conf = parse(r#"{"network": "10.244.7.0/16", "backend": {"type": "VXLAN", "vni": 4, "directRouting": true}}"#).unwrap();
    assert_eq!(conf.ipv4.unwrap().network.to_string(), "10.244.0.0/16");
    assert_eq!(
        conf.backend,
        Backend::Vxlan(VxlanConf {
            vni: 4,
            port: 0,
            gbp: false,
            learning: false,
            direct_routing: true,
            mtu: None
        })
    );
}

#[test]
fn dual_stack_and_custom_ranges() {
    let conf = parse(
        r#"{"Network": "10.244.0.0/16", "SubnetLen": 26, "SubnetMin": "10.244.0.64", "SubnetMax": "10.244.10.192",
            "EnableIPv6": true, "IPv6Network": "fd00:10:244::/56",
            "Backend": {"Type": "wireguard", "PSK": "FpCyhws9cxwWoV4xELtfJvjJN+zQVRPISllRWgeopVE=",
                        "PersistentKeepaliveInterval": 25, "Mode": "auto", "Implementation": "userspace", "MTU": 9000}}"#,
    )
    .unwrap();
    let v4 = conf.ipv4.unwrap();
    assert_eq!(
        (
            v4.subnet_len,
            v4.subnet_min.to_string(),
            v4.subnet_max.to_string()
        ),
        (26, "10.244.0.64".into(), "10.244.10.192".into())
    );
    let v6 = conf.ipv6.unwrap();
    assert_eq!(
        (v6.subnet_len, v6.subnet_min.to_string()),
        (64, "fd00:10:244:1::".into())
    );
    let Backend::Wireguard(wg) = &conf.backend else {
        panic!()
    };
    assert!(wg.psk.is_some());
    assert_eq!(
        (wg.persistent_keepalive, wg.mode, wg.mtu),
        (25, WireguardMode::Auto, Some(9000))
    );
    assert_eq!(wg.post_quantum, POST_QUANTUM_DEFAULT);
}

#[test]
fn post_quantum_is_a_switch_of_the_encrypting_backends() {
    for (backend, on) in [
        ("wireguard", true),
        ("wireguard", false),
        ("ipsec", true),
        ("ipsec", false),
    ] {
        let conf = parse(&format!(
            r#"{{"Network": "10.244.0.0/16", "Backend": {{"Type": "{backend}", "PostQuantum": {on}}}}}"#
        ))
        .unwrap();
        let got = match &conf.backend {
            Backend::Wireguard(w) => w.post_quantum,
            Backend::Ipsec(i) => i.post_quantum,
            other => panic!("{other:?}"),
        };
        assert_eq!(got, on, "{backend}");
    }
}

#[test]
fn effective_config_round_trips_and_hides_the_psk() {
    let text =
        r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan", "DirectRouting": true}}"#;
    let conf = parse(text).unwrap();
    let printed = conf.to_string();
    assert_eq!(parse(&printed).unwrap(), conf, "{printed}");
    let secret = "FpCyhws9cxwWoV4xELtfJvjJN+zQVRPISllRWgeopVE=";
    let wg = parse(&format!(
        r#"{{"Network": "10.244.0.0/16", "Backend": {{"PSK": "{secret}"}}}}"#
    ))
    .unwrap();
    assert!(!wg.to_string().contains(&secret[..10]));
}

#[test]
fn ipsec_takes_flannels_keys_and_maps_the_proposal() {
    let psk = "p".repeat(96);
    let text = format!(
        r#"{{"Network": "10.244.0.0/16", "Backend": {{"Type": "ipsec", "PSK": "{psk}", "UDPEncap": true, "ESPProposal": "AES256GCM16-sha256-prfsha256-ecp256", "MTU": 1400}}}}"#
    );
    let conf = parse(&text).unwrap();
    let Backend::Ipsec(i) = &conf.backend else {
        panic!("{conf:?}")
    };
    assert_eq!(i.psk.as_ref().map(|p| p.0.len()), Some(96));
    assert!(i.udp_encap);
    assert_eq!(i.algorithm, EspAlgorithm::Aes256Gcm);
    assert_eq!(
        (i.algorithm.kernel_name(), i.algorithm.key_len()),
        ("rfc4106(gcm(aes))", 36)
    );
    assert_eq!(i.mtu, Some(1400));
    assert!(!format!("{conf:?}").contains(&psk), "the PSK never prints");
    assert!(!conf.to_json().to_string().contains(&psk));
    // flannel's default proposal is AES-128-GCM.
    let conf = parse(r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "ipsec"}}"#).unwrap();
    let Backend::Ipsec(i) = &conf.backend else {
        panic!("{conf:?}")
    };
    assert_eq!(
        (i.algorithm, i.psk.is_none(), i.udp_encap),
        (EspAlgorithm::Aes128Gcm, true, false)
    );
    let chacha = EspAlgorithm::from_proposal("chacha20poly1305").unwrap();
    assert_eq!(
        (chacha.kernel_name(), chacha.key_len()),
        ("rfc7539esp(chacha20,poly1305)", 36)
    );
    assert!(conf.backend.kind().encrypts());
}
