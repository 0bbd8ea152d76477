//! `hicache bench storage`: batched set and get of a storage backend, next to raw sequential I/O of the same bytes
//! in the same directory, in the same run.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PageKey, PartialPage, page_key, page_keys};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{GetOutcome, PageSegments, PageSegmentsMut, StorageBackend};
use serde::Serialize;

use crate::backends::{self, BackendName, BackendOptions, FileFormatArg};
use crate::exit::Usage;

/// Arguments of `hicache bench storage`.
#[derive(Debug, Args)]
pub(crate) struct BenchStorageArgs {
    /// Storage backend to measure.
    #[arg(long, value_parser = backends::backend_parser(), default_value = "file")]
    backend: BackendName,
    /// Directory for file-like backends and for the raw reference file (default: the backend's environment
    /// variable, else its default directory).
    #[arg(long, value_name = "PATH")]
    dir: Option<PathBuf>,
    /// File layout of the file backend.
    #[arg(long, value_enum, default_value_t = FileFormatArg::Native)]
    format: FileFormatArg,
    /// Bypass the page cache: the file backend with O_DIRECT from 4 KiB-aligned host memory, and the raw reference
    /// with O_DIRECT too (so both measure the disk). Needs --page-bytes in whole 4 KiB blocks.
    #[arg(long)]
    direct: bool,
    /// Threads per batch of the file backend (default: two per core, between 2 and 16; at most 256, the file
    /// tier's limit).
    #[arg(long, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    io_threads: Option<usize>,
    /// The NIXL plugin (POSIX, GDS_MT, GDS, 3FS; default: SGLang's `auto` choice).
    #[arg(long, value_name = "NAME")]
    nixl_plugin: Option<String>,
    /// A NIXL plugin parameter over its default, `KEY=VALUE` (repeatable; POSIX: use_uring, use_aio, use_posix_aio,
    /// kernel_queue_size, ios_pool_size).
    #[arg(long, value_name = "KEY=VALUE")]
    nixl_param: Vec<String>,
    #[command(flatten)]
    network: crate::backends::NetworkArgs,
    /// Pages written and read.
    #[arg(long, default_value_t = 128, value_name = "N")]
    pub(super) pages: usize,
    /// Bytes per page (even; 8 MiB is a Llama-3.1-8B page of 64 tokens).
    #[arg(long, default_value_t = 8 << 20, value_name = "B")]
    pub(super) page_bytes: usize,
    /// Pages per batch call (SGLang's storage batch is 128).
    #[arg(long, default_value_t = 128, value_name = "N")]
    pub(super) batch: usize,
    /// Rounds; each rate is the best round's (with `--via controller` each ratio is the median of the rounds' paired
    /// ratios).
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub(super) rounds: usize,
    /// What the backend is measured against: `direct` calls it from host memory next to raw sequential I/O of the
    /// same bytes; `controller` has the controller's backup thread write pages of a host pool and its query and fetch
    /// threads read them back (in place), next to the backend called directly on the same pool pages.
    #[arg(long, value_enum, default_value_t = Via::Direct)]
    via: Via,
    /// Bytes per call of the raw reference (a page, when pages are larger): by default 8 MiB, the disk's sequential
    /// rate whatever the page size; a batch's bytes (--batch × --page-bytes) compares with raw I/O in calls of the
    /// size the backend gets.
    #[arg(long, default_value_t = 8 << 20, value_name = "B")]
    raw_chunk: usize,
    /// Drop the page cache (as root: /proc/sys/vm/drop_caches) before each read, so that reads without --direct
    /// come from the disk too.
    #[arg(long)]
    drop_caches: bool,
    /// After the rounds, open the backend again on what they wrote and time it (what a restart after a crash
    /// costs: nothing is written at close, so the open recovers the index from the files as after kill -9).
    #[arg(long)]
    reopen: bool,
    /// Print one JSON object: {backend, pages, page_bytes, set_gbps, get_gbps, raw_write_gbps, raw_read_gbps,
    /// set_ratio, get_ratio, and with --reopen reopen_s, reopen_pages}, or with `--via controller` {backend, via, pages, page_bytes, set_gbps, direct_set_gbps,
    /// set_ratio, get_gbps, direct_get_gbps, get_ratio, staging_bytes, rounds} (rates of the best round, ratios the
    /// median of each round's paired ratio, every round's rates in `rounds`); both with the settings {dir, format,
    /// direct, io_threads, batch, round_count}.
    #[arg(long)]
    pub(super) json: bool,
}

/// What `bench storage` compares the backend with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Via {
    /// The backend called directly, next to raw sequential I/O.
    Direct,
    /// The controller's storage threads, next to the backend called directly on the same host pages.
    Controller,
}

/// The result of `bench storage`.
#[derive(Debug, Serialize)]
struct StorageFigure {
    backend: String,
    pages: usize,
    page_bytes: usize,
    set_gbps: f64,
    get_gbps: f64,
    raw_write_gbps: f64,
    raw_read_gbps: f64,
    /// set_gbps / raw_write_gbps.
    set_ratio: f64,
    /// get_gbps / raw_read_gbps.
    get_ratio: f64,
    /// With `--reopen`: seconds to open the backend again on every page the rounds wrote, and how many that is.
    #[serde(skip_serializing_if = "Option::is_none")]
    reopen_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reopen_pages: Option<usize>,
    /// The 3FS backend's page metadata: operations per second of the configured store and the in-process one.
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<serde_json::Value>,
}

/// A figure with the settings it was measured with, so a saved result reads on its own.
#[derive(Debug, Serialize)]
struct Measured<'a, F: Serialize> {
    #[serde(flatten)]
    figure: &'a F,
    /// The directory of the backend and the raw reference file.
    dir: &'a Path,
    /// The file backend's layout.
    format: String,
    direct: bool,
    /// Threads per batch of the file backend (null: its default, two per core between 2 and 16).
    io_threads: Option<usize>,
    batch: usize,
    /// `--rounds` (the controller figure lists each round's figures under `rounds`).
    round_count: usize,
}

impl<'a, F: Serialize> Measured<'a, F> {
    fn new(figure: &'a F, args: &BenchStorageArgs, dir: &'a Path) -> Self {
        Self {
            figure,
            dir,
            format: crate::value_name(&args.format),
            direct: args.direct,
            io_threads: args.io_threads,
            batch: args.batch,
            round_count: args.rounds,
        }
    }
}

pub(super) fn gbps(bytes: usize, started: Instant) -> f64 {
    bytes as f64 / started.elapsed().as_secs_f64().max(1e-9) / 1e9
}

/// A namespace whose pages are exactly `page_bytes` (one token, one layer, one FP8 head of `page_bytes / 2`).
fn namespace(page_bytes: usize) -> anyhow::Result<StorageNamespace> {
    let geometry = KvGeometry::mha(1, 1, page_bytes / 2, KvDtype::Fp8E4m3)?;
    Ok(StorageNamespace::single_rank(
        format!("hicache-bench-{}", std::process::id()),
        geometry,
        HostLayout::PageFirst,
        1,
    ))
}

pub(crate) fn run(args: &BenchStorageArgs) -> anyhow::Result<()> {
    if args.pages == 0
        || args.batch == 0
        || args.rounds == 0
        || args.raw_chunk == 0
        || args.page_bytes < 2
        || !args.page_bytes.is_multiple_of(2)
    {
        return Err(Usage(
            "--pages, --batch, --rounds and --raw-chunk must be at least 1, --page-bytes even and at least 2".into(),
        )
        .into());
    }
    if args.direct && !args.raw_chunk.is_multiple_of(BLOCK) {
        return Err(Usage(format!("--direct needs --raw-chunk in whole {BLOCK}-byte blocks")).into());
    }
    if args.direct && !args.page_bytes.is_multiple_of(BLOCK) {
        return Err(Usage(format!("--direct needs --page-bytes in whole {BLOCK}-byte blocks")).into());
    }
    // the source and target buffers (through the controller: a host pool of twice the pages, and a device pool)
    crate::memory::require(
        crate::memory::product(&[3, args.pages as u64, args.page_bytes as u64]),
        "--pages, --page-bytes",
    )?;
    let options = BackendOptions {
        dir: args.dir.clone(),
        format: args.format,
        io_threads: args.io_threads,
        direct_io: args.direct,
        nixl_plugin: args.nixl_plugin.clone(),
        nixl_params: args
            .nixl_param
            .iter()
            .map(|pair| {
                pair.split_once('=')
                    .map(|(key, value)| (key.to_owned(), value.to_owned()))
                    .ok_or_else(|| Usage(format!("--nixl-param {pair:?} is not KEY=VALUE")))
            })
            .collect::<Result<_, _>>()?,
        read_only: false,
        capacity_bytes: None,
        network: args.network.clone(),
        config_extra: None,
    };
    #[cfg(feature = "mooncake")]
    if args.backend.is("mooncake") {
        let config = backends::mooncake_config(&options)?;
        return super::bench_mooncake::run(args, config, &namespace(args.page_bytes)?);
    }
    let mut options = options;
    let dir = backends::dir_of(args.backend, &options);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // the benchmark's pages and raw files stay in a folder of their own inside the directory (the same disk), out of
    // a cache other processes share, and go when it ends, on an error or a signal
    let private = crate::cleanup::TempFolder::new_in(&dir, ".hicache-bench-")?;
    options.dir = Some(private.path().to_owned());
    let namespace = namespace(args.page_bytes)?;
    let backend = backends::open(args.backend, &namespace, 0, &options)?;
    if args.via == Via::Controller {
        return via_controller(args, backend.into(), &namespace, &dir);
    }
    let total = args.pages * args.page_bytes;
    let mut source_blocks = vec![Block([0; BLOCK]); total.div_ceil(BLOCK)];
    let source = &mut bytemuck::cast_slice_mut::<Block, u8>(&mut source_blocks)[..total];
    let mut state = FILL_SEED;
    fill(source, &mut state);
    let source = &*source;
    let mut target_blocks = vec![Block([0; BLOCK]); total.div_ceil(BLOCK)];
    let target = &mut bytemuck::cast_slice_mut::<Block, u8>(&mut target_blocks)[..total];
    let raw_path = |round: usize| private.path().join(format!("raw-{round}.bin"));
    let mut best = [0f64; 4];
    let mut reopened = None;
    let progress = crate::progress::bar(4 * args.rounds as u64, "bench storage: phases", args.json)?;
    let result = (|| -> anyhow::Result<()> {
        for round in 0..args.rounds {
            // fresh keys and a fresh raw file each round: nothing is deleted between measurements, so no phase
            // pays for another's unlinks (file systems mounted with `discard` trim at the next journal commit)
            let tokens: Vec<u32> = (0..args.pages as u32).map(|page| page ^ std::process::id()).collect();
            let keys = page_keys(&tokens, 1, None, PartialPage::Reject)?;
            let keys: Vec<PageKey> = keys.iter().map(|key| page_key(Some(key), &[round as u32])).collect();
            let raw_path = raw_path(round);
            // each phase starts with no dirty pages, so no phase pays for another's writeback (on two cores the
            // kernel's flusher otherwise takes one of them)
            rustix::fs::sync();
            progress.set_message(format!("round {round}: raw write"));
            let started = Instant::now();
            raw_write(&raw_path, source, args.raw_chunk.max(args.page_bytes), args.direct)?;
            best[0] = best[0].max(gbps(total, started));
            rustix::fs::sync();
            progress.inc(1);
            progress.set_message(format!("round {round}: {} set", backend.name()));
            let started = Instant::now();
            set_all(backend.as_ref(), &keys, source, args)?;
            best[1] = best[1].max(gbps(total, started));
            rustix::fs::sync();
            progress.inc(1);
            progress.set_message(format!("round {round}: raw read"));
            if args.drop_caches {
                drop_caches()?;
            }
            let started = Instant::now();
            raw_read(&raw_path, target, args.raw_chunk.max(args.page_bytes), args.direct)?;
            best[2] = best[2].max(gbps(total, started));
            target.fill(0);
            progress.inc(1);
            progress.set_message(format!("round {round}: {} get", backend.name()));
            if args.drop_caches {
                drop_caches()?;
            }
            let started = Instant::now();
            get_all(backend.as_ref(), &keys, target, args)?;
            best[3] = best[3].max(gbps(total, started));
            progress.inc(1);
            if *target != *source {
                bail!("{} returned bytes that differ from those written", backend.name());
            }
            if args.reopen && round + 1 == args.rounds {
                progress.set_message("reopening");
                if args.drop_caches {
                    drop_caches()?;
                }
                let started = Instant::now();
                let again = backends::open(args.backend, &namespace, 0, &options)?;
                let seconds = started.elapsed().as_secs_f64();
                if again.batch_exists(&keys)? != keys.len() {
                    bail!("{} opened again does not hold the pages of the last round", backend.name());
                }
                reopened = Some(seconds);
            }
        }
        Ok(())
    })();
    progress.set_message("removing what the benchmark wrote");
    for round in 0..args.rounds {
        let _ = std::fs::remove_file(raw_path(round));
    }
    let _ = backend.clear();
    progress.finish_and_clear();
    result?;
    let [raw_write_gbps, set_gbps, raw_read_gbps, get_gbps] = best;
    let figure = StorageFigure {
        backend: backend.name().to_owned(),
        pages: args.pages,
        page_bytes: args.page_bytes,
        set_gbps,
        get_gbps,
        raw_write_gbps,
        raw_read_gbps,
        set_ratio: set_gbps / raw_write_gbps,
        get_ratio: get_gbps / raw_read_gbps,
        reopen_s: reopened,
        reopen_pages: reopened.map(|_| args.pages * args.rounds),
        metadata: None,
    };
    #[cfg(feature = "3fs")]
    let figure = if args.backend.is("3fs") {
        let config = backends::hf3fs_config(&options)?;
        let metadata = super::bench_3fs::metadata_figure(&config, args.batch, args.rounds)?;
        if !args.json {
            println!("{}", super::bench_3fs::describe(&metadata));
        }
        StorageFigure { metadata: Some(serde_json::to_value(&metadata)?), ..figure }
    } else {
        figure
    };
    if args.json {
        println!("{}", serde_json::to_string(&Measured::new(&figure, args, &dir))?);
    } else {
        println!(
            "{} × {} B pages in {}{}: set {:.2} GB/s (raw sequential write {:.2} GB/s, ratio {:.2}); \
             get {:.2} GB/s (raw sequential read {:.2} GB/s, ratio {:.2})",
            figure.pages,
            figure.page_bytes,
            dir.display(),
            if args.direct { " with O_DIRECT" } else { "" },
            figure.set_gbps,
            figure.raw_write_gbps,
            figure.set_ratio,
            figure.get_gbps,
            figure.raw_read_gbps,
            figure.get_ratio
        );
        if let Some(seconds) = figure.reopen_s {
            println!("opened again on {} pages in {seconds:.3} s", args.pages * args.rounds);
        }
    }
    Ok(())
}

/// Empties the page cache (needs root).
fn drop_caches() -> anyhow::Result<()> {
    rustix::fs::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .context("--drop-caches: writing /proc/sys/vm/drop_caches (root is needed)")
}

fn via_controller(
    args: &BenchStorageArgs,
    backend: std::sync::Arc<dyn StorageBackend>,
    namespace: &StorageNamespace,
    dir: &Path,
) -> anyhow::Result<()> {
    let bench =
        super::bench_storage_controller::ControllerBench { pages: args.pages, batch: args.batch, rounds: args.rounds };
    let progress = crate::progress::bar(args.rounds as u64, "bench storage --via controller: rounds", args.json)?;
    let result = super::bench_storage_controller::run(&bench, backend.clone(), namespace, &progress);
    progress.set_message("removing what the benchmark wrote");
    let _ = backend.clear();
    progress.finish_and_clear();
    let figure = result?;
    if args.json {
        println!("{}", serde_json::to_string(&Measured::new(&figure, args, dir))?);
    } else {
        println!(
            "{} × {} B pages in {}{} through the controller: backup {:.2} GB/s (the backend called directly on the \
             same pool pages {:.2} GB/s; median paired ratio {:.2}); prefetch {:.2} GB/s (directly {:.2} GB/s; \
             median paired ratio {:.2}); {} bytes staged",
            figure.pages,
            figure.page_bytes,
            dir.display(),
            if args.direct { " with O_DIRECT" } else { "" },
            figure.set_gbps,
            figure.direct_set_gbps,
            figure.set_ratio,
            figure.get_gbps,
            figure.direct_get_gbps,
            figure.get_ratio,
            figure.staging_bytes
        );
    }
    Ok(())
}

/// Host memory in 4 KiB blocks at 4 KiB-aligned addresses, as a pinned host pool's pages are (O_DIRECT needs it).
const BLOCK: usize = 4096;

#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(4096))]
struct Block([u8; BLOCK]);

/// The xorshift state `fill` starts from.
pub(super) const FILL_SEED: u64 = 0x2545_f491_4f6c_dd1d;

/// Pseudo-random bytes (xorshift words from `state`, which is left where the bytes end, so consecutive calls go on
/// with new bytes), so no layer below can compress or deduplicate them.
pub(super) fn fill(data: &mut [u8], state: &mut u64) {
    for chunk in data.chunks_mut(8) {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
    }
}

fn open_options(direct: bool) -> std::fs::OpenOptions {
    let mut options = std::fs::OpenOptions::new();
    if direct {
        options.custom_flags(libc::O_DIRECT);
    }
    options
}

fn raw_write(path: &Path, data: &[u8], chunk: usize, direct: bool) -> anyhow::Result<()> {
    let mut file = open_options(direct)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    for piece in data.chunks(chunk) {
        file.write_all(piece).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn raw_read(path: &Path, data: &mut [u8], chunk: usize, direct: bool) -> anyhow::Result<()> {
    let mut file = open_options(direct).read(true).open(path).with_context(|| format!("opening {}", path.display()))?;
    for piece in data.chunks_mut(chunk) {
        file.read_exact(piece).with_context(|| format!("reading {}", path.display()))?;
    }
    Ok(())
}

pub(super) fn set_all(
    backend: &dyn StorageBackend,
    keys: &[PageKey],
    data: &[u8],
    args: &BenchStorageArgs,
) -> anyhow::Result<()> {
    for (keys, bytes) in keys.chunks(args.batch).zip(data.chunks(args.batch * args.page_bytes)) {
        let pages: Vec<PageSegments<'_>> = bytes.chunks(args.page_bytes).map(|page| vec![page]).collect();
        let outcomes = backend.batch_set(keys, &pages)?;
        if let Some(failed) = outcomes.iter().find(|outcome| !outcome.is_stored()) {
            bail!("{}: a page was not stored: {failed:?}", backend.name());
        }
    }
    // a backend writing behind has written every page only now
    backend.flush()?;
    Ok(())
}

pub(super) fn get_all(
    backend: &dyn StorageBackend,
    keys: &[PageKey],
    data: &mut [u8],
    args: &BenchStorageArgs,
) -> anyhow::Result<()> {
    for (keys, bytes) in keys.chunks(args.batch).zip(data.chunks_mut(args.batch * args.page_bytes)) {
        let mut pages: Vec<PageSegmentsMut<'_>> = bytes.chunks_mut(args.page_bytes).map(|page| vec![page]).collect();
        let outcomes = backend.batch_get(keys, &mut pages)?;
        if let Some(missed) = outcomes.iter().find(|outcome| **outcome != GetOutcome::Hit) {
            bail!("{}: a page written in this run did not read back: {missed:?}", backend.name());
        }
    }
    Ok(())
}
