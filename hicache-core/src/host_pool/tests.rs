//! The host page allocator's invariants under random operation sequences, and its contiguity search.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

#[test]
fn double_free_and_foreign_pages_are_refused_and_change_nothing() {
    let mut pool = HostPageAllocator::new(4).unwrap();
    let mut other = HostPageAllocator::new(4).unwrap();
    let pages = pool.alloc(2).unwrap();
    assert_eq!(pages.iter().map(|page| page.index()).collect::<Vec<_>>(), [0, 1]);
    pool.free(&pages[..1]).unwrap();
    let error = pool.free(&pages).unwrap_err();
    assert!(matches!(error, Error::DoubleFree { .. }), "{error}");
    assert_eq!(pool.state(pages[1]).unwrap(), PageState::Reserved, "a failed free frees nothing");
    let foreign = other.alloc(1).unwrap();
    assert!(matches!(pool.free(&foreign).unwrap_err(), Error::ForeignPage { .. }));
    assert!(matches!(pool.free(&[pages[1], pages[1]]).unwrap_err(), Error::DoubleFree { .. }));
    pool.check_invariants().unwrap();
    assert_eq!(pool.available(), 3);
}

#[test]
fn transitions_are_checked_in_release_builds_too() {
    let mut pool = HostPageAllocator::new(2).unwrap();
    let pages = pool.alloc(2).unwrap();
    let error = pool.complete_io(&pages).unwrap_err().to_string();
    assert_eq!(
        error,
        "complete_io on page 0 of pool 1: expected protected, found reserved"
            .replace("pool 1", &format!("pool {}", pool.pool))
    );
    pool.protect_write(&pages).unwrap();
    pool.complete_io(&pages).unwrap();
    pool.update_backup(&pages).unwrap();
    pool.protect_load(&pages[..1]).unwrap();
    assert!(pool.update_backup(&pages).is_err(), "page 0 is protected, so nothing moves");
    assert_eq!(pool.state(pages[1]).unwrap(), PageState::Backup);
    assert!(pool.alloc(1).is_none());
}

#[test]
fn a_churned_pool_hands_out_a_run_where_it_has_one_and_ascending_pages_otherwise() {
    let mut pool = HostPageAllocator::new(200).unwrap();
    let all = pool.alloc(200).unwrap();
    let indices = |pages: &[HostPageId]| pages.iter().map(|page| page.index()).collect::<Vec<_>>();
    // free every third page, and one run of five at 131..136 (130 and 136 stay taken)
    let scattered: Vec<HostPageId> = all.iter().copied().filter(|page| page.index() % 3 == 0).collect();
    pool.free(&scattered).unwrap();
    pool.free(&all[131..136].iter().copied().filter(|page| page.index() % 3 != 0).collect::<Vec<_>>()).unwrap();
    assert_eq!(indices(&pool.alloc(5).unwrap()), [131, 132, 133, 134, 135]);
    // no run of four remains: the next idle pages after the cursor, ascending
    assert_eq!(indices(&pool.alloc(4).unwrap()), [138, 141, 144, 147]);
    pool.check_invariants().unwrap();
    // runs are sought from the cursor on, then from the start: 9..20 is the first run of three
    pool.free(&all[10..20].iter().copied().filter(|page| page.index() % 3 != 0).collect::<Vec<_>>()).unwrap();
    assert_eq!(indices(&pool.alloc(3).unwrap()), [9, 10, 11]);
    assert_eq!(indices(&pool.alloc(3).unwrap()), [12, 13, 14]);
    pool.check_invariants().unwrap();
    // a pool that is not a whole number of words: the last page is handed out, nothing past it
    let mut odd = HostPageAllocator::new(65).unwrap();
    assert_eq!(odd.alloc(65).unwrap().last().unwrap().index(), 64);
    assert!(odd.alloc(1).is_none());
    odd.check_invariants().unwrap();
}

#[test]
fn the_search_for_a_run_is_bounded() {
    let pages = SCAN_WORDS * 64 * 2;
    let mut pool = HostPageAllocator::new(pages).unwrap();
    let all = pool.alloc(pages).unwrap();
    // single idle pages over the whole first half, and a run of four beyond it
    let singles: Vec<HostPageId> = all[..pages / 2].iter().copied().step_by(2).collect();
    pool.free(&singles).unwrap();
    pool.free(&all[pages - 10..pages - 6]).unwrap();
    let got: Vec<usize> = pool.alloc(4).unwrap().iter().map(|page| page.index()).collect();
    assert_eq!(got, [0, 2, 4, 6], "the run lies past the search budget: scattered pages from the cursor");
    // within the budget from the cursor, the run is found
    let near: Vec<HostPageId> = all[pages / 2 + 1..pages / 2 + 5].to_vec();
    pool.free(&near).unwrap();
    let got: Vec<usize> = pool.alloc(4).unwrap().iter().map(|page| page.index()).collect();
    assert_eq!(got, (pages / 2 + 1..pages / 2 + 5).collect::<Vec<_>>());
    pool.check_invariants().unwrap();
}

#[derive(Clone, Debug)]
enum Step {
    Alloc(usize),
    Free(Vec<usize>),
    Move(usize, Vec<usize>),
    Clear,
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        4 => (0usize..6).prop_map(Step::Alloc),
        3 => prop::collection::vec(0usize..24, 0..4).prop_map(Step::Free),
        4 => (0usize..7, prop::collection::vec(0usize..24, 0..4)).prop_map(|(op, pages)| Step::Move(op, pages)),
        1 => Just(Step::Clear),
    ];
    prop::collection::vec(step, 0..80)
}

/// The transition table, written out independently of the allocator.
fn model_transition(op: usize, state: PageState) -> Option<PageState> {
    use PageState::*;
    match (op, state) {
        (0, Reserved) => Some(Protected),
        (1, Backup) => Some(Protected),
        (2, Protected) => Some(Synced),
        (3, Synced) => Some(Backup),
        (4, Reserved) => Some(Backup),
        (5, Idle) => None,
        (5, _) => Some(Synced),
        (6, Idle) => None,
        (6, _) => Some(Idle),
        _ => None,
    }
}

proptest! {
    #[test]
    fn random_sequences_match_a_model(steps in steps()) {
        const PAGES: usize = 16;
        let mut pool = HostPageAllocator::new(PAGES).unwrap();
        let mut model: HashMap<usize, PageState> = (0..PAGES).map(|page| (page, PageState::Idle)).collect();
        for step in steps {
            match step {
                Step::Alloc(count) => {
                    let idle = model.values().filter(|&&state| state == PageState::Idle).count();
                    // an independent look for a run of `count` idle pages: then the allocation must be one
                    let has_run = count > 0 && (0..=PAGES.saturating_sub(count)).any(|start| {
                        (start..start + count).all(|page| model[&page] == PageState::Idle)
                    });
                    match pool.alloc(count) {
                        Some(pages) => {
                            prop_assert!(count <= idle);
                            prop_assert_eq!(pages.len(), count);
                            if has_run {
                                let contiguous = pages.windows(2).all(|pair| pair[1].index() == pair[0].index() + 1);
                                prop_assert!(contiguous, "a run of {} existed but got {:?}", count, pages);
                            }
                            for page in pages {
                                prop_assert_eq!(model.insert(page.index(), PageState::Reserved), Some(PageState::Idle));
                            }
                        }
                        None => prop_assert!(count > idle),
                    }
                }
                Step::Free(indices) | Step::Move(6, indices) => {
                    // indices ≥ PAGES stand for pages of another pool
                    let pages: Vec<HostPageId> = indices
                        .iter()
                        .map(|&index| pool.page_id(index).unwrap_or(HostPageId { pool: u32::MAX, index: index as u32 }))
                        .collect();
                    let mut sorted = indices.clone();
                    sorted.sort_unstable();
                    sorted.dedup();
                    let valid = sorted.len() == indices.len()
                        && indices.iter().all(|index| model.get(index).is_some_and(|&state| state != PageState::Idle));
                    prop_assert_eq!(pool.free(&pages).is_ok(), valid);
                    if valid {
                        for index in indices {
                            model.insert(index, PageState::Idle);
                        }
                    }
                }
                Step::Move(op, indices) => {
                    let pages: Vec<HostPageId> = indices.iter().filter_map(|&index| pool.page_id(index).ok()).collect();
                    let mut sorted: Vec<usize> = pages.iter().map(|page| page.index()).collect();
                    sorted.sort_unstable();
                    sorted.dedup();
                    let next: Option<Vec<PageState>> = if sorted.len() == pages.len() {
                        pages.iter().map(|page| model_transition(op, model[&page.index()])).collect()
                    } else {
                        None
                    };
                    let result = match op {
                        0 => pool.protect_write(&pages),
                        1 => pool.protect_load(&pages),
                        2 => pool.complete_io(&pages),
                        3 => pool.update_backup(&pages),
                        4 => pool.update_prefetch(&pages),
                        _ => pool.update_synced(&pages),
                    };
                    prop_assert_eq!(result.is_ok(), next.is_some());
                    if let Some(next) = next {
                        for (page, state) in pages.iter().zip(next) {
                            model.insert(page.index(), state);
                        }
                    }
                }
                Step::Clear => {
                    pool.clear();
                    model.values_mut().for_each(|state| *state = PageState::Idle);
                }
            }
            pool.check_invariants().map_err(|error| TestCaseError::fail(error.to_string()))?;
            for (index, state) in pool.states().iter().enumerate() {
                prop_assert_eq!(*state, model[&index]);
            }
        }
    }
}
