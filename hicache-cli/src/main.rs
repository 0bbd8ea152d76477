//! The hicache command.
fn main() {}
