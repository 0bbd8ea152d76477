//! Host memory: page-aligned zeroed pools, shared-memory pools, and leases checked against a reader-writer model.

use proptest::prelude::*;

use super::*;
use crate::geometry::{KvDtype, KvGeometry};
use crate::layout::HostLayout;

fn memory(pages: usize, allocation: &HostAllocation) -> HostMemory {
    let geometry = KvGeometry::mha(2, 1, 4, KvDtype::Bf16).unwrap();
    HostMemory::new(HostLayoutMap::new(geometry, HostLayout::LayerFirst, 2, pages).unwrap(), allocation).unwrap()
}

#[test]
fn pools_are_page_aligned_and_zeroed() {
    let memory = memory(5, &HostAllocation::Anonymous);
    assert_eq!(memory.as_ptr().align_offset(4096), 0);
    assert!(memory.with_all_mut(|bytes| bytes.iter().all(|&byte| byte == 0)));
    assert_eq!(memory.region().len(), memory.map().total_bytes());
    assert_eq!(memory.region().shared_memory(), None);
}

#[test]
fn a_shared_memory_pool_is_the_same_bytes_through_its_file() {
    let dir = std::env::temp_dir().join(format!("hicache-shm-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let memory = memory(3, &HostAllocation::SharedMemory { dir: dir.clone() });
    let path = memory.region().shared_memory().unwrap().to_owned();
    assert!(path.starts_with(&dir));
    {
        let mut lease = memory.lend_write(&ids(&memory, &[1])).unwrap();
        for segment in lease.pages_mut().iter_mut().flatten() {
            segment.fill(0xa5);
        }
    }
    // an independent mapping of the file, as another process would make it, sees the page's bytes
    let file = std::fs::OpenOptions::new().read(true).open(&path).unwrap();
    // SAFETY: the test's own file, not truncated while mapped.
    let other = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    let expected = memory.copy_pages_out(&ids(&memory, &[1])).unwrap();
    let found: Vec<u8> =
        memory.map().page_segments(1).iter().flat_map(|s| other[s.offset..s.offset + s.len].to_vec()).collect();
    assert_eq!(found, expected);
    assert!(expected.iter().all(|&byte| byte == 0xa5));
    drop(memory);
    assert!(!path.exists(), "the file goes with the pool");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_shared_memory_directory_that_is_missing_is_named() {
    let error = HostMemory::new(
        HostLayoutMap::new(KvGeometry::mha(1, 1, 4, KvDtype::Bf16).unwrap(), HostLayout::LayerFirst, 1, 1).unwrap(),
        &HostAllocation::SharedMemory { dir: "/does/not/exist".into() },
    )
    .unwrap_err()
    .to_string();
    assert!(error.starts_with("host_allocation: cannot create /does/not/exist/hicache-host-pool-"), "{error}");
}

#[test]
fn conflicting_leases_are_refused_with_the_page_named() {
    let memory = memory(4, &HostAllocation::Anonymous);
    let read = memory.lend_read(&ids(&memory, &[1, 2])).unwrap();
    let again = memory.lend_read(&ids(&memory, &[2, 2, 3])).unwrap();
    let error = memory.lend_write(&ids(&memory, &[0, 2])).unwrap_err().to_string();
    assert_eq!(error, "lend for writing on host page 2: expected not lent, found lent for reading (3 leases)");
    drop((read, again));
    let write = memory.lend_write(&ids(&memory, &[0, 2])).unwrap();
    let error = memory.lend_read(&ids(&memory, &[3, 0])).unwrap_err().to_string();
    assert_eq!(error, "lend for reading on host page 0: expected not lent for writing, found lent for writing");
    assert_eq!(memory.lent(&ids(&memory, &[3, 2])).map(|(page, how)| (page.index(), how)), Some((2, Access::Write)));
    assert_eq!(memory.lent_for_writing(&ids(&memory, &[3, 2])).map(HostPageId::index), Some(2));
    drop(write);
    assert_eq!(memory.lent(&ids(&memory, &[0, 1, 2, 3])), None);
    assert!(memory.lend_write(&ids(&memory, &[1, 1])).unwrap_err().to_string().contains("listed twice"));
    assert!(
        memory.lend_read(&ids(&memory, &[4])).unwrap_err().to_string().contains("host page 4 out of range (4 pages)")
    );
}

#[test]
fn pages_of_another_pool_are_refused_by_name_and_never_lent() {
    let (memory, other) = (memory(4, &HostAllocation::Anonymous), memory(4, &HostAllocation::Anonymous));
    let mine = memory.allocator().unwrap().alloc(2).unwrap();
    let foreign = other.allocator().unwrap().alloc(2).unwrap();
    assert_eq!(mine.iter().map(|page| page.index()).collect::<Vec<_>>(), [0, 1], "the same indices in both pools");
    let _held = memory.lend_write(&mine).unwrap();
    for error in [memory.lend_read(&foreign).map(drop), memory.lend_write(&foreign[1..]).map(drop)] {
        let error = error.unwrap_err().to_string();
        assert!(error.starts_with("pages: host page 1 of pool") || error.starts_with("pages: host page 0 of pool"));
        assert!(error.contains("is not a page of this host memory"), "{error}");
    }
    assert_eq!(memory.lent(&foreign), None, "a foreign page's index is not this pool's page");
    assert_eq!(memory.lent_for_writing(&foreign), None);
    assert_eq!(memory.all_pages().len(), 4);
    memory.check_pages(&memory.all_pages()).unwrap();
}

#[test]
fn a_waiting_lease_is_granted_when_the_conflict_returns() {
    let memory = std::sync::Arc::new(memory(2, &HostAllocation::Anonymous));
    let reader = memory.lend_read(&ids(&memory, &[1])).unwrap();
    let (granted, seen) = std::sync::mpsc::channel();
    let writer = std::thread::spawn({
        let memory = memory.clone();
        move || {
            let mut lease = memory.lend_write_waiting(&ids(&memory, &[1])).unwrap();
            lease.pages_mut()[0][0][0] = 7;
            granted.send(()).unwrap();
        }
    });
    assert!(seen.recv_timeout(std::time::Duration::from_millis(50)).is_err(), "granted while a reader held it");
    assert_eq!(reader.page(0)[0][0], 0, "nothing written under the reader");
    drop(reader);
    seen.recv().unwrap();
    writer.join().unwrap();
    assert_eq!(memory.copy_pages_out(&ids(&memory, &[1])).unwrap()[0], 7);
}

/// A lease operation of the model test: lend some pages for reading or writing, or return the n-th live lease.
#[derive(Clone, Debug)]
enum Step {
    Read(Vec<usize>),
    Write(Vec<usize>),
    Return(usize),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let pages = prop::collection::vec(0usize..6, 1..4);
    prop::collection::vec(
        prop_oneof![
            pages.clone().prop_map(Step::Read),
            pages.prop_map(Step::Write),
            (0usize..8).prop_map(Step::Return)
        ],
        1..40,
    )
}

proptest! {
    /// Leases against a model of reader counts: granted exactly when the model allows, and what a write lease
    /// writes is what a later read lease sees.
    #[test]
    fn leases_match_a_reader_writer_model(steps in steps()) {
        let memory = memory(6, &HostAllocation::Anonymous);
        let mut model = [0i64; 6]; // readers, or -1 for a writer
        let mut content = [0u8; 6];
        enum Held<'a> { Read(ReadLease<'a>), Write(WriteLease<'a>) }
        let mut live: Vec<Held<'_>> = Vec::new();
        for (stamp, step) in steps.into_iter().enumerate() {
            match step {
                Step::Read(pages) => {
                    let allowed = pages.iter().all(|&page| model[page] >= 0);
                    match memory.lend_read(&ids(&memory, &pages)) {
                        Ok(lease) => {
                            prop_assert!(allowed);
                            for (index, &page) in pages.iter().enumerate() {
                                model[page] += 1;
                                prop_assert!(lease.page(index).iter().all(|s| s.iter().all(|&b| b == content[page])));
                            }
                            live.push(Held::Read(lease));
                        }
                        Err(_) => prop_assert!(!allowed),
                    }
                }
                Step::Write(pages) => {
                    let mut unique = pages.clone();
                    unique.sort_unstable();
                    unique.dedup();
                    let allowed = unique.len() == pages.len() && pages.iter().all(|&page| model[page] == 0);
                    match memory.lend_write(&ids(&memory, &pages)) {
                        Ok(mut lease) => {
                            prop_assert!(allowed);
                            for (segments, &page) in lease.pages_mut().iter_mut().zip(&pages) {
                                model[page] = -1;
                                content[page] = stamp as u8;
                                segments.iter_mut().for_each(|segment| segment.fill(stamp as u8));
                            }
                            live.push(Held::Write(lease));
                        }
                        Err(_) => prop_assert!(!allowed),
                    }
                }
                Step::Return(index) if !live.is_empty() => {
                    match live.remove(index % live.len()) {
                        Held::Read(lease) => lease.page_ids().iter().for_each(|page| model[page.index()] -= 1),
                        Held::Write(lease) => lease.page_ids().iter().for_each(|page| model[page.index()] = 0),
                    }
                }
                Step::Return(_) => {}
            }
            let lent = memory.lent(&ids(&memory, &[0, 1, 2, 3, 4, 5])).map(|(page, _)| page.index());
            prop_assert_eq!(lent, model.iter().position(|&count| count != 0));
        }
    }
}

/// Page ids of `memory`'s pool by index (out of range ones included, to be refused).
fn ids(memory: &HostMemory, indices: &[usize]) -> Vec<HostPageId> {
    indices.iter().map(|&index| HostPageId::new(memory.pool, index)).collect()
}
