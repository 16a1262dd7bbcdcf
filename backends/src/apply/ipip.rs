//! The ipip reconciler: the device `flannel.ipip` (recreated when its local address or
//! underlay differ). Its routes are the routing pass's. Without an ipip plan, a full pass
//! removes a `flannel.ipip` left by a previous backend.

use std::net::IpAddr;

use super::netlink::{IpipInfo, VxlanNetlink};
use super::ApplyError;
use crate::model::IpipSpec;

/// flannel's ipip device name.
const DEVICE: &str = "flannel.ipip";

/// Brings `flannel.ipip` in line with `spec`; with `sweep` (full passes) and no `spec`,
/// removes it. Returns whether the device was created.
pub async fn reconcile_ipip<N: VxlanNetlink>(
    nl: &mut N,
    spec: Option<&IpipSpec>,
    sweep: bool,
    changes: &mut Vec<String>,
) -> Result<bool, ApplyError> {
    let Some(spec) = spec else {
        if sweep {
            if let Some(stale) = nl.link(DEVICE).await? {
                nl.del_link(&stale).await?;
                changes.push(format!("removed ipip device {DEVICE}: not in the plan"));
            }
        }
        return Ok(false);
    };
    let underlay_index = match &spec.underlay_device {
        Some(name) => nl.link(name).await?.map(|l| l.index),
        None => None,
    };
    let want = IpipInfo {
        local: Some(IpAddr::V4(spec.local)),
        underlay_index,
    };
    match nl.link(&spec.device).await? {
        Some(l) if l.kind.as_deref() == Some("ipip") && l.ipip.as_ref() == Some(&want) => Ok(false),
        other => {
            if let Some(l) = other {
                nl.del_link(&l).await?;
                changes.push(format!("removed {}: its settings differ", l.name));
            }
            nl.create_ipip(spec, &want).await.map_err(no_ipip)?;
            changes.push(format!(
                "created ipip device {} local {}",
                spec.device, spec.local
            ));
            Ok(true)
        }
    }
}

/// `EOPNOTSUPP`: what the kernel answers for a link kind it does not have.
const EOPNOTSUPP: i32 = 95;

/// A create refused because the kernel has no ipip says so, and what to do.
fn no_ipip(e: ApplyError) -> ApplyError {
    match e {
        ApplyError::Netlink { op, source } if source.raw_os_error() == Some(EOPNOTSUPP) => {
            ApplyError::Netlink {
                op: format!("{op} (this kernel has no ipip: load the ipip module, or choose another Backend.Type)"),
                source,
            }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::fake::FakeNetlink;
    use crate::apply::reconcile_tests::block_on;
    use crate::apply::Netlink;

    fn spec(local: [u8; 4]) -> IpipSpec {
        IpipSpec {
            device: DEVICE.into(),
            local: local.into(),
            underlay_device: Some("eth0".into()),
            mtu: 1480,
            addresses: vec![],
        }
    }

    #[test]
    fn created_once_recreated_when_it_differs_and_swept_when_unplanned() {
        let mut nl = FakeNetlink::default();
        let eth0 = nl.add_link("eth0", "veth");
        let mut changes = Vec::new();
        let a = spec([198, 51, 100, 1]);
        assert!(block_on(reconcile_ipip(&mut nl, Some(&a), true, &mut changes)).unwrap());
        let link = nl.links["flannel.ipip"].clone();
        assert_eq!(link.kind.as_deref(), Some("ipip"));
        assert_eq!(link.ipip.unwrap().underlay_index, Some(eth0));
        // Steady state: nothing written.
        let writes = nl.writes();
        assert!(!block_on(reconcile_ipip(&mut nl, Some(&a), true, &mut changes)).unwrap());
        assert_eq!(nl.writes(), writes);
        // A new public IP: recreated with it.
        let b = spec([198, 51, 100, 9]);
        assert!(block_on(reconcile_ipip(&mut nl, Some(&b), false, &mut changes)).unwrap());
        let local = nl.links["flannel.ipip"].ipip.as_ref().unwrap().local;
        assert_eq!(local, Some("198.51.100.9".parse().unwrap()));
        // Another backend planned: an incremental pass leaves it, a full pass removes it.
        block_on(reconcile_ipip(&mut nl, None, false, &mut changes)).unwrap();
        assert!(nl.links.contains_key("flannel.ipip"));
        block_on(reconcile_ipip(&mut nl, None, true, &mut changes)).unwrap();
        assert!(!nl.links.contains_key("flannel.ipip"), "{changes:?}");
    }
}
