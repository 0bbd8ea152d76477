//! What backends' and engines' tests share, behind the `testing` feature: the storage conformance suite every backend
//! runs ([`conformance`]), a controller over a backend for tests of the path users take ([`rig`]), a service a
//! test runs on loopback and stops by its PID ([`service`]), the check that topologies share a tier under the
//! unified key scheme ([`unified`]), a hybrid model's page groups for the tiers' group tests ([`groups`]), and a
//! probe of threads' ends for code that joins its threads ([`thread_ends`]).

pub mod conformance;
pub mod groups;
pub mod probe_tier;
pub mod rig;
pub mod service;
pub mod thread_ends;
pub mod unified;
