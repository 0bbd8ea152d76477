//! `hicache bench storage --backend mooncake`: batched set and get through hicache's Mooncake backend, next to
//! Mooncake's official Python client doing the same (`batch_put_from` / `batch_get_into` of the same objects from and
//! into registered memory) against the same master, in the same run.
//!
//! The reference runs in a `python3` that can `import mooncake.store`. It is set up like hicache's client (same
//! master, protocol, segment and buffer sizes) and lives through the whole run, so both are measured against the
//! same cluster of two segments. After one unmeasured round of each (both touch the segments' fresh pages), rounds
//! alternate between the two (the reference first in even rounds, hicache first in odd ones, so a drift of the machine
//! favours neither); each rate is the best round's, each ratio the median of the rounds' paired ratios.
//!
//! The reference puts twice a round: with the client's default placement (the master picks a segment; SGLang puts
//! so), the figure the ratios are taken against, and with hicache's placement (by default, `prefer_local_segment`,
//! the first replica asked of its own segment), which shows how much of a ratio is placement and how much the
//! client.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};
use hicache_core::hash::{PageKey, page_key};
use hicache_core::host_memory::MemoryRegion;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_storage_mooncake::{MooncakeConfig, MooncakeStorage};
use serde::{Deserialize, Serialize};

use super::bench_storage::{BenchStorageArgs, fill, gbps, get_all, set_all};

/// The reference, run with `python3 -c`.
const REFERENCE: &str = include_str!("mooncake_reference.py");

/// The result of `bench storage --backend mooncake`.
#[derive(Debug, Serialize)]
struct MooncakeFigure {
    backend: &'static str,
    pages: usize,
    page_bytes: usize,
    batch: usize,
    rounds: usize,
    master: String,
    protocol: String,
    set_gbps: f64,
    get_gbps: f64,
    /// What the ratios divide by.
    reference: &'static str,
    reference_set_gbps: f64,
    reference_get_gbps: f64,
    /// The median of the rounds' set / reference set.
    set_ratio: f64,
    /// The median of the rounds' get / reference get.
    get_ratio: f64,
    /// The official client doing what SGLang's `batch_set` does, as hicache's set does: the existence query, then
    /// the put of the missing objects.
    reference_exists_then_put_gbps: f64,
    /// The median of the rounds' set / reference_exists_then_put.
    set_ratio_to_exists_then_put: f64,
    /// Whether hicache's puts asked for its own segment first, and its name.
    prefer_local_segment: bool,
    preferred_segment: Option<String>,
    /// The official client putting with hicache's placement (its own segment first when hicache's puts ask so).
    reference_same_placement_set_gbps: f64,
    reference_same_placement_get_gbps: f64,
    /// The median of the rounds' set / reference same-placement set.
    set_ratio_same_placement: f64,
    /// The median of the rounds' get / reference same-placement get.
    get_ratio_same_placement: f64,
    /// Each round's rates in GB/s: [set, reference set, get, reference get, reference exists then put, reference
    /// same-placement set, reference same-placement get].
    round_rates: Vec<[f64; 7]>,
}

#[derive(Deserialize)]
struct ReferenceFigure {
    set_gbps: f64,
    get_gbps: f64,
    exists_then_put_gbps: f64,
    local_set_gbps: f64,
    local_get_gbps: f64,
}

/// Host memory the benchmark's pages live in, registered with the backend as a host pool is.
struct Registered<'a> {
    backend: &'a MooncakeStorage,
    region: MemoryRegion,
}

impl<'a> Registered<'a> {
    fn new(backend: &'a MooncakeStorage, bytes: &[u8]) -> anyhow::Result<Self> {
        // SAFETY: the bytes stay allocated and are not moved while this value lives: it borrows the backend only,
        // but the callers drop it before the buffer (declared after the buffer, in the same scope).
        let region = unsafe { MemoryRegion::from_raw_parts(bytes.as_ptr(), bytes.len(), None) };
        backend.register_host_memory(&region)?;
        Ok(Self { backend, region })
    }
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.backend.unregister_host_memory(&self.region);
    }
}

pub(super) fn run(args: &BenchStorageArgs, config: MooncakeConfig, namespace: &StorageNamespace) -> anyhow::Result<()> {
    let backend = MooncakeStorage::open(config.clone(), namespace)?;
    let progress = crate::progress::bar(args.rounds as u64, "bench storage --backend mooncake: rounds", args.json)?;
    progress.set_message("starting the official Python client");
    let spec = serde_json::json!({
        "master": config.master,
        "local_hostname": config.local_hostname,
        "metadata_server": config.metadata_server,
        "protocol": config.protocol,
        "device": config.device,
        "segment": config.global_segment_size,
        "buffer": config.local_buffer_size,
        "pages": args.pages,
        "page_bytes": args.page_bytes,
        "batch": args.batch,
        // the reference's second put places as hicache does: its own segment first only when hicache asks so
        "prefer_local": backend.preferred_segment().is_some(),
    });
    let mut reference = Reference::start(&spec)?;
    let total = args.pages * args.page_bytes;
    let mut source = vec![0u8; total];
    fill(&mut source, &mut super::bench_storage::FILL_SEED.clone());
    let mut target = vec![0u8; total];
    let mut rounds = Vec::with_capacity(args.rounds);
    let result = (|| -> anyhow::Result<()> {
        let _source_registered = Registered::new(&backend, &source)?;
        let _target_registered = Registered::new(&backend, &target)?;
        // one round of each first, unmeasured: both touch the segments' fresh pages (page faults) and warm up
        for round in 0..=args.rounds {
            progress.set_message(if round == 0 { "warming up".to_owned() } else { format!("round {round}") });
            let mut ours = || -> anyhow::Result<(f64, f64)> {
                let keys: Vec<PageKey> = (0..args.pages as u32)
                    .map(|page| page_key(None, &[page, round as u32, std::process::id()]))
                    .collect();
                let started = Instant::now();
                set_all(&backend, &keys, &source, args)?;
                let set = gbps(total, started);
                let started = Instant::now();
                get_all(&backend, &keys, &mut target, args)?;
                let get = gbps(total, started);
                if target != source {
                    bail!("mooncake returned bytes that differ from those written");
                }
                target.fill(0);
                backend.clear()?;
                Ok((set, get))
            };
            let ((set, get), theirs) = if round % 2 == 0 {
                let theirs = reference.round(round)?;
                (ours()?, theirs)
            } else {
                let ours = ours()?;
                (ours, reference.round(round)?)
            };
            if round > 0 {
                rounds.push([
                    set,
                    theirs.set_gbps,
                    get,
                    theirs.get_gbps,
                    theirs.exists_then_put_gbps,
                    theirs.local_set_gbps,
                    theirs.local_get_gbps,
                ]);
                progress.inc(1);
            }
        }
        Ok(())
    })();
    reference.stop();
    progress.finish_and_clear();
    result?;
    let best = |index: usize| rounds.iter().map(|round| round[index]).fold(0f64, f64::max);
    let median = |numerator: usize, denominator: usize| {
        let mut ratios: Vec<f64> = rounds.iter().map(|round| round[numerator] / round[denominator]).collect();
        ratios.sort_by(f64::total_cmp);
        ratios[ratios.len() / 2]
    };
    let figure = MooncakeFigure {
        backend: "mooncake",
        pages: args.pages,
        page_bytes: args.page_bytes,
        batch: args.batch,
        rounds: args.rounds,
        master: config.master.clone(),
        protocol: config.protocol.clone(),
        set_gbps: best(0),
        get_gbps: best(2),
        reference: "Mooncake's official Python client: batch_put_from / batch_get_into of the same objects",
        reference_set_gbps: best(1),
        reference_get_gbps: best(3),
        set_ratio: median(0, 1),
        get_ratio: median(2, 3),
        reference_exists_then_put_gbps: best(4),
        set_ratio_to_exists_then_put: median(0, 4),
        prefer_local_segment: config.prefer_local_segment,
        preferred_segment: backend.preferred_segment(),
        reference_same_placement_set_gbps: best(5),
        reference_same_placement_get_gbps: best(6),
        set_ratio_same_placement: median(0, 5),
        get_ratio_same_placement: median(2, 6),
        round_rates: rounds,
    };
    if args.json {
        println!("{}", serde_json::to_string(&figure)?);
    } else {
        println!(
            "{} × {} B pages, batches of {}, master {} ({}): set {:.2} GB/s (official Python client's put {:.2} GB/s, \
             median paired ratio {:.2}; its existence query and put, as SGLang's batch_set and hicache's set, {:.2} \
             GB/s, ratio {:.2}); get {:.2} GB/s (official client {:.2} GB/s; median paired ratio {:.2}); puts {}; the \
             official client with the same placement: put {:.2} GB/s (ratio {:.2}), get {:.2} GB/s (ratio {:.2})",
            figure.pages,
            figure.page_bytes,
            figure.batch,
            figure.master,
            figure.protocol,
            figure.set_gbps,
            figure.reference_set_gbps,
            figure.set_ratio,
            figure.reference_exists_then_put_gbps,
            figure.set_ratio_to_exists_then_put,
            figure.get_gbps,
            figure.reference_get_gbps,
            figure.get_ratio,
            figure.preferred_segment.as_ref().map_or_else(
                || "placed by the master".to_owned(),
                |segment| format!("ask for this client's segment {segment} first")
            ),
            figure.reference_same_placement_set_gbps,
            figure.set_ratio_same_placement,
            figure.reference_same_placement_get_gbps,
            figure.get_ratio_same_placement
        );
    }
    Ok(())
}

/// The official Python client, measuring a round when asked.
struct Reference {
    child: Child,
    lines: BufReader<ChildStdout>,
    /// Its standard error, drained as it comes (Mooncake's client logs there), read when it fails.
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Reference {
    fn start(spec: &serde_json::Value) -> anyhow::Result<Self> {
        let mut child = Command::new("python3")
            .args(["-c", REFERENCE, &spec.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting python3 for the reference (Mooncake's official Python client)")?;
        let lines = BufReader::new(child.stdout.take().expect("piped"));
        let mut pipe = child.stderr.take().expect("piped");
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        });
        let mut reference = Self { child, lines, stderr: Some(stderr) };
        let mut line = String::new();
        reference.lines.read_line(&mut line)?;
        if line.trim() != "ready" {
            return Err(reference.failure());
        }
        Ok(reference)
    }

    fn round(&mut self, round: usize) -> anyhow::Result<ReferenceFigure> {
        let stdin = self.child.stdin.as_mut().expect("piped");
        if writeln!(stdin, "round {round}").and_then(|()| stdin.flush()).is_err() {
            return Err(self.failure());
        }
        let mut line = String::new();
        self.lines.read_line(&mut line)?;
        serde_json::from_str(line.trim()).map_err(|_| self.failure())
    }

    /// The reference's own last words, after it ended.
    fn failure(&mut self) -> anyhow::Error {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
        let stderr = self.stderr.take().and_then(|reader| reader.join().ok()).unwrap_or_default();
        let reason = stderr.lines().rev().find(|line| !line.trim().is_empty()).unwrap_or("no message");
        anyhow::anyhow!("the reference (Mooncake's official Python client) failed: {reason}")
    }

    fn stop(mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}
