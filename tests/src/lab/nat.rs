//! The NAT of the "two VPCs and a NAT" scenario: a namespace joining the first segment
//! (outside, `NAT_IP`) to a private one (192.0.2.0/24 on `br2`, inside) and masquerading
//! everything that leaves, as a cloud NAT gateway does. Nodes behind it reach the world
//! through it; nothing reaches them except as replies to what they sent.

use super::config::{NAT_INSIDE_IP, NAT_IP};
use super::fabric::{attach_to, in_ns, Namespaces};
use super::EXT_IP;

/// The NAT namespace's name in lab `tag`.
pub fn nat_ns(tag: &str) -> String {
    format!("{tag}-nat")
}

/// Builds `br2` and the NAT.
pub(super) fn build(tag: &str, fabric: &str, namespaces: &mut Namespaces) -> anyhow::Result<()> {
    in_ns(fabric, "ip link add br2 type bridge && ip link set br2 up")?;
    let nat = nat_ns(tag);
    namespaces.add(&nat)?;
    attach_to(fabric, "br0", &nat, "nat", "eth0", NAT_IP)?;
    attach_to(fabric, "br2", &nat, "nat2", "eth1", NAT_INSIDE_IP)?;
    in_ns(
        &nat,
        &format!(
            "sysctl -qw net.ipv4.ip_forward=1 && ip route add default via {EXT_IP} \
             && nft add table ip nat \
             && nft add chain ip nat post '{{ type nat hook postrouting priority 100; }}' \
             && nft add rule ip nat post oifname eth0 masquerade"
        ),
    )?;
    Ok(())
}

/// Makes the NAT map new flows to other ports and forgets every mapping it has (as a NAT
/// gateway that restarted would): the natted nodes' traffic leaves from new ports.
pub fn rebind(tag: &str, port_range: &str) -> anyhow::Result<()> {
    let nat = nat_ns(tag);
    in_ns(
        &nat,
        &format!(
            "nft flush chain ip nat post \
             && nft add rule ip nat post oifname eth0 meta l4proto udp masquerade to :{port_range} \
             && nft add rule ip nat post oifname eth0 masquerade \
             && conntrack -F"
        ),
    )?;
    Ok(())
}
