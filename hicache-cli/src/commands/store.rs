//! `hicache store`: pages moved by hand between local files and a storage backend, and the backend inspected.
//!
//! The backend and namespace come from flags, else from a config file (`--config`: `storage_backend`, `model_name`,
//! `page_size`, `mem_layout`), else from SGLang's environment (`SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR` for the file
//! tier's directory), else defaults. Pages are raw bytes in the flat page format (docs/sglang.md#flat-pages): one page,
//! or pages concatenated in key order.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::groups::HitPolicy;
use hicache_core::storage::{GetOutcome, PageSegments, PageSegmentsMut, SetOutcome, StorageBackend};
use serde::Serialize;

use super::hash::PartialArg;
use super::store_target::{KeysArgs, Mode, Target, TargetArgs, keys, open, plural, read_pages, target};
use crate::backends;
use crate::exit::Usage;

/// `hicache store` subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum StoreCommand {
    /// Write pages from a file of raw bytes (one page, or pages concatenated in key order).
    Put(PutArgs),
    /// Read pages into a file of raw bytes (concatenated in key order); fails naming the first missing page.
    Get(GetArgs),
    /// Say which pages are present, and how many lead the list.
    Exists(KeyedArgs),
    /// List the namespace's pages and their sizes in storage.
    Ls(TargetArgs),
    /// Remove pages.
    Rm(KeyedArgs),
    /// Remove every page of the namespace (and nothing else).
    Clear(TargetArgs),
    /// The backend, the namespace, and how many pages and bytes it holds.
    Stat(TargetArgs),
    /// The key layout a router outside the engine needs to find this stage's pages in the store (every TP rank's
    /// objects; with --pool, a hybrid model's sidecar pool after the KV), as SGLang serves it at
    /// /get_hicache_l3_cache_layout; nothing is opened.
    Layout(LayoutArgs),
    /// Read the same pages again and again through one open backend, a line per round (whole, missing, failed,
    /// and how long it took; with --expect or --put, whether the bytes are right), until --rounds, SIGINT or SIGTERM,
    /// or the end of standard input when that is a pipe. With --put it writes them first, and again when a round finds
    /// one missing: a canary page for watching a store from a host, and (Mooncake) a process that lends its segment
    /// while it runs.
    Watch(super::watch::WatchArgs),
}

/// Arguments of `store layout`.
#[derive(Debug, Args)]
pub(crate) struct LayoutArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// With --pool: how many of a prefix's last pages need the pool's entries (`trailing_pages`: a sliding window's
    /// pages; a Mamba state's 1, the default for `mamba`); without it, every page does (`all_pages`).
    #[arg(long, value_name = "N", requires = "pool", value_parser = clap::value_parser!(u64).range(1..))]
    trailing_pages: Option<u64>,
}

/// Arguments of `store exists` and `store rm`.
#[derive(Debug, Args)]
pub(crate) struct KeyedArgs {
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    keys: KeysArgs,
}

/// Arguments of `store put`.
#[derive(Debug, Args)]
pub(crate) struct PutArgs {
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    keys: KeysArgs,
    /// Raw bytes: the pages concatenated in key order.
    #[arg(long = "in", value_name = "FILE")]
    input: PathBuf,
}

/// Arguments of `store get`.
#[derive(Debug, Args)]
pub(crate) struct GetArgs {
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    keys: KeysArgs,
    /// Where the pages go, concatenated in key order.
    #[arg(long = "out", value_name = "FILE")]
    output: PathBuf,
}

/// One page's outcome in JSON.
#[derive(Debug, Serialize)]
struct PageReport {
    key: String,
    outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<String>,
}

pub(crate) fn run(command: &StoreCommand) -> anyhow::Result<()> {
    match command {
        StoreCommand::Put(args) => put(args),
        StoreCommand::Get(args) => get(args),
        StoreCommand::Exists(args) => exists(args),
        StoreCommand::Ls(args) => ls(args),
        StoreCommand::Rm(args) => rm(args),
        StoreCommand::Clear(args) => clear(args),
        StoreCommand::Stat(args) => stat(args),
        StoreCommand::Layout(args) => layout(args),
        StoreCommand::Watch(args) => super::watch::watch(args),
    }
}

fn print_json(value: &impl Serialize) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}

fn put(args: &PutArgs) -> anyhow::Result<()> {
    let opened = open(&args.target, Mode::Write)?;
    if args.keys.partial == PartialArg::Hash {
        // a short page is never stored: its key names fewer tokens than a page holds
        bail!(Usage(
            "store put stores whole pages only: --partial hash would key a short page; use --partial drop (leave the \
             tail out) or reject"
                .into()
        ));
    }
    let keys = keys(&args.keys, opened.namespace.page_size)?;
    let bytes = read_pages(&args.input, "--in", keys.len(), opened.page_bytes)?;
    let pages: Vec<PageSegments<'_>> = bytes.chunks(opened.page_bytes).map(|page| vec![page]).collect();
    let outcomes = opened.backend.batch_set(&keys, &pages)?;
    // reported once written, not only taken (a tier may write small batches behind)
    opened.backend.flush()?;
    let reports: Vec<PageReport> = keys
        .iter()
        .zip(&outcomes)
        .map(|(key, outcome)| match outcome {
            SetOutcome::Stored => PageReport { key: key.to_string(), outcome: "stored", message: None },
            SetOutcome::AlreadyPresent => PageReport { key: key.to_string(), outcome: "present", message: None },
            SetOutcome::Failed(failure) => {
                PageReport { key: key.to_string(), outcome: "failed", message: Some(failure.to_string()) }
            }
        })
        .collect();
    report_pages(&args.target, &reports)?;
    let failed = reports.iter().filter(|report| report.outcome == "failed").count();
    if failed > 0 {
        bail!("{failed} of {} pages failed to store in the {}", keys.len(), opened.description);
    }
    Ok(())
}

fn report_pages(target: &TargetArgs, reports: &[PageReport]) -> anyhow::Result<()> {
    if target.json {
        return print_json(&reports);
    }
    let mut out = std::io::stdout().lock();
    for report in reports {
        match &report.message {
            Some(message) => writeln!(out, "{} {}: {message}", report.outcome, report.key)?,
            None => writeln!(out, "{} {}", report.outcome, report.key)?,
        }
    }
    Ok(())
}

fn get(args: &GetArgs) -> anyhow::Result<()> {
    let opened = open(&args.target, Mode::Inspect)?;
    let keys = keys(&args.keys, opened.namespace.page_size)?;
    crate::memory::require(
        crate::memory::product(&[keys.len() as u64, opened.page_bytes as u64]),
        "the pages asked for × --page-size (and the geometry)",
    )?;
    let mut bytes = vec![0u8; keys.len() * opened.page_bytes];
    let mut pages: Vec<PageSegmentsMut<'_>> = bytes.chunks_mut(opened.page_bytes).map(|page| vec![page]).collect();
    let outcomes = opened.backend.batch_get(&keys, &mut pages)?;
    let reports: Vec<PageReport> = keys
        .iter()
        .zip(&outcomes)
        .map(|(key, outcome)| match outcome {
            GetOutcome::Hit => PageReport { key: key.to_string(), outcome: "hit", message: None },
            GetOutcome::Miss => PageReport { key: key.to_string(), outcome: "miss", message: None },
            GetOutcome::Failed(failure) => {
                PageReport { key: key.to_string(), outcome: "failed", message: Some(failure.to_string()) }
            }
        })
        .collect();
    if let Some(bad) = reports.iter().find(|report| report.outcome != "hit") {
        if args.target.json {
            print_json(&reports)?;
        }
        let detail = bad.message.as_deref().map_or_else(|| "not in storage".to_owned(), |message| message.to_owned());
        bail!("page {} ({}): {detail}; nothing written to {}", bad.key, opened.description, args.output.display());
    }
    std::fs::write(&args.output, &bytes)
        .with_context(|| format!("writing {} bytes to {}", bytes.len(), args.output.display()))?;
    report_pages(&args.target, &reports)
}

fn exists(args: &KeyedArgs) -> anyhow::Result<()> {
    #[derive(Serialize)]
    struct Exists {
        leading: usize,
        present: Vec<(String, bool)>,
    }
    let opened = open(&args.target, Mode::Inspect)?;
    let keys = keys(&args.keys, opened.namespace.page_size)?;
    let leading = opened.backend.batch_exists(&keys)?;
    let held = opened.backend.batch_contains(&keys)?;
    let present: Vec<(String, bool)> = keys.iter().map(ToString::to_string).zip(held).collect();
    if args.target.json {
        return print_json(&Exists { leading, present });
    }
    let mut out = std::io::stdout().lock();
    for (key, here) in &present {
        writeln!(out, "{key} {}", if *here { "present" } else { "absent" })?;
    }
    writeln!(out, "{leading} of {} pages present from the first", keys.len())?;
    Ok(())
}

fn ls(args: &TargetArgs) -> anyhow::Result<()> {
    #[derive(Serialize)]
    struct Listed {
        key: String,
        bytes: u64,
    }
    let opened = open(args, Mode::Inspect)?;
    let mut pages = opened.backend.list()?;
    pages.sort_unstable();
    if args.json {
        let listed: Vec<Listed> =
            pages.iter().map(|(key, bytes)| Listed { key: key.to_string(), bytes: *bytes }).collect();
        return print_json(&listed);
    }
    let mut out = std::io::stdout().lock();
    for (key, bytes) in &pages {
        writeln!(out, "{key} {bytes}")?;
    }
    Ok(())
}

fn rm(args: &KeyedArgs) -> anyhow::Result<()> {
    let opened = open(&args.target, Mode::Remove)?;
    let keys = keys(&args.keys, opened.namespace.page_size)?;
    let removed = opened.backend.remove(&keys)?;
    if args.target.json {
        return print_json(&serde_json::json!({ "removed": removed, "keys": keys.len() }));
    }
    println!("removed {removed} of {}", plural(keys.len(), "page"));
    Ok(())
}

fn clear(args: &TargetArgs) -> anyhow::Result<()> {
    let opened = open(args, Mode::Remove)?;
    let removed = opened.backend.clear()?;
    if args.json {
        return print_json(&serde_json::json!({ "removed": removed }));
    }
    println!("removed {} of namespace {}", plural(removed as usize, "page"), opened.namespace.descriptor());
    Ok(())
}

fn stat(args: &TargetArgs) -> anyhow::Result<()> {
    #[derive(Serialize)]
    struct Stat {
        backend: String,
        namespace: String,
        digest: String,
        page_bytes: usize,
        /// Null where the backend cannot enumerate its pages (Mooncake).
        pages: Option<usize>,
        bytes: Option<u64>,
    }
    let opened = open(args, Mode::Inspect)?;
    // a backend that cannot enumerate its pages still has a namespace and a page size worth showing
    let pages = match opened.backend.list() {
        Ok(pages) => Some(pages),
        Err(hicache_core::Error::Unsupported { .. }) => None,
        Err(error) => return Err(error.into()),
    };
    let stat = Stat {
        backend: opened.description.clone(),
        namespace: opened.namespace.descriptor(),
        digest: opened.namespace.digest(),
        page_bytes: opened.page_bytes,
        pages: pages.as_ref().map(Vec::len),
        bytes: pages.as_ref().map(|pages| pages.iter().map(|(_, bytes)| bytes).sum()),
    };
    if args.json {
        return print_json(&stat);
    }
    println!("backend: {}", stat.backend);
    println!("namespace: {} (digest {})", stat.namespace, stat.digest);
    println!("page: {} bytes", stat.page_bytes);
    match (stat.pages, stat.bytes) {
        (Some(pages), Some(bytes)) => println!("pages: {pages} ({bytes} bytes in storage)"),
        _ => println!("pages: not countable (the {} backend cannot enumerate its pages)", opened.backend.name()),
    }
    Ok(())
}

fn layout(args: &LayoutArgs) -> anyhow::Result<()> {
    let LayoutArgs { target: args, trailing_pages } = args;
    let Target { backend, namespace, options, .. } = target(args, Mode::Inspect)?;
    // a sidecar pool is described after the KV of its pages
    let kv = StorageNamespace { sidecar: None, ..namespace.clone() };
    let mut layout = backends::l3_layout(backend, &kv, args.start_layer, &options)?;
    if let Some(sidecar) = &namespace.sidecar {
        let policy = match (trailing_pages, sidecar.pool.as_str()) {
            (Some(window), _) => HitPolicy::TrailingPages { window: *window as usize },
            (None, "mamba") => HitPolicy::TrailingPages { window: 1 },
            // as SGLang, which serves no layout for a sliding window of unknown width
            (None, "swa") => {
                bail!(Usage("--pool swa: a sliding window needs --trailing-pages (its window in pages)".into()))
            }
            (None, _) => HitPolicy::AllPages,
        };
        backends::add_sidecar_layout(&mut layout, backend, &kv, sidecar, policy, &options)?;
    }
    if args.json {
        return print_json(&layout);
    }
    println!("backend: {}", layout.backend.as_deref().unwrap_or("none"));
    let objects = &layout.hicache_object_layout;
    if let Some(reason) = &layout.reason {
        println!("not served to routers: {reason}");
        return Ok(());
    }
    if let Some(stage) = &objects.stage {
        let prefix = stage.key_prefix.as_ref().map_or(String::new(), |prefix| format!("{prefix}_"));
        println!(
            "stage {} of {}; a page's objects: {prefix}{{page hash}} followed by",
            stage.pp_rank.unwrap_or(0),
            stage.pp_size
        );
        if let Some(unified) = &stage.unified {
            println!(
                "(unified key scheme, digest {}: each such key names a chunk, stored under the SHA-256 of the key; \
                 --json gives the tier's names)",
                unified.digest
            );
        }
    }
    for pool in &objects.pools {
        match pool.trailing_pages {
            Some(window) => println!("pool {}: the prefix's last {window} page(s) need", pool.pool),
            None => println!("pool {}: every page of the prefix needs", pool.pool),
        }
        for suffix in &pool.suffixes {
            println!("  {suffix}");
        }
    }
    Ok(())
}
