//! The demo: a real etcd, three nodes acquiring leases through weft's etcd registry (each
//! with its own WireGuard key), one deliberately broken lease, and every node's plan as
//! the agent computes it. The data-plane issue turns this into a live encrypted mesh.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use weft::registry::{
    self, AcquireRequest, EtcdConfig, EtcdRegistry, LocalAttrs, Registry, RegistryHandle,
};
use weft_backends::model::{ClusterView, Lease};
use weft_backends::netconf::{Backend, NetConf};
use weft_backends::plan::{plan, wireguard_backend_data, PlanInput, PlanOptions};
use weft_crypto::PrivateKey;

use crate::Etcd;

/// `weft-lab demo [BACKEND]`: the live mesh on `backend` (wireguard, vxlan, host-gw), or
/// with `--plan-only` the wireguard plans alone.
pub async fn run(plan_only_flag: bool, backend: &str) -> anyhow::Result<()> {
    if plan_only_flag {
        return plan_only().await;
    }
    crate::live_demo::run(backend)
}

const PREFIX: &str = "/coreos.com/network";
/// Nodes lease below 10.244.200.0, so the broken entry at 10.244.250.0/24 is never a node's.
const CONFIG: &str = r#"{"Network": "10.244.0.0/16", "SubnetMax": "10.244.199.0", "Backend": {"Type": "wireguard", "PersistentKeepaliveInterval": 25}}"#;
const NODES: u8 = 3;

/// The plan-only demo (no namespaces, no root): leases in a real etcd, each node's plan.
pub async fn plan_only() -> anyhow::Result<()> {
    println!("weft demo: {NODES} nodes, etcd registry, wireguard backend\n");
    let etcd = Etcd::start().context("starting etcd for the demo")?;
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await?;
    client.put(format!("{PREFIX}/config"), CONFIG, None).await?;
    println!("etcd      {} (prefix {PREFIX})", etcd.endpoint());
    println!("config    {CONFIG}\n");

    let mut nodes: Vec<(RegistryHandle, Lease, NetConf)> = Vec::new();
    println!(
        "{:<16} {:<16} {:<15} public key",
        "node (etcd key)", "subnet", "public IP"
    );
    for i in 1..=NODES {
        let key = PrivateKey::generate()?;
        let mut reg = EtcdRegistry::connect(EtcdConfig::new(vec![etcd.endpoint()], PREFIX)).await?;
        let net = reg.net_conf().await?;
        let Backend::Wireguard(wg) = &net.backend else {
            bail!("the demo config is wireguard")
        };
        let attrs = LocalAttrs {
            public_ip: Some(Ipv4Addr::new(198, 51, 100, i)),
            internal_ip: None,
            public_ipv6: None,
            backend: net.backend.kind(),
            backend_data: Some(wireguard_backend_data(&key.public_key(), wg.listen_port)),
            backend_v6_data: None,
            next_key: None,
            key_proof: None,
            ml_kem_key: None,
            zone: None,
            gateway: None,
            also: Default::default(),
        };
        let lease = reg
            .acquire(
                &net,
                &AcquireRequest {
                    attrs,
                    previous: None,
                    previous_v6: None,
                },
            )
            .await?;
        println!(
            "{:<16} {:<16} {:<15} {}",
            lease.node,
            lease.subnet.map(|s| s.to_string()).unwrap_or_default(),
            lease.public_ip.map(|s| s.to_string()).unwrap_or_default(),
            key.public_key()
        );
        nodes.push((
            registry::spawn(reg, lease.clone(), Default::default()),
            lease,
            net,
        ));
    }
    // A node whose published key is garbage: every plan leaves it out and says why.
    let bad = r#"{"PublicIP":"198.51.100.99","PublicIPv6":null,"BackendType":"wireguard","BackendData":{"PublicKey":"not-a-key","Port":51820}}"#;
    client
        .put(format!("{PREFIX}/subnets/10.244.250.0-24"), bad, None)
        .await?;
    println!(
        "{:<16} {:<16} {:<15} (broken on purpose: PublicKey \"not-a-key\")\n",
        "10.244.250.0-24", "10.244.250.0/24", "198.51.100.99"
    );

    let options = PlanOptions {
        ip_masq: true,
        underlay_mtu: 1500,
        underlay_device: None,
        underlay_networks: vec![],
    };
    for (handle, lease, net) in &nodes {
        let mut views = handle.views.clone();
        let want = usize::from(NODES) + 1;
        let seen =
            tokio::time::timeout(Duration::from_secs(10), views.wait_for(|v| v.len() == want))
                .await
                .is_ok();
        if !seen {
            bail!(
                "node {} did not see all {want} leases within 10 s",
                lease.node
            );
        }
        let view: Arc<ClusterView> = views.borrow().clone();
        let state = plan(&PlanInput {
            observed: &Default::default(),
            path_mtus: &Default::default(),
            pair_psks: &Default::default(),
            local: lease,
            view: &view,
            config: net,
            options: &options,
            now: SystemTime::now(),
        })?;
        println!("── plan of node {} ──", lease.node);
        print!("{state}");
        println!();
    }
    for (handle, _, _) in nodes {
        handle.stop().await;
    }
    println!(
        "(the plan each agent computes; `weft-lab demo` without --plan-only runs the live mesh)"
    );
    Ok(())
}
