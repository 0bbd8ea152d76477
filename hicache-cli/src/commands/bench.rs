//! `hicache bench`: performance figures, each next to a reference measured in the same run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use hicache_core::hash::{Chain, PageHasher, PartialPage};
use serde::Serialize;
use sha2::{Digest, Sha256};

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// Page-key hashing throughput (Mtok/s) at page sizes 1 and 64, next to one-stream SHA-256 of the same bytes.
    ///
    /// The headline figure hashes a batch of independent requests (as a scheduler does each round), which the SHA
    /// extensions run interleaved; the figure for one chain alone is printed beside it.
    Hash(BenchHashArgs),
    /// Batched set and get of a storage backend (GB/s), next to raw sequential write and read of the same bytes in
    /// the same directory.
    Storage(super::bench_storage::BenchStorageArgs),
    /// Device↔host transfer throughput (GB/s) per geometry, layout, direction and page size, next to a bulk copy
    /// of the same bytes measured in the same run.
    Transfer(super::bench_transfer::BenchTransferArgs),
    /// The controller's own cost per operation (µs), on the CPU engine with in-memory storage and tiny pages.
    Controller(super::bench_controller::BenchControllerArgs),
}

/// Arguments of `hicache bench hash`.
#[derive(Debug, Args)]
pub(crate) struct BenchHashArgs {
    /// Print a JSON list of {page_size, mtok_per_s, single_chain_mtok_per_s, raw_sha256_mtok_per_s, ratio}.
    #[arg(long)]
    json: bool,
    /// Seconds to spend on each measurement (the best of several passes counts).
    #[arg(long, default_value_t = 1.0, value_name = "S")]
    seconds: f64,
    /// Tokens hashed per pass.
    #[arg(long, default_value_t = 1 << 22, value_name = "N")]
    tokens: usize,
    /// Requests hashed together in one batch, for the batch figure.
    #[arg(long, default_value_t = 64, value_name = "N")]
    requests: usize,
    /// Tokens per request in a batch (the tokens are hashed as consecutive batches of such requests).
    #[arg(long, default_value_t = 4096, value_name = "N")]
    request_tokens: usize,
}

/// One line of `bench hash`.
#[derive(Debug, Serialize)]
struct HashFigure {
    page_size: usize,
    /// Chained page keys of a batch of independent requests, million tokens per second, one core.
    mtok_per_s: f64,
    /// The same tokens as one chain (each page waits for the previous key).
    single_chain_mtok_per_s: f64,
    /// Reference: SHA-256 of the same token bytes as one stream (no chaining, no per-page padding).
    raw_sha256_mtok_per_s: f64,
    /// mtok_per_s / raw_sha256_mtok_per_s.
    ratio: f64,
}

pub(crate) fn run(command: &BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Hash(args) => bench_hash(args),
        BenchCommand::Storage(args) => super::bench_storage::run(args),
        BenchCommand::Controller(args) => super::bench_controller::run(args),
        BenchCommand::Transfer(args) => super::bench_transfer::run(args),
    }
}

/// The best rate over passes of `work` until `budget` has passed (at least two passes); `work` returns its units.
fn best_rate(budget: Duration, mut work: impl FnMut() -> usize) -> f64 {
    let started = Instant::now();
    let mut best = 0f64;
    let mut passes = 0;
    while passes < 2 || started.elapsed() < budget {
        let pass = Instant::now();
        let units = work();
        best = best.max(units as f64 / pass.elapsed().as_secs_f64().max(1e-9));
        passes += 1;
    }
    best
}

fn bench_hash(args: &BenchHashArgs) -> anyhow::Result<()> {
    if !(args.seconds > 0.0 && args.seconds.is_finite())
        || args.tokens == 0
        || args.requests == 0
        || args.request_tokens == 0
    {
        return Err(crate::exit::Usage(
            "--seconds must be positive, --tokens, --requests and --request-tokens at least 1".into(),
        )
        .into());
    }
    let budget = Duration::from_secs_f64(args.seconds);
    // vocabulary-sized random ids from a fixed-seed xorshift: the hash cost does not depend on the values
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let tokens: Vec<u32> = (0..args.tokens)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 200_000) as u32
        })
        .collect();
    let bytes: Vec<u8> = tokens.iter().flat_map(|token| token.to_le_bytes()).collect();
    let raw = best_rate(budget, || {
        black_box(Sha256::digest(black_box(&bytes)));
        tokens.len()
    });
    let mut hasher = PageHasher::new();
    let figures: Vec<HashFigure> = [1usize, 64]
        .into_iter()
        .map(|page_size| {
            // whole pages only; requests of whole pages, hashed a batch of `requests` at a time
            let whole = &tokens[..tokens.len() / page_size * page_size];
            let per_request = args.request_tokens.div_ceil(page_size) * page_size;
            let chains: Vec<Chain<'_>> =
                whole.chunks(per_request).map(|tokens| Chain { tokens, prior: None }).collect();
            let batch = best_rate(budget, || {
                for batch in chains.chunks(args.requests) {
                    let keys =
                        hasher.page_keys_many(black_box(batch), page_size, PartialPage::Drop).expect("page size ≥ 1");
                    black_box(keys.last().and_then(|keys| keys.last().copied()));
                }
                whole.len()
            });
            let single = best_rate(budget, || {
                let keys =
                    hasher.page_keys(black_box(whole), page_size, None, PartialPage::Reject).expect("whole pages");
                black_box(keys.last().copied());
                whole.len()
            });
            HashFigure {
                page_size,
                mtok_per_s: batch / 1e6,
                single_chain_mtok_per_s: single / 1e6,
                raw_sha256_mtok_per_s: raw / 1e6,
                ratio: batch / raw,
            }
        })
        .collect();
    if args.json {
        println!("{}", serde_json::to_string(&figures)?);
    } else {
        for figure in &figures {
            println!(
                "page size {:>3}: {:>7.1} Mtok/s in batches of {} requests × {} tokens, {:>7.1} Mtok/s as one chain \
                 (one-stream SHA-256 of the same bytes: {:.1} Mtok/s; ratio {:.3})",
                figure.page_size,
                figure.mtok_per_s,
                args.requests,
                args.request_tokens,
                figure.single_chain_mtok_per_s,
                figure.raw_sha256_mtok_per_s,
                figure.ratio
            );
        }
    }
    Ok(())
}
