//! The advertised address follows the node's. Without `--public-ip`, the address weft
//! publishes is the chosen interface's (or the default route's source); a DHCP renewal or
//! an operator can change it while the agent runs. Every 2 s (with the nftables check) the
//! loop looks again, and a new address is published: peers then send to it, and the
//! registry's change wakes this node's own pass. An interface without an address (its
//! link down) changes nothing: the last address stays published until one comes back.

use tracing::warn;

use super::run_loop::Controller;

impl Controller<'_> {
    pub(super) async fn follow_address(&mut self) {
        if self.args.public_ip.is_some() {
            return;
        }
        let Ok(now) = crate::node::iface::local_ip(self.args) else {
            return;
        };
        let published = self.keys.attrs.public_ip;
        if published == Some(now) {
            return;
        }
        warn!(
            from = ?published,
            to = %now,
            "this node's address changed; publishing the new one"
        );
        self.keys.attrs.public_ip = Some(now);
        self.keys.publish().await;
    }
}
