//! What the agent needs per backend before it can publish and plan: the `backend-data` to
//! publish (the WireGuard key, the vxlan VTEP MAC, the ipsec key and epoch, nothing for
//! host-gw) and whether a
//! WireGuard implementation must be chosen.

use std::path::Path;

use anyhow::Context;
use serde_json::Value;
use tracing::{info, warn};
use weft_backends::apply::xfrm::{EncapSocket, EspBook, XfrmSocket};
use weft_backends::apply::{Dataplane, IpsecPlane, Netlink, RtNetlink};
use weft_backends::model::{format_mac, parse_mac};
use weft_backends::netconf::{Backend, BackendKind, Implementation, NetConf};
use weft_backends::plan::ipsec::backend_data as ipsec_backend_data;
use weft_backends::plan::{
    vxlan_backend_data, vxlan_device, vxlan_device_v6, wireguard_backend_data,
};
use weft_crypto::esp::EspStore;
use weft_crypto::PublicKey;

pub struct BackendSetup {
    pub backend_data: Option<Value>,
    /// `backend-v6-data` (with `EnableIPv6`): the IPv6 device's data.
    pub backend_v6_data: Option<Value>,
    /// `Some` for wireguard: the implementation asked for.
    pub implementation: Option<Implementation>,
    /// The config's `MTU` (the underlay's), if it sets one.
    pub config_mtu: Option<u32>,
    /// ipsec: this node's epoch and the record of the SAs installed under it.
    pub esp: Option<weft_crypto::esp::Loaded>,
    /// The backends this node still speaks besides the config's, with their data
    /// (`node::also`).
    pub also: std::collections::BTreeMap<String, Value>,
}

/// File (beside the key) holding the VTEP MAC this node publishes, so it survives the
/// device and the agent.
const VTEP_MAC_FILE: &str = "vtep.mac";
/// The same for the IPv6 device `flannel-v6.<VNI>`.
const VTEP_MAC_FILE_V6: &str = "vtep-v6.mac";

pub async fn prepare(
    net: &NetConf,
    public_key: &PublicKey,
    override_impl: Option<&str>,
    state_dir: &Path,
) -> anyhow::Result<BackendSetup> {
    let mut setup = for_backend(net, public_key, override_impl, state_dir).await?;
    let flannel_vxlan = match net.backend.kind() {
        weft_backends::netconf::BackendKind::Vxlan => None,
        _ => flannel_vxlan(state_dir).await,
    };
    setup.also = super::also::at_start(
        net,
        setup.backend_data.as_ref(),
        public_key,
        state_dir,
        flannel_vxlan,
    );
    // Kept WireGuard needs an implementation as the config's would.
    if setup.implementation.is_none() && setup.also.contains_key("wireguard") {
        setup.implementation = Some(match override_impl {
            Some("kernel") => Implementation::Kernel,
            Some("userspace") => Implementation::Userspace,
            _ => Implementation::Auto,
        });
    }
    Ok(setup)
}

/// The data this node publishes for `kind` when it takes it up during a change
/// (`mixed::to_take_up`): its key on WireGuard's default port, its VTEP MAC on the peer's
/// VNI (`vni`, else 1), nothing for host-gw.
pub async fn data_to_take_up(
    kind: BackendKind,
    vni: Option<u64>,
    public_key: &PublicKey,
    state_dir: &Path,
) -> anyhow::Result<Value> {
    Ok(match kind {
        BackendKind::Wireguard => wireguard_backend_data(public_key, 51820),
        BackendKind::Vxlan => {
            let vni = vni.and_then(|v| u32::try_from(v).ok()).unwrap_or(1);
            let mac = vtep_mac(&vxlan_device(vni), state_dir, VTEP_MAC_FILE).await?;
            vxlan_backend_data(vni, &mac)
        }
        _ => Value::Null,
    })
}

/// flannel's vxlan data, if its device `flannel.1` is on this node.
async fn flannel_vxlan(state_dir: &Path) -> Option<Value> {
    let device = vxlan_device(1);
    let mut nl = RtNetlink::connect().ok()?;
    nl.link(&device).await.ok()??;
    let mac = vtep_mac(&device, state_dir, VTEP_MAC_FILE).await.ok()?;
    Some(vxlan_backend_data(1, &mac))
}

async fn for_backend(
    net: &NetConf,
    public_key: &PublicKey,
    override_impl: Option<&str>,
    state_dir: &Path,
) -> anyhow::Result<BackendSetup> {
    Ok(match &net.backend {
        Backend::Wireguard(wg) => BackendSetup {
            backend_data: Some(wireguard_backend_data(public_key, wg.listen_port)),
            backend_v6_data: net
                .ipv6
                .is_some()
                .then(|| wireguard_backend_data(public_key, wg.listen_port_v6)),
            implementation: Some(match override_impl {
                Some("kernel") => Implementation::Kernel,
                Some("userspace") => Implementation::Userspace,
                Some(_) => Implementation::Auto,
                None => wg.implementation,
            }),
            config_mtu: wg.mtu,
            esp: None,
            also: Default::default(),
        },
        Backend::Vxlan(v) => {
            let mac = vtep_mac(&vxlan_device(v.vni), state_dir, VTEP_MAC_FILE).await?;
            info!(vtep_mac = %format_mac(&mac), "vxlan");
            // The IPv6 device has a VTEP MAC of its own (flannel's `backend-v6-data`).
            let v6 = match net.ipv6 {
                Some(_) => {
                    let device = vxlan_device_v6(v.vni);
                    let mac = vtep_mac(&device, state_dir, VTEP_MAC_FILE_V6).await?;
                    info!(vtep_mac = %format_mac(&mac), "vxlan over IPv6");
                    Some(vxlan_backend_data(v.vni, &mac))
                }
                None => None,
            };
            BackendSetup {
                backend_data: Some(vxlan_backend_data(v.vni, &mac)),
                backend_v6_data: v6,
                implementation: None,
                config_mtu: v.mtu,
                esp: None,
                also: Default::default(),
            }
        }
        // flannel's ipip publishes no backend data.
        Backend::Ipip(i) => BackendSetup {
            backend_data: None,
            backend_v6_data: None,
            implementation: None,
            config_mtu: i.mtu,
            esp: None,
            also: Default::default(),
        },
        Backend::Ipsec(i) => {
            let store = EspStore::new(state_dir);
            let mut loaded = store.load().context("loading this node's ipsec epoch")?;
            // Back on ipsec after another backend: its peers removed the pairs' states
            // meanwhile, and the same two epochs would give the same keys again, which a
            // peer refuses to install twice (a nonce reused). A new epoch gives new ones.
            if let Some(was) = super::also::last_backend(state_dir).filter(|k| k != "ipsec") {
                if loaded.bumped.is_none() {
                    let epoch = store
                        .bump(&loaded.epoch)
                        .context("moving to a new ipsec epoch")?;
                    loaded = weft_crypto::esp::Loaded {
                        epoch,
                        installed: Default::default(),
                        bumped: Some(format!("this node ran {was} since its last epoch")),
                    };
                }
            }
            if let Some(why) = &loaded.bumped {
                info!(epoch = loaded.epoch.number, reason = %why, "ipsec: a new epoch");
            }
            BackendSetup {
                backend_data: Some(ipsec_backend_data(public_key, &loaded.epoch)),
                backend_v6_data: None,
                implementation: None,
                config_mtu: i.mtu,
                esp: Some(loaded),
                also: Default::default(),
            }
        }
        Backend::HostGw => BackendSetup {
            backend_data: None,
            backend_v6_data: None,
            implementation: None,
            config_mtu: None,
            esp: None,
            also: Default::default(),
        },
    })
}

/// The VTEP MAC stays the same across restarts: the MAC of the existing device (also one
/// that flannel left), else the one this node recorded when it first published, else a new
/// random locally administered unicast address, recorded.
async fn vtep_mac(device: &str, state_dir: &Path, file: &str) -> anyhow::Result<[u8; 6]> {
    let path = state_dir.join(file);
    let mut nl = RtNetlink::connect().context("opening rtnetlink")?;
    let existing = nl
        .link(device)
        .await?
        .and_then(|l| <[u8; 6]>::try_from(l.mac.as_slice()).ok());
    let recorded = match std::fs::read_to_string(&path) {
        Ok(text) => match parse_mac(text.trim()) {
            Some(mac) => Some(mac),
            None => {
                warn!(path = %path.display(), "not a MAC address; choosing a new VTEP MAC");
                None
            }
        },
        Err(_) => None,
    };
    let mac = match existing.or(recorded) {
        Some(mac) => mac,
        None => {
            let mut mac = weft_crypto::random_bytes::<6>().context("choosing a VTEP MAC")?;
            mac[0] = (mac[0] & 0xfe) | 0x02;
            mac
        }
    };
    if recorded != Some(mac) {
        std::fs::create_dir_all(state_dir)
            .with_context(|| format!("creating {}", state_dir.display()))?;
        weft_crypto::atomic_file::write_atomic(
            &path,
            format!("{}\n", format_mac(&mac)).as_bytes(),
            0o644,
        )
        .context("recording the VTEP MAC")?;
    }
    Ok(mac)
}

/// The ipsec backend's part of the data plane: the XFRM socket, the ESP-in-UDP socket
/// (`UDPEncap`) and the epoch book. Other backends get the data plane back unchanged.
pub fn attach_ipsec(
    dataplane: Dataplane,
    setup: &BackendSetup,
    net: &NetConf,
    state_dir: &Path,
) -> anyhow::Result<Dataplane> {
    let (Some(loaded), Backend::Ipsec(conf)) = (setup.esp.clone(), &net.backend) else {
        return Ok(dataplane);
    };
    let xfrm = XfrmSocket::open().context("the ipsec backend needs XFRM (kernel ESP)")?;
    let encap = match conf.udp_encap {
        true => Some(EncapSocket::open().context("UDPEncap")?),
        false => None,
    };
    info!(
        epoch = loaded.epoch.number,
        algorithm = conf.algorithm.kernel_name(),
        udp_encap = conf.udp_encap,
        "ipsec"
    );
    let book = EspBook::new(Some(EspStore::new(state_dir)), loaded);
    Ok(dataplane.with_ipsec(IpsecPlane::new(xfrm, book, encap)))
}
