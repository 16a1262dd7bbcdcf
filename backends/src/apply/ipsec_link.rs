//! The XFRM interface `flannel-ipsec`: created with weft's interface id on the external
//! interface, recreated when either differs. Its MTU, address, up state and routes are the
//! routing pass's.

use super::netlink::{VxlanNetlink, XfrmInfo};
use super::ApplyError;
use crate::model::IpsecSpec;
use crate::plan::ipsec::DEVICE;

/// `EOPNOTSUPP`: what the kernel answers for a link kind it does not have.
const EOPNOTSUPP: i32 = 95;

/// Brings the interface in line with `spec`; returns whether it was created.
pub(super) async fn ensure<N: VxlanNetlink>(
    nl: &mut N,
    spec: &IpsecSpec,
    changes: &mut Vec<String>,
) -> Result<bool, ApplyError> {
    let underlay_index = match &spec.underlay_device {
        Some(name) => nl.link(name).await?.map(|l| l.index),
        None => None,
    };
    let want = XfrmInfo {
        if_id: spec.if_id,
        underlay_index,
    };
    match nl.link(&spec.device).await? {
        Some(l) if l.kind.as_deref() == Some("xfrm") && l.xfrm.as_ref() == Some(&want) => Ok(false),
        other => {
            if let Some(l) = other {
                nl.del_link(&l).await?;
                changes.push(format!("removed {}: its settings differ", l.name));
            }
            nl.create_xfrm(spec, &want).await.map_err(no_xfrm)?;
            changes.push(format!(
                "created XFRM interface {} if_id 0x{:x}",
                spec.device, spec.if_id
            ));
            Ok(true)
        }
    }
}

/// Removes `flannel-ipsec` if it exists.
pub(super) async fn remove<N: VxlanNetlink>(
    nl: &mut N,
    changes: &mut Vec<String>,
) -> Result<(), ApplyError> {
    if let Some(stale) = nl.link(DEVICE).await? {
        nl.del_link(&stale).await?;
        changes.push(format!("removed XFRM interface {DEVICE}: not in the plan"));
    }
    Ok(())
}

/// A create refused because the kernel has no XFRM interfaces says so.
fn no_xfrm(e: ApplyError) -> ApplyError {
    match e {
        ApplyError::Netlink { op, source } if source.raw_os_error() == Some(EOPNOTSUPP) => {
            ApplyError::Netlink {
                op: format!("{op} (this kernel has no XFRM interfaces: load xfrm_interface, or choose another Backend.Type)"),
                source,
            }
        }
        other => other,
    }
}
