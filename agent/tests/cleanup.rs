//! `weft cleanup` on lab nodes whose agent has been stopped: everything weft made goes
//! (devices, the userspace device process and its socket, weft's routes, the nftables
//! tables, subnet.env), decoys that merely look like it stay (a tun `wg0` with a route of
//! another protocol inside the pod network (a /25, which no node's /24 lease can already
//! hold), another nftables table, another vxlan device,
//! another file in /run/flannel, another UAPI socket), a second run finds nothing, and it
//! refuses while an agent runs.

use weft_lab::lab::{Lab, LabConfig};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

const DECOYS: &str = "ip tuntap add wg0 mode tun && ip link set wg0 up \
    && ip route add 10.244.99.128/25 dev wg0 proto static \
    && ip link add vx-foreign type vxlan id 42 dstport 4789 dev eth0 \
    && nft add table ip filter \
    && nft add chain ip filter input '{ type filter hook input priority 0; }' \
    && nft add rule ip filter input counter \
    && mkdir -p /run/flannel /var/run/wireguard \
    && echo keep > /run/flannel/other.env && touch /var/run/wireguard/wg0.sock";

fn decoys_intact(lab: &Lab, i: usize) {
    let links = lab.on_node(i, "ip -o link show").unwrap();
    assert!(
        links.contains("wg0") && links.contains("vx-foreign"),
        "{links}"
    );
    let routes = lab.on_node(i, "ip route show 10.244.99.128/25").unwrap();
    assert!(routes.contains("proto static"), "{routes}");
    let tables = lab.on_node(i, "nft list tables").unwrap();
    assert!(tables.contains("table ip filter"), "{tables}");
    lab.on_node(
        i,
        "test -f /run/flannel/other.env && test -e /var/run/wireguard/wg0.sock",
    )
    .unwrap();
}

#[test]
fn cleanup_removes_what_weft_made_and_nothing_else() {
    let mut lab = Lab::start(LabConfig::wireguard(2, WEFT)).unwrap();
    lab.assert_all_pairs();
    lab.on_node(0, DECOYS).unwrap();

    // Refused while the agent runs.
    let err = lab.on_node(0, &format!("{WEFT} cleanup")).unwrap_err();
    assert!(format!("{err:#}").contains("a weft agent runs"), "{err:#}");

    lab.stop_agent(0, "TERM").unwrap();
    let before = lab.on_node(0, "ip route show proto 87").unwrap();
    assert!(before.contains("blackhole 10.244.0.0/16"), "{before}");
    let out = lab.on_node(0, &format!("{WEFT} cleanup")).unwrap();
    println!("weft cleanup:\n{out}");
    for expect in [
        "removed WireGuard device flannel-wg",
        "flannel-ipv4",
        "subnet.env",
        "blackhole",
    ] {
        assert!(
            out.contains(expect),
            "cleanup did not report {expect:?}:\n{out}"
        );
    }
    assert!(
        lab.on_node(0, "ip link show flannel-wg").is_err(),
        "flannel-wg is still there"
    );
    assert_eq!(lab.on_node(0, "ip route show proto 87").unwrap().trim(), "");
    let tables = lab.on_node(0, "nft list tables").unwrap();
    assert!(!tables.contains("flannel"), "{tables}");
    lab.on_node(
        0,
        "test ! -e /run/flannel/subnet.env && test ! -e /var/run/wireguard/flannel-wg.sock",
    )
    .unwrap();
    let ns = lab.nodes[0].ns.clone();
    let pids =
        weft_lab::lab::run(std::process::Command::new("ip").args(["netns", "pids", &ns])).unwrap();
    for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&cmd).contains("userspace-device"),
            "the userspace device process {pid} still runs"
        );
    }
    decoys_intact(&lab, 0);

    let again = lab.on_node(0, &format!("{WEFT} cleanup")).unwrap();
    assert!(again.starts_with("nothing to remove"), "{again}");
    decoys_intact(&lab, 0);
    // The other node is untouched.
    lab.on_node(1, "ip link show flannel-wg").unwrap();
}

#[test]
fn cleanup_removes_the_vxlan_device_and_its_entries() {
    let mut lab = Lab::start(LabConfig::backend(2, WEFT, "vxlan", false)).unwrap();
    lab.assert_all_pairs();
    lab.on_node(0, DECOYS).unwrap();
    lab.stop_agent(0, "TERM").unwrap();
    let fdb = lab.on_node(0, "bridge fdb show dev flannel.1").unwrap();
    assert!(!fdb.trim().is_empty());
    let out = lab.on_node(0, &format!("{WEFT} cleanup")).unwrap();
    assert!(out.contains("flannel.1"), "{out}");
    assert!(lab.on_node(0, "ip link show flannel.1").is_err());
    assert_eq!(lab.on_node(0, "ip route show proto 87").unwrap().trim(), "");
    assert_eq!(
        lab.on_node(0, "ip neigh show proxy; ip neigh show nud permanent")
            .unwrap()
            .trim(),
        ""
    );
    decoys_intact(&lab, 0);
    let again = lab.on_node(0, &format!("{WEFT} cleanup")).unwrap();
    assert!(again.starts_with("nothing to remove"), "{again}");
}
