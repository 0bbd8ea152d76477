//! What checking each page's checksum costs a read, in one run: the same batches read through the backend (on the
//! USRBIO mock) with `verify_checksum` on and off, alternating; the median of the rounds' ratios. Twice: from data
//! files in the page cache (a read is then a memory copy: the fastest a read gets, so the largest share the check can
//! take), and from the disk (the data files' cached pages dropped before every read, as a read from storage that is
//! not this machine's memory).
//!
//! `cargo build -p hicache-usrbio-mock && cargo run --release -p hicache-storage-3fs --example checksum_cost` (data
//! files in a temporary folder)

use std::time::Instant;

use rand::Rng as _;

use hicache_core::geometry::KvGeometry;
use hicache_core::hash::PageKey;
use hicache_core::host_memory::{HostAllocation, HostMemory};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{GetOutcome, PageSegmentsMut, SetOutcome, StorageBackend};
use hicache_storage_3fs::testing::Mount;
use hicache_storage_3fs::{Hf3fsConfig, Hf3fsStorage};

/// 64 tokens of Llama-3.1-8B's KV (32 layers, 8 KV heads of 128, bf16): 8 MiB.
const PAGE_TOKENS: usize = 64;
const PAGES: usize = 32;
const BATCH: usize = 16;
const ROUNDS: usize = 9;

fn main() {
    let mount = Mount::new();
    let namespace =
        StorageNamespace::single_rank("checksum-cost", KvGeometry::llama31_8b(), HostLayout::PageFirst, PAGE_TOKENS);
    let open = |verify: bool, numjobs: usize| {
        let config = Hf3fsConfig { numjobs, entries: 8, verify_checksum: verify, ..mount.config(2 << 30, None) };
        Hf3fsStorage::open(config, &namespace).expect("opens on the mock mount")
    };
    let writer = open(true, 16);
    let page_bytes = writer.space().page_bytes as usize;
    let keys: Vec<PageKey> = (0..PAGES).map(|_| PageKey::from_bytes(rand::random())).collect();
    let pages: Vec<Vec<u8>> = (0..PAGES)
        .map(|_| {
            let mut page = vec![0u8; page_bytes];
            rand::rng().fill_bytes(&mut page);
            page
        })
        .collect();
    for (keys, pages) in keys.chunks(BATCH).zip(pages.chunks(BATCH)) {
        let sources: Vec<Vec<&[u8]>> = pages.iter().map(|page| vec![page.as_slice()]).collect();
        let outcomes = writer.batch_set(keys, &sources).expect("batch_set");
        assert!(outcomes.iter().all(|outcome| *outcome == SetOutcome::Stored), "{outcomes:?}");
    }
    drop(writer);
    // the pages land in a private buffer (through a ring's bounce iov, then copied) or in a host pool in shared
    // memory that the backend registered (in place, as 3FS's agent maps the pool)
    let host = HostMemory::new(
        HostLayoutMap::new(KvGeometry::llama31_8b(), HostLayout::PageFirst, PAGE_TOKENS, BATCH).expect("a layout"),
        &HostAllocation::shared_memory(),
    )
    .expect("a host pool in /dev/shm");
    let mut buffers = vec![vec![0u8; page_bytes]; BATCH];
    // seconds in the backend's reads (the byte checks after them not counted)
    let mut read_all = |backend: &Hf3fsStorage, in_place: bool| {
        let mut seconds = 0.0;
        for (batch, keys) in keys.chunks(BATCH).enumerate() {
            let expected = &pages[batch * BATCH..(batch + 1) * BATCH];
            if in_place {
                let pool = host.all_pages();
                let mut lease = host.lend_write(&pool).expect("the pool's pages");
                let mut targets = lease.pages_mut();
                let started = Instant::now();
                let outcomes = backend.batch_get(keys, &mut targets).expect("batch_get");
                seconds += started.elapsed().as_secs_f64();
                drop(targets);
                assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit), "{outcomes:?}");
                drop(lease);
                assert_eq!(host.copy_pages_out(&pool).expect("the pool's bytes"), expected.concat(), "bytes differ");
            } else {
                let mut targets: Vec<PageSegmentsMut<'_>> =
                    buffers.iter_mut().map(|buffer| vec![buffer.as_mut_slice()]).collect();
                let started = Instant::now();
                let outcomes = backend.batch_get(keys, &mut targets).expect("batch_get");
                seconds += started.elapsed().as_secs_f64();
                assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit), "{outcomes:?}");
                drop(targets);
                assert!(buffers.iter().zip(expected).all(|(read, page)| read == page), "bytes differ");
            }
        }
        seconds
    };
    // the data files' pages leave the page cache (written back first), so the next read comes from the disk
    let evict = || {
        for entry in std::fs::read_dir(mount.path()).expect("the mount") {
            let path = entry.expect("an entry").path();
            if path.extension().is_some_and(|extension| extension == "bin") {
                let file = std::fs::File::open(&path).expect("a data file");
                file.sync_all().expect("written back");
                // SAFETY: the descriptor is `file`'s, open for this call; the advice changes no memory of ours.
                let advised = unsafe {
                    libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, libc::POSIX_FADV_DONTNEED)
                };
                assert_eq!(advised, 0, "posix_fadvise on {}", path.display());
            }
        }
    };
    let median = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let gb = (PAGES * page_bytes) as f64 / 1e9;
    println!("{PAGES} pages of {} MiB in batches of {BATCH}, medians of {ROUNDS} rounds:", page_bytes >> 20);
    // one ring: its reads on the mock's worker thread, the hashes on the caller's (as 3FS moves the bytes without
    // the client's CPU); SGLang's 16 rings: two chunks of a batch at once, every core busy with reads
    for (from_disk, numjobs, in_place) in [false, true]
        .into_iter()
        .flat_map(|disk| [(disk, 1, true), (disk, 16, true), (disk, 1, false), (disk, 16, false)])
    {
        let (verified, unverified) = (open(true, numjobs), open(false, numjobs));
        if in_place {
            for backend in [&verified, &unverified] {
                backend.register_host_memory(&host.region()).expect("the pool registered");
            }
        }
        let (mut with, mut without, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            if from_disk {
                evict();
            }
            with.push(read_all(&verified, in_place));
            if from_disk {
                evict();
            }
            without.push(read_all(&unverified, in_place));
            ratios.push(with[with.len() - 1] / without[without.len() - 1]);
        }
        println!(
            "  {:<10} {:<9} numjobs {numjobs:>2}: read {:.2} GB/s unverified, {:.2} GB/s verified; a verified read takes \
             {:.3}x the time of an unverified one (median of the rounds' ratios)",
            if from_disk { "disk" } else { "page cache" },
            if in_place { "in place" } else { "bounced" },
            gb / median(&mut without),
            gb / median(&mut with),
            median(&mut ratios)
        );
    }
}
