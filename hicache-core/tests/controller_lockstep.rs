//! TP lockstep of the whole controller under random storage faults (docs/sglang.md#fixed-2 and #fixed-16), and the
//! prefetch, backup and release state machines under random scripts (proptest).
//!
//! Every rank runs the same scheduler script (same seed) against its own storage namespace, with its own random
//! latencies and failures. Whatever each rank's I/O does, the ranks must decide the same: identical prefetch results,
//! identical host allocator states after every tick, and no hang (the collective times out instead). The script
//! checks the allocator's invariants after every tick and, at the end, that every page came back.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hicache_core::collective::{Collective, InProcessGroup, SingleRank};
use hicache_core::config::PrefetchPolicy;
use hicache_core::controller::{CacheController, PrefetchStart, PrefetchStop, StorageSettings};
use hicache_core::device_slots::{DeviceSlotAllocator as _, PagedSlots};
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PartialPage, page_keys};
use hicache_core::host_pool::{HostPageId, PageState};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{FaultPlan, FaultyStorage, MemoryStorage, MemoryStore};
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap};
use hicache_core::tree::NodeId;
use hicache_core::{HiCacheBuilder, HiCacheConfig};
use proptest::prelude::*;
use rand::SeedableRng as _;
use rand::rngs::StdRng;

const PAGE: usize = 2;
const LAYERS: usize = 2;
const DEVICE_PAGES: usize = 12;
const HOST_PAGES: usize = 36;

fn geometry() -> KvGeometry {
    KvGeometry::mha(LAYERS, 1, 4, KvDtype::Bf16).unwrap()
}

/// What a rank decided, to compare across ranks.
#[derive(Debug, PartialEq, Eq)]
struct Decisions {
    /// (request, tokens kept) in result order.
    prefetches: Vec<(String, usize)>,
    /// Host page states after every tick.
    states: Vec<Vec<PageState>>,
    /// This rank's own view of each result: (local hit tokens, local fetched tokens); may differ across ranks.
    local: Vec<(usize, usize)>,
    /// Each result's cost plan: pages to fetch.
    plans: Vec<Option<(usize, usize)>>,
    /// Each result's stop reason; may differ across ranks (a read that failed here is `Failed` here only).
    stops: Vec<PrefetchStop>,
}

struct Script {
    seed: u64,
    policy: PrefetchPolicy,
    rounds: usize,
    /// Fetch by cost, each rank reporting prefills of its own speed (so their rates differ and must be agreed).
    by_cost: bool,
    /// The engine meets the reads (reads from the end; only with `by_cost`).
    meet: bool,
}

/// Runs the scheduler script on one rank; panics on any broken invariant.
fn run_rank(script: &Script, collective: &mut dyn Collective, store: &Arc<MemoryStore>) -> Decisions {
    let (rank, ranks) = (collective.rank(), collective.world_size());
    let mut namespace = StorageNamespace::single_rank("lockstep", geometry(), HostLayout::PageFirst, PAGE);
    namespace.tp_rank = rank;
    namespace.tp_size = collective.world_size();
    let faulty = Arc::new(FaultyStorage::new(MemoryStorage::shared(store.clone(), &namespace), FaultPlan::default()));
    let device = DeviceLayoutMap::new(geometry(), DEVICE_PAGES * PAGE).unwrap();
    let host = HostLayoutMap::new(geometry(), HostLayout::PageFirst, PAGE, HOST_PAGES).unwrap();
    let engine = CpuEngine::new(device, host, Completion::Immediate).unwrap();
    let settings = StorageSettings {
        page_size: PAGE,
        batch_pages: 2,
        prefetch_threshold: 2 * PAGE,
        policy: script.policy,
        timeout_base: Duration::from_millis(2),
        timeout_per_ki_token: Duration::from_millis(1),
        timeout_max: Duration::from_millis(5),
        read_deadline: Duration::from_secs(30),
        capacity_tokens: (16 * PAGE) as u64,
        backup_skip: false,
        write_bytes_per_s: 0,
        tick_slots: 4,
        by_cost: script.by_cost,
        // by cost, some hits are split: their heads are the engine's (every rank must plan the same head)
        split: script.by_cost,
        meet: script.meet,
        priors: hicache_core::cost::Priors::UNKNOWN,
        trailing: None,
    };
    let mut controller = HiCacheBuilder::new(
        HiCacheConfig { page_size: PAGE, mem_layout: HostLayout::PageFirst, ..HiCacheConfig::default() },
        engine,
    )
    .with_storage(faulty.clone())
    .with_storage_settings(settings)
    .with_tp_rank(rank)
    .build_controller()
    .unwrap();

    let mut shared = StdRng::seed_from_u64(script.seed); // the scheduler's choices: the same on every rank
    let mut local = StdRng::seed_from_u64(script.seed ^ ((rank as u64 + 1) * 0x9e37_79b9)); // this rank's faults
    let sequences: Vec<Vec<u32>> =
        (0..8u32).map(|sequence| (0..(PAGE * 6) as u32).map(|token| sequence * 1000 + token).collect()).collect();
    let mut evictable: Vec<HostPageId> = Vec::new(); // backed-up host pages the script owns
    let mut pending: Vec<String> = Vec::new();
    let mut decisions = Decisions {
        prefetches: Vec::new(),
        states: Vec::new(),
        local: Vec::new(),
        plans: Vec::new(),
        stops: Vec::new(),
    };
    let mut writes: VecDeque<Vec<u32>> = VecDeque::new(); // device slots of writes not yet acked
    let mut slots_of_engine = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap(); // the engine's device slot allocator
    let mut request = 0;

    let mut tick = |controller: &mut CacheController<CpuEngine>,
                    evictable: &mut Vec<HostPageId>,
                    pending: &mut Vec<String>,
                    decisions: &mut Decisions,
                    writes: &mut VecDeque<Vec<u32>>,
                    slots_of_engine: &mut PagedSlots| {
        let report = controller
            .tick_with(collective, &mut |controller, pages| {
                let victims = take_unpinned(controller, evictable, pages);
                controller.evict_host(&victims).unwrap();
            })
            .unwrap();
        for ack in report.write_acks {
            // drop the device copy at once: the host pages hold the only copy above storage
            let slots = writes.pop_front().expect("acks come in submission order");
            controller.evict_device(&ack.host_pages).unwrap();
            slots_of_engine.free(&slots).unwrap();
            evictable.extend(ack.host_pages);
        }
        for done in report.prefetches {
            pending.retain(|id| *id != done.request_id);
            decisions.prefetches.push((done.request_id.clone(), done.explanation.fetched_tokens));
            decisions.local.push((done.explanation.local_hit_tokens, done.explanation.local_fetched_tokens));
            decisions.plans.push(done.explanation.plan.map(|plan| (plan.compute_head_pages, plan.fetch_pages)));
            let mut head = done.explanation.plan.map_or(0, |plan| plan.compute_head_pages) * PAGE;
            if script.meet {
                // read from the end, a split's head too: the pages kept are the reserved ones' last
                head = done.explanation.reserved_tokens - done.explanation.fetched_tokens;
            }
            assert!(done.head_tokens == 0 || done.head_tokens == head, "{} of {head}", done.head_tokens);
            decisions.stops.push(done.explanation.stop.clone());
            assert_eq!(done.host_pages.len() * PAGE, done.explanation.fetched_tokens);
            evictable.extend(done.host_pages);
        }
        controller.host().check_invariants().unwrap();
        decisions.states.push(controller.host().states().to_vec());
    };

    for round in 0..script.rounds {
        // this rank's faults for the next calls
        faulty.set_plan(FaultPlan {
            latency: (!script.by_cost && local.random_bool(0.3))
                .then(|| Duration::from_micros(local.random_range(0..400))),
            fail_call: local.random_bool(0.2).then(|| faulty.calls() + local.random_range(1..6)),
            partial_batch: local.random_bool(0.1).then_some(1),
            // by cost: in the second half, a tier this rank reads at 20 kB/s to 2 MB/s (a page of 64 bytes in 32 µs
            // to 3.2 ms), the last rank at 20 kB/s: once it has measured a read, every rank plans with it (the
            // slowest rank's rates) and computes rather than reads
            read_bytes_per_s: match (script.by_cost && round >= script.rounds / 2, rank + 1 == ranks) {
                (false, _) => 0,
                (true, true) => 20_000,
                (true, false) => local.random_range(20_000..2_000_000),
            },
            ..FaultPlan::default()
        });
        if script.by_cost {
            // this rank's engine: a prefill of 64 tokens at a speed of its own, from 20 to 200 µs a page of 2
            let tokens_per_s = local.random_range(1e4..1e5);
            controller.observe_prefill(64, 0, Duration::from_secs_f64(64.0 / tokens_per_s));
        }
        // the scheduler's choices
        if shared.random_bool(0.5) {
            let sequence = &sequences[shared.random_range(0..sequences.len())];
            let pages = shared.random_range(1..=6);
            let keys = page_keys(&sequence[..pages * PAGE], PAGE, None, PartialPage::Reject).unwrap();
            if let Some(slots) = slots_of_engine.alloc_pages(pages) {
                match controller.write(&slots, NodeId(1), Some(&keys)).unwrap() {
                    Some(_) => writes.push_back(slots),
                    None => slots_of_engine.free(&slots).unwrap(),
                }
            }
        }
        if shared.random_bool(0.5) {
            let sequence = &sequences[shared.random_range(0..sequences.len())];
            request += 1;
            let id = format!("r{request}");
            let cached = shared.random_range(0..4096);
            if let PrefetchStart::Started(_) = controller.prefetch_after(&id, sequence, None, cached).unwrap() {
                pending.push(id);
            }
        }
        for id in pending.clone() {
            match shared.random_range(0..40) {
                0 => assert!(controller.abort_prefetch(&id)),
                1..=4 => assert!(controller.finish_prefetch(&id)),
                // an engine that meets the reads: the scheduler's choice, the same on every rank (the reads each
                // rank has done differ; the result is their minimum)
                5..=8 if script.meet => {
                    controller.meet_prefetch(&id);
                }
                _ => {}
            }
        }
        if shared.random_bool(0.2) {
            let count = shared.random_range(0..=evictable.len());
            let victims = take_unpinned(&controller, &mut evictable, count);
            controller.evict_host(&victims).unwrap();
        }
        tick(&mut controller, &mut evictable, &mut pending, &mut decisions, &mut writes, &mut slots_of_engine);
        // a forward pass's worth of time, so fetches make progress between ticks
        std::thread::sleep(Duration::from_micros(100));
    }
    // wind down: take every request, then tick until nothing is in flight (the same condition on every rank)
    faulty.set_plan(FaultPlan::default());
    for id in pending.clone() {
        controller.finish_prefetch(&id);
    }
    // (bounded by time, not by a count of ticks: how many ticks the storage threads take depends on the machine)
    let deadline = Instant::now() + Duration::from_secs(60);
    while controller.prefetches_in_flight() > 0 || controller.backups_in_flight() > 0 || controller.outstanding().0 > 0
    {
        tick(&mut controller, &mut evictable, &mut pending, &mut decisions, &mut writes, &mut slots_of_engine);
        assert!(Instant::now() < deadline, "rank {rank}: not wound down after 60 s");
        std::thread::yield_now();
    }
    assert!(pending.is_empty());
    assert_eq!(controller.prefetch_capacity().unwrap().occupied(), 0);
    // every host page is idle or owned by the script, exactly once
    controller.evict_host(&evictable).unwrap();
    assert_eq!(controller.host().available(), HOST_PAGES, "rank {rank}: host pages lost");
    decisions
}

/// Takes up to `count` evictable pages that no backup is reading.
fn take_unpinned(
    controller: &CacheController<CpuEngine>,
    evictable: &mut Vec<HostPageId>,
    count: usize,
) -> Vec<HostPageId> {
    let mut victims = Vec::new();
    evictable.retain(|&page| {
        if victims.len() < count && !controller.is_pinned(&[page]) {
            victims.push(page);
            false
        } else {
            true
        }
    });
    victims
}

fn run_group(script: &Script, ranks: usize) -> Vec<Decisions> {
    let store = MemoryStore::new();
    let groups = InProcessGroup::new(ranks, Duration::from_secs(20)).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|mut group| {
                let store = store.clone();
                scope.spawn(move || run_rank(script, &mut group, &store))
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().expect("a rank failed")).collect()
    })
}

#[test]
fn four_ranks_with_random_faults_decide_the_same_and_never_hang() {
    for (seed, policy) in [
        (1, PrefetchPolicy::BestEffort),
        (2, PrefetchPolicy::WaitComplete),
        (3, PrefetchPolicy::Timeout),
        (4, PrefetchPolicy::BestEffort),
    ] {
        let decisions = run_group(&Script { seed, policy, rounds: 150, by_cost: false, meet: false }, 4);
        let kept = decisions[0].prefetches.iter().filter(|(_, tokens)| *tokens > 0).count();
        assert!(kept >= 3, "{policy}: only {kept} prefetches kept pages");
        // the faults made the ranks see different things, so agreeing took the reduction
        let differs = (0..decisions[0].local.len())
            .any(|index| decisions.iter().any(|rank| rank.local[index] != decisions[0].local[index]));
        assert!(differs, "{policy}: every rank saw the same hits and fetches; the faults did nothing");
        for (rank, rank_decisions) in decisions.iter().enumerate().skip(1) {
            assert_eq!(rank_decisions.prefetches, decisions[0].prefetches, "{policy}: rank {rank} differs");
            assert_eq!(rank_decisions.states, decisions[0].states, "{policy}: rank {rank}'s allocator differs");
        }
    }
}

#[test]
fn four_ranks_that_measure_different_rates_make_the_same_cost_plans() {
    let (mut splits, mut fetched, mut computed) = (0, 0, 0);
    for (seed, policy) in
        [(5, PrefetchPolicy::WaitComplete), (6, PrefetchPolicy::Timeout), (7, PrefetchPolicy::BestEffort)]
    {
        let decisions = run_group(&Script { seed, policy, rounds: 150, by_cost: true, meet: false }, 4);
        // the plans went every way: some hits were worth reading, some were computed instead, some split (counted
        // over the three scripts: whether a best-effort or timed fetch kept pages depends on how fast the reads
        // ran, which the machine's load moves; waiting for completion keeps what a plan fetched)
        fetched += decisions[0]
            .prefetches
            .iter()
            .zip(&decisions[0].plans)
            .filter(|((_, kept), plan)| *kept > 0 && plan.is_some())
            .count();
        computed += decisions[0].stops.iter().filter(|stop| **stop == PrefetchStop::RecomputeFaster).count();
        splits += decisions[0].plans.iter().filter(|plan| plan.is_some_and(|(head, _)| head > 0)).count();
        for (rank, rank_decisions) in decisions.iter().enumerate().skip(1) {
            assert_eq!(rank_decisions.plans, decisions[0].plans, "{policy}: rank {rank}'s plans differ");
            assert_eq!(rank_decisions.prefetches, decisions[0].prefetches, "{policy}: rank {rank} differs");
            assert_eq!(rank_decisions.states, decisions[0].states, "{policy}: rank {rank}'s allocator differs");
        }
    }
    // a split needs the measured reads near the compute, which the machine's load moves: one script of three may
    // have none, all three together have some
    assert!(splits > 0, "no plan split a hit");
    assert!(fetched > 0, "no plan fetched anything");
    assert!(computed > 0, "no plan chose to compute");
}

#[test]
fn four_ranks_whose_engines_meet_the_reads_from_the_end_decide_the_same() {
    let (mut met, mut kept) = (0, 0);
    for (seed, policy) in [(8, PrefetchPolicy::WaitComplete), (9, PrefetchPolicy::BestEffort)] {
        let decisions = run_group(&Script { seed, policy, rounds: 150, by_cost: true, meet: true }, 4);
        met += decisions[0].stops.iter().filter(|stop| **stop == PrefetchStop::Met).count();
        kept += decisions[0].prefetches.iter().filter(|(_, tokens)| *tokens > 0).count();
        for (rank, rank_decisions) in decisions.iter().enumerate().skip(1) {
            assert_eq!(rank_decisions.plans, decisions[0].plans, "{policy}: rank {rank}'s plans differ");
            assert_eq!(rank_decisions.prefetches, decisions[0].prefetches, "{policy}: rank {rank} differs");
            assert_eq!(rank_decisions.states, decisions[0].states, "{policy}: rank {rank}'s allocator differs");
        }
    }
    assert!(met > 0, "no engine met the reads");
    assert!(kept > 0, "no prefetch kept pages");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// One rank, random scripts and faults: allocator invariants after every tick, every page back at the end,
    /// capacity back to zero.
    #[test]
    fn random_scripts_return_every_page(seed in any::<u64>(), policy in 0usize..3) {
        let policy = [PrefetchPolicy::BestEffort, PrefetchPolicy::WaitComplete, PrefetchPolicy::Timeout][policy];
        let (by_cost, meet) = (seed % 2 == 0, seed % 4 == 0);
        run_rank(&Script { seed, policy, rounds: 60, by_cost, meet }, &mut SingleRank, &MemoryStore::new());
    }
}
