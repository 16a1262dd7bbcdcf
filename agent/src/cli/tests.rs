//! Flag parsing: flannel's spellings, Go-style booleans, and the environment fallbacks.

use std::collections::HashMap;

use super::*;

fn parse(args: &[&str], env: &[(&str, &str)]) -> Result<AgentArgs, clap::Error> {
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let lookup = move |k: &str| env.get(k).cloned();
    let cli = Cli::parse_with_env(args.iter().map(Into::into), &lookup)?;
    match cli.command {
        Command::Agent(a) => Ok(*a),
        other => panic!("not the agent: {other:?}"),
    }
}

#[test]
fn flannel_daemonset_args_parse() {
    let a = parse(
        &[
            "weft",
            "agent",
            "--ip-masq",
            "--kube-subnet-mgr",
            "--iface=eth1",
            "--iface",
            "eth2",
        ],
        &[],
    )
    .unwrap();
    assert!(a.ip_masq && a.kube_subnet_mgr);
    assert_eq!(a.iface, ["eth1", "eth2"]);
    assert_eq!(a.subnet_file.to_str(), Some("/run/flannel/subnet.env"));
    assert_eq!(a.etcd_prefix, "/coreos.com/network");
}

#[test]
fn invoked_as_flanneld_runs_the_agent() {
    let a = parse(
        &[
            "/opt/bin/flanneld",
            "--ip-masq=false",
            "--etcd-endpoints=http://a:2379,http://b:2379",
        ],
        &[],
    )
    .unwrap();
    assert!(!a.ip_masq);
    assert_eq!(a.etcd_endpoints, ["http://a:2379", "http://b:2379"]);
}

#[test]
fn environment_fallbacks_in_order_cli_weft_flanneld() {
    let a = parse(
        &["weft", "agent"],
        &[
            ("FLANNELD_IP_MASQ", "true"),
            ("FLANNELD_IFACE", "eth9"),
            ("FLANNELD_ETCD_PREFIX", "/f"),
        ],
    )
    .unwrap();
    assert!(a.ip_masq);
    assert_eq!(
        (a.iface.as_slice(), a.etcd_prefix.as_str()),
        (["eth9".to_string()].as_slice(), "/f")
    );
    let a = parse(
        &["weft", "agent"],
        &[("FLANNELD_ETCD_PREFIX", "/f"), ("WEFT_ETCD_PREFIX", "/w")],
    )
    .unwrap();
    assert_eq!(a.etcd_prefix, "/w");
    let a = parse(
        &["weft", "agent", "--etcd-prefix=/cli"],
        &[("WEFT_ETCD_PREFIX", "/w")],
    )
    .unwrap();
    assert_eq!(a.etcd_prefix, "/cli");
    let a = parse(
        &["weft", "agent"],
        &[
            ("WEFT_PUBLIC_IP", "198.51.100.7"),
            ("WEFT_RESYNC_PERIOD", "5"),
        ],
    )
    .unwrap();
    assert_eq!(a.public_ip, Some("198.51.100.7".parse().unwrap()));
    assert_eq!(a.resync_period.as_secs(), 5);
    // flanneld's TLS flags, by their environment names too.
    let a = parse(
        &["weft", "agent", "--etcd-keyfile=/k.pem"],
        &[
            ("FLANNELD_ETCD_CAFILE", "/ca.pem"),
            ("WEFT_ETCD_CERTFILE", "/cert.pem"),
        ],
    )
    .unwrap();
    assert_eq!(
        (
            a.etcd.etcd_cafile.as_str(),
            a.etcd.etcd_certfile.as_str(),
            a.etcd.etcd_keyfile.as_str()
        ),
        ("/ca.pem", "/cert.pem", "/k.pem")
    );
}

#[test]
fn bad_values_name_the_flag() {
    let err = parse(&["weft", "agent", "--public-ip=300.1.1.1"], &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--public-ip") && err.contains("300.1.1.1"),
        "{err}"
    );
    let err = parse(&["weft", "agent"], &[("FLANNELD_HEALTHZ_PORT", "http")])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--healthz-port") && err.contains("http"),
        "{err}"
    );
    let err = parse(&["weft", "agent", "--no-such-flag"], &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("--no-such-flag"), "{err}");
}

#[test]
fn help_lists_both_environment_names() {
    let cmd = Cli::command().mut_subcommand("agent", |a| with_env_fallbacks(a, &|_| None));
    let help = cmd
        .find_subcommand("agent")
        .map(|a| a.clone().render_long_help().to_string())
        .unwrap_or_default();
    assert!(
        help.contains("[env: WEFT_IP_MASQ, FLANNELD_IP_MASQ]"),
        "{help}"
    );
}
