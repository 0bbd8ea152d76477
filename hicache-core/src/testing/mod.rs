//! What backends' and engines' tests share, behind the `testing` feature: the storage conformance suite every backend
//! runs ([`conformance`]), a controller over a backend for tests of the path users take ([`rig`]), and a service a
//! test runs on loopback and stops by its PID ([`service`]).

pub mod conformance;
pub mod probe_tier;
pub mod rig;
pub mod service;
