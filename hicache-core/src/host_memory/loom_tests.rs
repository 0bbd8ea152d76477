//! Loom models of the host memory's leases under concurrent threads.

use loom::sync::Arc;

use super::*;
use crate::controller::Progress;
use crate::geometry::{KvDtype, KvGeometry};
use crate::layout::HostLayout;

/// The fetch protocol: the fetch thread writes a page under a write lease, returns the lease, then counts the
/// page. A load that sees the count can always lend the page for reading and finds the fetched bytes; a read
/// lease granted earlier never overlaps the write.
#[test]
fn a_counted_fetch_is_readable_and_never_read_while_written() {
    loom::model(|| {
        let geometry = KvGeometry::mha(1, 1, 4, KvDtype::Bf16).unwrap();
        let map = HostLayoutMap::new(geometry, HostLayout::PageFirst, 1, 1).unwrap();
        let memory = Arc::new(HostMemory::anonymous(map).unwrap());
        let progress = Arc::new(Progress::default());
        let fetch = {
            let (memory, progress) = (memory.clone(), progress.clone());
            loom::thread::spawn(move || {
                let mut lease = loop {
                    match memory.lend_write(&ids(&memory, &[0])) {
                        Ok(lease) => break lease,
                        Err(_) => loom::thread::yield_now(),
                    }
                };
                lease.pages_mut().iter_mut().flatten().for_each(|segment| segment.fill(9));
                drop(lease);
                progress.increment(1).unwrap();
            })
        };
        loop {
            let counted = progress.completed() > 0;
            match memory.lend_read(&ids(&memory, &[0])) {
                Ok(lease) => {
                    let first = lease.page(0)[0][0];
                    if counted {
                        assert_eq!(first, 9, "a counted page holds its fetched bytes");
                        break;
                    }
                    assert!(first == 0 || first == 9, "a read lease never sees a write in progress");
                }
                Err(_) => assert!(!counted, "a counted page is not lent for writing any more"),
            }
            loom::thread::yield_now();
        }
        fetch.join().unwrap();
    });
}

/// Page ids of `memory`'s pool by index (out of range ones included, to be refused).
fn ids(memory: &HostMemory, indices: &[usize]) -> Vec<HostPageId> {
    indices.iter().map(|&index| HostPageId::new(memory.pool, index)).collect()
}
