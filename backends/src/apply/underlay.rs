//! The external interface as the plan needs it: which link holds the node's public IP,
//! its MTU, and the networks directly connected on it (a peer in one of them is on-link).

use futures::TryStreamExt;
use ipnet::IpNet;
use std::net::IpAddr;

use super::{ApplyError, RtNetlink};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Underlay {
    pub device: String,
    pub mtu: u32,
    /// The networks of the addresses on the link (e.g. 198.51.100.0/24).
    pub networks: Vec<IpNet>,
}

impl RtNetlink {
    /// The link that holds `ip`, or `None` if no link does.
    pub async fn underlay_of(&mut self, ip: IpAddr) -> Result<Option<Underlay>, ApplyError> {
        let messages: Vec<_> = self
            .handle
            .address()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(|e| ApplyError::Netlink {
                op: "listing addresses".into(),
                source: std::io::Error::other(e.to_string()),
            })?;
        let with: Vec<(u32, IpNet)> = messages
            .iter()
            .filter_map(|m| Some((m.header.index, super::rtnl::address_of(m)?)))
            .collect();
        let Some(index) = with.iter().find(|(_, a)| a.addr() == ip).map(|(i, _)| *i) else {
            return Ok(None);
        };
        let links: Vec<_> = self
            .handle
            .link()
            .get()
            .match_index(index)
            .execute()
            .try_collect()
            .await
            .map_err(|e| ApplyError::Netlink {
                op: format!("looking up link {index}"),
                source: std::io::Error::other(e.to_string()),
            })?;
        let Some(link) = links.first().map(RtNetlink::parse_link) else {
            return Ok(None);
        };
        let networks = with
            .iter()
            .filter(|(i, _)| *i == index)
            .map(|(_, a)| a.trunc())
            .collect();
        Ok(Some(Underlay {
            device: link.name,
            mtu: link.mtu,
            networks,
        }))
    }
}
