//! The NCCL collective on one GPU: a group of one, joined through each bootstrap, gives every reduction of random
//! vectors back unchanged (as the core's single-rank group does: the same checks run on it here, without a GPU),
//! grows its buffer for long vectors, and keeps going over many rounds (the per-collective cost is printed). Groups of
//! several ranks need several GPUs; a rank that never comes is `nccl_missing_rank.rs`.

use std::time::{Duration, Instant};

use hicache_core::collective::{Collective, ReduceOp, SingleRank};
use hicache_cuda::{Bootstrap, Device, NcclGroup, NcclSettings, nccl_present};
use rand::RngExt as _;

/// What a group of one must do: every reduction is the identity, lengths may change between calls.
fn exercise(group: &mut dyn Collective) {
    assert_eq!((group.rank(), group.world_size()), (0, 1));
    let mut rng = rand::rng();
    for len in [0usize, 1, 3, 17, 1000, 5] {
        for op in [ReduceOp::Min, ReduceOp::Max, ReduceOp::Sum] {
            let values: Vec<i64> = (0..len).map(|_| rng.random_range(-1_000_000_000i64..1_000_000_000)).collect();
            let mut reduced = values.clone();
            group.all_reduce(&mut reduced, op).unwrap();
            assert_eq!(reduced, values, "{op:?} of {len}");
        }
        group.barrier().unwrap();
    }
    let extremes = [i64::MIN + 1, i64::MAX, 0, -1];
    let mut reduced = extremes;
    group.all_reduce(&mut reduced, ReduceOp::Sum).unwrap();
    assert_eq!(reduced, extremes);
}

#[test]
fn the_checks_hold_for_the_single_rank_group() {
    exercise(&mut SingleRank);
}

#[test]
fn joining_without_nccl_is_a_clear_error() {
    if nccl_present() {
        return;
    }
    let error = NcclGroup::unique_id().unwrap_err().to_string();
    assert!(error.contains("libnccl.so cannot be loaded"), "{error}");
}

fn settings(bootstrap: Bootstrap) -> NcclSettings {
    NcclSettings { rank: 0, world_size: 1, bootstrap, deadline: Duration::from_secs(20) }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_group_of_one_joined_by_id_gives_every_reduction_back() {
    let device = Device::open(0).expect("a CUDA GPU");
    let id = NcclGroup::unique_id().unwrap();
    let mut group = NcclGroup::join(&device, &settings(Bootstrap::Id(id))).unwrap();
    exercise(&mut group);
    // what a tick costs: one reduction of a few counters
    let rounds = 2000;
    let started = Instant::now();
    for round in 0..rounds {
        let mut values = [round, 1, 2, 3];
        group.all_reduce(&mut values, ReduceOp::Min).unwrap();
    }
    let per_call = started.elapsed().as_secs_f64() / rounds as f64 * 1e6;
    println!("NCCL all_reduce of 4 i64, world size 1: {per_call:.1} us per call (header check included)");
    let wrong_rank = NcclSettings { rank: 1, ..settings(Bootstrap::Id(NcclGroup::unique_id().unwrap())) };
    assert!(
        NcclGroup::join(&device, &wrong_rank)
            .unwrap_err()
            .to_string()
            .starts_with("rank: rank 1 is not in a group of 1")
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_group_of_one_joined_through_a_file_gives_every_reduction_back() {
    let device = Device::open(0).expect("a CUDA GPU");
    let dir = tempfile::tempdir().unwrap();
    let mut group = NcclGroup::join(&device, &settings(Bootstrap::File(dir.path().join("nccl-id")))).unwrap();
    exercise(&mut group);
    assert!(dir.path().join("nccl-id.rank-0").exists(), "rank 0 marked its arrival");
}
