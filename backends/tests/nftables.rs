//! The nftables reconciler against the real `nft` in a fresh network namespace per test:
//! the masquerade set lands exactly as docs/architecture.md orders it, a second pass writes nothing, a
//! flushed or deleted table comes back, other tables are never touched, and turning
//! masquerading off removes only weft's tables. A round lists which tables exist once, and a
//! table made or deleted behind it is still found.

use weft_backends::apply::{reconcile_nft, Nft, NftCli};
use weft_backends::model::MasqueradeTable;
use weft_lab::fixtures::{lease, plan_of};
use weft_lab::netns::{in_new_netns, sh};

fn tables(conf: &str) -> Vec<MasqueradeTable> {
    let mut me = lease("node-a", "10.244.1.0/24", "198.51.100.1", 1);
    me.subnet_v6 = Some("fd00:10:244:1::/64".parse().unwrap());
    plan_of(conf, &me, vec![]).masquerade
}

const V4: &str = r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}"#;
const DUAL: &str = r#"{"Network": "10.244.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00:10:244::/48", "Backend": {"Type": "wireguard"}}"#;

const EXPECTED_V4: &str = "table ip flannel-ipv4 {
	chain postrtg {
		type nat hook postrouting priority srcnat; policy accept;
		meta mark & 0x00004000 == 0x00004000 return
		ip saddr 10.244.1.0/24 ip daddr 10.244.0.0/16 return
		ip saddr 10.244.0.0/16 ip daddr 10.244.1.0/24 return
		ip saddr != 10.244.0.0/16 ip daddr 10.244.1.0/24 return
		ip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade fully-random
		ip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade fully-random
	}

	chain forward {
		type filter hook forward priority filter; policy accept;
		ip saddr 10.244.0.0/16 accept
		ip daddr 10.244.0.0/16 accept
	}
}
";

#[test]
fn lands_in_design_order_and_a_second_pass_writes_nothing() {
    in_new_netns(|| async {
        let mut nft = NftCli::default();
        let want = tables(DUAL);
        let report = reconcile_nft(&mut nft, &want).await.unwrap();
        assert!(report.failed.is_empty(), "{:?}", report.failed);
        assert_eq!(
            report.applied,
            [
                "replace nftables table ip flannel-ipv4",
                "replace nftables table ip6 flannel-ipv6"
            ]
        );
        assert_eq!(sh("nft list table ip flannel-ipv4"), EXPECTED_V4);
        let v6 = sh("nft list table ip6 flannel-ipv6");
        assert!(
            v6.contains("ip6 saddr fd00:10:244::/48 ip6 daddr != ff00::/8 masquerade fully-random"),
            "{v6}"
        );

        let writes = nft.writes();
        let again = reconcile_nft(&mut nft, &want).await.unwrap();
        assert!(again.applied.is_empty(), "{:?}", again.applied);
        assert_eq!(
            nft.writes(),
            writes,
            "a steady-state pass wrote to nftables"
        );
    });
}

#[test]
fn a_flushed_or_deleted_table_comes_back_and_other_tables_stay() {
    in_new_netns(|| async {
        sh("nft add table ip filter && nft add chain ip filter input '{ type filter hook input priority 0; }' && nft add rule ip filter input tcp dport 22 accept");
        let foreign = sh("nft list table ip filter");
        let mut nft = NftCli::default();
        let want = tables(V4);
        reconcile_nft(&mut nft, &want).await.unwrap();

        sh("nft flush table ip flannel-ipv4");
        let report = reconcile_nft(&mut nft, &want).await.unwrap();
        assert_eq!(report.applied, ["replace nftables table ip flannel-ipv4"]);
        assert_eq!(sh("nft list table ip flannel-ipv4"), EXPECTED_V4);

        sh("nft delete table ip flannel-ipv4");
        reconcile_nft(&mut nft, &want).await.unwrap();
        assert_eq!(sh("nft list table ip flannel-ipv4"), EXPECTED_V4);

        // One rule changed behind our back is put right too.
        sh("nft delete rule ip flannel-ipv4 forward handle $(nft -a list chain ip flannel-ipv4 forward | awk '/daddr/ {print $NF}')");
        assert_eq!(
            reconcile_nft(&mut nft, &want).await.unwrap().applied.len(),
            1
        );
        assert_eq!(sh("nft list table ip flannel-ipv4"), EXPECTED_V4);

        // Masquerading turned off: weft's table goes, the foreign one stays.
        let report = reconcile_nft(&mut nft, &[]).await.unwrap();
        assert_eq!(report.applied, ["delete nftables table ip flannel-ipv4"]);
        assert_eq!(sh("nft list tables"), "table ip filter\n");
        assert_eq!(sh("nft list table ip filter"), foreign);
    });
}

#[test]
fn a_table_made_behind_the_reconciler_is_seen_at_its_next_round() {
    in_new_netns(|| async {
        let mut nft = NftCli::default();
        let want = tables(V4);
        reconcile_nft(&mut nft, &want).await.unwrap();
        // This round's listing named the tables there were: the IPv6 one was not.
        nft.new_round();
        assert!(reconcile_nft(&mut nft, &want)
            .await
            .unwrap()
            .applied
            .is_empty());
        sh("nft add table ip6 flannel-ipv6");
        // The next round lists the tables afresh and deletes the one the plan does not want.
        nft.new_round();
        let report = reconcile_nft(&mut nft, &want).await.unwrap();
        assert_eq!(report.applied, ["delete nftables table ip6 flannel-ipv6"]);
        assert_eq!(sh("nft list tables"), "table ip flannel-ipv4\n");
        // A table deleted after its round's listing named it is found missing and put back.
        nft.new_round();
        assert!(nft
            .list(weft_backends::model::Family::Ipv4, "flannel-ipv4")
            .await
            .unwrap()
            .is_some());
        sh("nft delete table ip flannel-ipv4");
        let report = reconcile_nft(&mut nft, &want).await.unwrap();
        assert_eq!(report.applied, ["replace nftables table ip flannel-ipv4"]);
    });
}
