//! A rank that never comes: rank 0 of a group of two waits for rank 1 no longer than its deadline and says which rank
//! is missing (a process of its own: the abandoned join stays blocked inside NCCL until the process ends).

use std::time::{Duration, Instant};

use hicache_cuda::{Bootstrap, Device, NcclGroup, NcclSettings};

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_missing_rank_is_named_at_the_deadline_not_a_hang() {
    let device = Device::open(0).expect("a CUDA GPU");
    let dir = tempfile::tempdir().unwrap();
    let settings = NcclSettings {
        rank: 0,
        world_size: 2,
        bootstrap: Bootstrap::File(dir.path().join("nccl-id")),
        deadline: Duration::from_secs(3),
    };
    let started = Instant::now();
    let error = NcclGroup::join(&device, &settings).unwrap_err().to_string();
    let waited = started.elapsed();
    assert!(error.contains("rank 1 did not come") && error.contains("join timed out after 3000 ms"), "{error}");
    assert!(waited >= Duration::from_secs(3) && waited < Duration::from_secs(10), "waited {waited:?}");
    println!("{error} (waited {waited:?})");
}
