//! A rank that never comes: rank 0 of a group of two waits for rank 1 no longer than its deadline and says which rank
//! is missing (a process of its own: the abandoned join stays blocked inside NCCL until the process ends); and rank 1
//! gives up at its deadline when rank 0 never writes the id.

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

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rank_whose_rank_0_never_writes_the_id_fails_at_the_deadline() {
    let device = Device::open(0).expect("a CUDA GPU");
    let dir = tempfile::tempdir().unwrap();
    let settings = NcclSettings {
        rank: 1,
        world_size: 2,
        bootstrap: Bootstrap::File(dir.path().join("nccl-id")),
        deadline: Duration::from_secs(1),
    };
    let started = Instant::now();
    let error = NcclGroup::join(&device, &settings).unwrap_err().to_string();
    assert!(error.contains("rank 0 did not write") && error.contains("timed out after 1000 ms"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(5));
}
