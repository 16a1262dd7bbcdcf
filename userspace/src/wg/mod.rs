//! weft's own WireGuard protocol core: the handshake (`handshake`), the sessions it
//! yields (`session`), and one peer's tunnel over them (`tunnel`): its timers, its queue
//! of packets waiting for a session, and which session carries what. Sessions seal and
//! open through `&self`, so the packet threads can share one peer's session.

pub mod cookie;
pub mod handshake;
pub mod index;
mod primitives;
pub mod ratelimit;
pub mod session;
mod timers;
pub mod tunnel;

pub use tunnel::{dst_address, TunnResult, Tunnel, TunnelError};
