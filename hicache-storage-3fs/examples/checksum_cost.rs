//! What the page checksum costs beside a page read, in one run: XXH3-64 over 8 MiB pages against reading the same
//! pages back from a file (`pread`, from the page cache: the fastest a read gets, so the largest share the checksum
//! can take; a 3FS read over the network is slower).
//!
//! `cargo run --release -p hicache-storage-3fs --example checksum_cost [-- DIR]`

use std::os::unix::fs::FileExt;
use std::time::Instant;

const PAGE: usize = 8 << 20;
const PAGES: usize = 64;
const ROUNDS: usize = 5;

fn main() {
    let dir = std::env::args().nth(1).map_or_else(std::env::temp_dir, Into::into);
    let path = dir.join(format!("hicache-checksum-cost-{}", std::process::id()));
    let page: Vec<u8> = (0..PAGE).map(|at| (at as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes()[7]).collect();
    let file = std::fs::File::create_new(&path).expect("a scratch file");
    for index in 0..PAGES {
        file.write_all_at(&page, (index * PAGE) as u64).expect("written");
    }
    let mut buffer = vec![0u8; PAGE];
    let (mut read_s, mut hash_s, mut sum) = (Vec::new(), Vec::new(), 0u64);
    for _ in 0..ROUNDS {
        let started = Instant::now();
        for index in 0..PAGES {
            file.read_exact_at(&mut buffer, (index * PAGE) as u64).expect("read");
        }
        read_s.push(started.elapsed().as_secs_f64());
        let started = Instant::now();
        for _ in 0..PAGES {
            sum = sum.wrapping_add(hicache_storage_3fs::layout::checksum([&buffer[..]]));
        }
        hash_s.push(started.elapsed().as_secs_f64());
    }
    std::fs::remove_file(&path).expect("removed");
    let median = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let (read, hash) = (median(&mut read_s), median(&mut hash_s));
    let gb = (PAGE * PAGES) as f64 / 1e9;
    println!(
        "{PAGES} pages of 8 MiB, median of {ROUNDS}: read {:.2} GB/s, checksum {:.2} GB/s: the checksum adds {:.1}% to a \
         read (digest {sum:x})",
        gb / read,
        gb / hash,
        100.0 * hash / read
    );
}
