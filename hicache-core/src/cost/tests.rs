//! The cost model's plans against brute force over every split, and its rates under measurements.

use proptest::prelude::*;

use super::*;

fn rates(read_gbps: f64, tokens_per_s: f64) -> Rates {
    Rates {
        storage_call_s: 1e-4,
        storage_read_bytes_per_s: Some(read_gbps * 1e9),
        load_bytes_per_s: 25e9,
        prefill_s_per_token: Some(1.0 / tokens_per_s),
        prefill_s_per_token_per_prefix: 0.0,
        batch_pages: 128,
    }
}

fn hit(pages: usize) -> Hit {
    Hit {
        cached_tokens: 512,
        pages,
        page_tokens: 32,
        page_bytes: 128 << 10,
        prompt_tokens: 512 + pages * 32 + 512,
        arrived_pages: 0,
        split: false,
        min_fetch_pages: 1,
    }
}

#[test]
fn a_fast_tier_fetches_all_a_slow_one_nothing() {
    // 128 KiB pages of 32 tokens: 4 KiB a token; at 25 000 tokens/s compute is 102 MB/s of KV
    let fast = plan(&rates(2.0, 25_000.0), &hit(64), 0);
    assert_eq!((fast.fetch_pages, fast.reason), (64, PlanReason::FetchAll));
    assert!(fast.expected < fast.recompute, "{fast:?}");
    let slow = plan(&rates(0.04, 25_000.0), &hit(64), 0);
    assert_eq!((slow.fetch_pages, slow.reason), (0, PlanReason::RecomputeFaster));
    assert_eq!(slow.expected, slow.recompute);
    // pages already on their way are kept
    assert_eq!(plan(&rates(0.04, 25_000.0), &hit(64), 5).fetch_pages, 5);
    // pages that arrived cost nothing more: waiting for the rest of a slow read is not worth it, keeping what
    // came is
    let arrived = Hit { arrived_pages: 40, ..hit(64) };
    assert_eq!(plan(&rates(0.04, 25_000.0), &arrived, 40).fetch_pages, 40);
    assert_eq!(plan(&rates(2.0, 25_000.0), &arrived, 40).fetch_pages, 64);
}

#[test]
fn without_a_compute_rate_the_hit_is_fetched_whole() {
    let unknown = Rates { prefill_s_per_token: None, ..rates(0.001, 1.0) };
    let unmeasured_tier = Rates { storage_read_bytes_per_s: None, ..rates(0.001, 1.0) };
    assert_eq!(plan(&unmeasured_tier, &hit(10), 0).reason, PlanReason::Unmeasured);
    let planned = plan(&unknown, &hit(10), 0);
    assert_eq!((planned.fetch_pages, planned.reason), (10, PlanReason::Unmeasured));
}

#[test]
fn an_engine_that_splits_measures_an_unknown_tier_with_the_tail_of_the_hit() {
    let unmeasured_tier = Rates { storage_read_bytes_per_s: None, ..rates(0.001, 25_000.0) };
    let unknown_compute = Rates { prefill_s_per_token: None, ..rates(2.0, 1.0) };
    for rates in [unmeasured_tier, unknown_compute] {
        for (pages, tail) in [(10, 3), (8, 2), (2, 1), (1, 1)] {
            let planned = plan(&rates, &Hit { split: true, ..hit(pages) }, 0);
            assert_eq!(planned.reason, PlanReason::Unmeasured);
            assert_eq!((planned.compute_head_pages, planned.fetch_pages), (pages - tail, tail), "{pages} pages");
        }
        // the tail is at least the fewest pages worth a read (the prefetch threshold)
        let threshold = plan(&rates, &Hit { split: true, min_fetch_pages: 4, ..hit(10) }, 0);
        assert_eq!((threshold.compute_head_pages, threshold.fetch_pages), (6, 4));
        let short = plan(&rates, &Hit { split: true, min_fetch_pages: 12, ..hit(10) }, 0);
        assert_eq!((short.compute_head_pages, short.fetch_pages), (0, 10));
        // pages already on their way, or arrived, are the hit's head: no split, the whole hit is fetched
        let on_their_way = plan(&rates, &Hit { split: true, ..hit(10) }, 4);
        let arrived = plan(&rates, &Hit { split: true, arrived_pages: 4, ..hit(10) }, 0);
        for planned in [on_their_way, arrived] {
            assert_eq!((planned.compute_head_pages, planned.fetch_pages), (0, 10));
        }
    }
}

#[test]
fn a_tier_as_slow_as_the_compute_is_met_in_the_middle() {
    // a page's read (128 KiB at 102.4 MB/s) takes as long as its compute (32 tokens at 25 000 tokens/s): the
    // engine computes half the hit while the other half is read, in about half the time of either alone
    let even = Rates { storage_call_s: 0.0, ..rates(0.1024, 25_000.0) };
    let split = Hit { cached_tokens: 0, prompt_tokens: 64 * 32 + 1, split: true, ..hit(64) };
    let planned = plan(&even, &split, 0);
    assert_eq!(planned.reason, PlanReason::Split, "{planned:?}");
    assert_eq!(planned.compute_head_pages + planned.fetch_pages, 64);
    assert!((31..=33).contains(&planned.compute_head_pages), "{planned:?}");
    let ratio = planned.expected.as_secs_f64() / planned.fetch_all.min(planned.recompute).as_secs_f64();
    assert!((0.49..0.53).contains(&ratio), "{ratio} {planned:?}");
    // an engine that cannot split, or a hit whose first pages are on their way, is not split
    let whole = plan(&even, &Hit { split: false, ..split }, 0);
    assert_eq!(whole.compute_head_pages, 0);
    assert_eq!(plan(&even, &split, 1).compute_head_pages, 0);
    assert_eq!(plan(&even, &Hit { arrived_pages: 1, ..split }, 0).compute_head_pages, 0);
    // a fast tier is fetched whole, a very slow one not at all: a split only where it is faster
    // (at 2 GB/s, computing 3 pages while the other 61 are read would gain 3%: not enough for a split)
    let fast = plan(&rates(2.0, 25_000.0), &split, 0);
    assert_eq!(fast.reason, PlanReason::FetchAll);
    let two = rates(2.0, 25_000.0);
    assert!(two.split_ttft_s(&split, 3) < two.ttft_s(&split, 64) && fast.expected == fast.fetch_all);
    assert_eq!(plan(&rates(0.001, 25_000.0), &split, 0).reason, PlanReason::RecomputeFaster);
}

#[test]
fn a_slow_load_makes_part_of_a_hit_worth_fetching() {
    // storage reads at once; the load (1 GB/s: 1.05 ms a page) runs beside the compute of the rest (1 ms a page):
    // the best is to load about half and compute the other half at the same time
    let rates = Rates {
        storage_call_s: 0.0,
        storage_read_bytes_per_s: Some(1e15),
        load_bytes_per_s: 1e9,
        prefill_s_per_token: Some(1e-5),
        prefill_s_per_token_per_prefix: 0.0,
        batch_pages: 8,
    };
    let hit = Hit {
        cached_tokens: 0,
        pages: 100,
        page_tokens: 100,
        page_bytes: 1 << 20,
        prompt_tokens: 10_000,
        arrived_pages: 0,
        split: false,
        min_fetch_pages: 1,
    };
    let planned = plan(&rates, &hit, 0);
    assert_eq!((planned.fetch_pages, planned.reason), (49, PlanReason::FetchPart), "{planned:?}");
    let brute = (0..=hit.pages).map(|fetch| rates.ttft_s(&hit, fetch)).fold(f64::INFINITY, f64::min);
    assert!((rates.ttft_s(&hit, planned.fetch_pages) - brute).abs() <= 1e-12);
    assert!(planned.expected < planned.fetch_all && planned.expected < planned.recompute, "{planned:?}");
}

#[test]
fn measured_rates_replace_the_priors() {
    let priors = Priors {
        storage_read_bytes_per_s: Some(1e9),
        storage_call_s: 0.0,
        load_bytes_per_s: 1e10,
        prefill_tokens_per_s: None,
    };
    let mut model = CostModel::new(priors, 4);
    assert_eq!(model.rates().prefill_s_per_token, None);
    assert!((model.rates().storage_read_bytes_per_s.unwrap() / 1e9 - 1.0).abs() < 1e-12);
    // reads: 1 ms per call plus 2 GB/s, in batches of different sizes
    for (calls, bytes) in [(1, 1u64 << 20), (2, 8 << 20), (1, 4 << 20), (3, 2 << 20)] {
        let seconds = calls as f64 * 1e-3 + bytes as f64 / 2e9;
        model.observe_read(calls, bytes, Duration::from_secs_f64(seconds));
    }
    let measured = model.rates();
    assert!((measured.storage_read_bytes_per_s.unwrap() / 2e9 - 1.0).abs() < 1e-6, "{measured:?}");
    // a hit query's calls alone (no bytes): the cost of a call, the prior per byte
    let mut queried = CostModel::new(priors, 4);
    queried.observe_read(3, 0, Duration::from_millis(6));
    let rates = queried.rates();
    assert!((rates.storage_call_s / 2e-3 - 1.0).abs() < 1e-9, "{rates:?}");
    assert!((rates.storage_read_bytes_per_s.unwrap() / 1e9 - 1.0).abs() < 1e-9, "{rates:?}");
    assert!((measured.storage_call_s / 1e-3 - 1.0).abs() < 1e-6, "{measured:?}");
    // prefills: 40 us per token plus 1 ns per token of prefix
    for (tokens, prefix) in [(512, 0), (512, 4096), (1024, 512), (64, 8192)] {
        let (n, x) = (tokens as f64, prefix as f64);
        let seconds = 4e-5 * n + 1e-9 * (n * x + n * n / 2.0);
        model.observe_prefill(tokens, prefix, Duration::from_secs_f64(seconds));
    }
    let measured = model.rates();
    assert!((measured.prefill_s_per_token.unwrap() / 4e-5 - 1.0).abs() < 1e-6, "{measured:?}");
    assert!((measured.prefill_s_per_token_per_prefix / 1e-9 - 1.0).abs() < 1e-6, "{measured:?}");
}

#[test]
fn a_read_slower_than_the_fit_slows_the_plans_rate_until_reads_are_steady_again() {
    let mut model = CostModel::new(Priors::UNKNOWN, 4);
    let steady = |bytes: u64| Duration::from_secs_f64(bytes as f64 / 1e9);
    for bytes in [1u64 << 20, 2 << 20, 3 << 20, 4 << 20] {
        model.observe_read(1, bytes, steady(bytes));
    }
    assert!((model.rates().storage_read_bytes_per_s.unwrap() / 1e9 - 1.0).abs() < 1e-6);
    // one read at half the speed: the plans' rate halves at once (the fit itself moves by a 32nd)
    model.observe_read(1, 4 << 20, steady(8 << 20));
    let slowed = model.rates().storage_read_bytes_per_s.unwrap();
    assert!(slowed < 0.55e9, "{slowed}");
    // steady reads take it back towards the fit, a little each
    let mut last = slowed;
    for _ in 0..64 {
        model.observe_read(1, 4 << 20, steady(4 << 20));
        let now = model.rates().storage_read_bytes_per_s.unwrap();
        assert!(now >= last, "{now} < {last}");
        last = now;
    }
    assert!(last > 0.85e9, "{last}");
    // a read 100 times slower slows the plans 4 times at most beyond what it does to the fit
    model.observe_read(1, 4 << 20, steady(400 << 20));
    assert_eq!(model.read_slack, MAX_SLACK);
}

fn arb_rates() -> impl Strategy<Value = Rates> {
    (0.0f64..1e-2, 1e6f64..1e11, 1e8f64..1e11, 1e-7f64..1e-3, 0.0f64..1e-8, 1usize..256).prop_map(
        |(call, read, load, alpha, beta, batch_pages)| Rates {
            storage_call_s: call,
            storage_read_bytes_per_s: Some(read),
            load_bytes_per_s: load,
            prefill_s_per_token: Some(alpha),
            prefill_s_per_token_per_prefix: beta,
            batch_pages,
        },
    )
}

fn arb_hit() -> impl Strategy<Value = Hit> {
    (0usize..8192, 0usize..2000, 1usize..128, 1u64..1 << 24, 0usize..4096, 0usize..2000, any::<bool>()).prop_map(
        |(cached, pages, page_tokens, page_bytes, after, arrived, split)| Hit {
            cached_tokens: cached,
            pages,
            page_tokens,
            page_bytes,
            prompt_tokens: cached + pages * page_tokens + after,
            // a split is planned only before anything arrived: half the hits are such
            arrived_pages: if split { 0 } else { arrived.min(pages) },
            split,
            min_fetch_pages: 1 + arrived % 16,
        },
    )
}

proptest! {
    #[test]
    fn the_plan_is_the_best_of_every_split(rates in arb_rates(), hit in arb_hit(), at_least in 0usize..2500) {
        let planned = plan(&rates, &hit, at_least);
        let floor = at_least.min(hit.pages);
        let head = planned.compute_head_pages;
        prop_assert!(head + planned.fetch_pages <= hit.pages);
        let chosen = if head > 0 {
            prop_assert!(hit.split && floor == 0 && planned.reason == PlanReason::Split);
            prop_assert_eq!(head + planned.fetch_pages, hit.pages);
            rates.split_ttft_s(&hit, head)
        } else {
            prop_assert!(planned.fetch_pages >= floor && planned.fetch_pages <= hit.pages);
            rates.ttft_s(&hit, planned.fetch_pages)
        };
        if hit.split && floor == 0 {
            // against every head: a split is the best of them, and a plan without one leaves none that gains
            // SPLIT_GAIN over it
            let bound = if head > 0 { chosen } else { chosen * (1.0 - SPLIT_GAIN) };
            for head in 1..hit.pages {
                let other = rates.split_ttft_s(&hit, head);
                prop_assert!(bound <= other * (1.0 + 1e-9), "computing a head of {head} ({other}) beats the plan {planned:?} ({chosen})");
            }
        }
        // against every count (a relative slack for rounding: the plan evaluates only the candidates)
        for fetch in floor..=hit.pages {
            let other = rates.ttft_s(&hit, fetch);
            prop_assert!(chosen <= other * (1.0 + 1e-9), "fetching {fetch} ({other}) beats the plan's {} ({chosen})", planned.fetch_pages);
        }
        // never slower than either extreme it could choose
        prop_assert!(chosen <= rates.ttft_s(&hit, hit.pages));
        if floor == 0 {
            prop_assert!(chosen <= rates.ttft_s(&hit, 0));
        }
    }

    #[test]
    fn a_faster_tier_never_fetches_fewer_pages(
        rates in arb_rates(), hit in arb_hit(), faster in 1.0f64..100.0, lower_latency in 0.0f64..=1.0,
    ) {
        let quicker = Rates {
            storage_read_bytes_per_s: rates.storage_read_bytes_per_s.map(|rate| rate * faster),
            storage_call_s: rates.storage_call_s * lower_latency,
            ..rates
        };
        prop_assert!(plan(&quicker, &hit, 0).fetch_pages >= plan(&rates, &hit, 0).fetch_pages);
    }

    #[test]
    fn the_reduced_rates_are_the_slowest_ranks(first in arb_rates(), second in arb_rates()) {
        // each rank encodes its own rates; the collective keeps each value's largest (slowest); both ranks
        // decode the same integers
        let (a, b) = (first.encode(), second.encode());
        let reduced: [i64; ENCODED] = std::array::from_fn(|index| a[index].max(b[index]));
        let agreed = Rates::decode(&reduced, first.batch_pages);
        for own in [Rates::decode(&a, first.batch_pages), Rates::decode(&b, first.batch_pages)] {
            prop_assert!(agreed.storage_call_s >= own.storage_call_s);
            prop_assert!(agreed.storage_read_bytes_per_s <= own.storage_read_bytes_per_s);
            prop_assert!(agreed.load_bytes_per_s <= own.load_bytes_per_s);
            prop_assert!(agreed.prefill_s_per_token >= own.prefill_s_per_token);
            prop_assert!(agreed.prefill_s_per_token_per_prefix >= own.prefill_s_per_token_per_prefix);
        }
        // encoding what was decoded changes nothing: the values survive the next tick's reduction as they are
        prop_assert_eq!(agreed.encode(), reduced);
    }
}
