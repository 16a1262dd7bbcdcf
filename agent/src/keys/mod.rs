//! This node's keys over time: its own key's rotation (`rotation`), when a peer's
//! announced key takes over (`switchover`), and the pre-shared key and its rotation
//! (`psk`). docs/key-rotation.md describes the protocol.

pub mod psk;
pub mod rotation;
pub mod switch_watch;
pub mod switchover;
