//! weft's lab: real parts on one machine for tests and the demo. Today: a real etcd and a
//! cuttable TCP proxy; the data-plane issue adds nodes in network namespaces.

pub mod etcd;
pub mod proxy;

pub use etcd::Etcd;
pub use proxy::CutProxy;
pub mod bench;
pub mod clock;
pub mod conformance;
pub mod demo;
pub mod fixtures;
pub mod fuzz;
pub mod kube_api;
pub mod lab;
pub mod live_demo;
pub mod netns;
pub mod pki;
pub mod tcp;
pub mod traffic;
pub mod vm;
pub mod wait;
