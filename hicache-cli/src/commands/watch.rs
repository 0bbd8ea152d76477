//! `hicache store watch`: the same pages read again and again through one open backend, a line per round.
//!
//! An operator watches whether a host can read a store, and how fast, while the store, the network or other hosts
//! change; a test drives faults against a process that keeps its backend open (a link taken down and up, a peer
//! killed) and waits for the lines it needs. Each round reads every page into a zeroed buffer; with `--expect FILE`
//! (or `--put FILE`, which writes the pages first and keeps the backend open, so a Mooncake client lends its segment
//! while the watch runs) each page read whole is compared with the file. A page read whole with other bytes is
//! `wrong`, and the watch then exits with status 1 when it ends: a store must never serve it.
//!
//! Rounds start `--interval-ms` apart (after the last one ended). With `--put`, a round that finds a page missing
//! (evicted, or on a host that went away) writes the pages again, so the canary stays. The watch ends after
//! `--rounds`, on SIGINT or SIGTERM (the round in flight ends first, and the backend is closed; a second signal ends
//! the process at once), or at the end of standard input when that is a pipe (a test that drops its end stops the
//! watch); its last line says which.

use std::os::unix::fs::FileTypeExt as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use hicache_core::hash::PageKey;
use hicache_core::storage::{GetOutcome, PageSegments, PageSegmentsMut, SetOutcome};
use serde::Serialize;

use super::store_target::{KeysArgs, Mode, TargetArgs, keys, open, read_pages};

/// Arguments of `store watch`.
#[derive(Debug, Args)]
pub(crate) struct WatchArgs {
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    keys: KeysArgs,
    /// The bytes the pages must hold (the pages concatenated in key order): a page read whole with other bytes is
    /// reported `wrong`.
    #[arg(long, value_name = "FILE", conflicts_with = "put")]
    expect: Option<PathBuf>,
    /// Write these bytes as the pages first (the pages concatenated in key order), then watch them.
    #[arg(long, value_name = "FILE")]
    put: Option<PathBuf>,
    /// Milliseconds from the end of a round to the start of the next.
    #[arg(long, default_value_t = 200, value_name = "MS")]
    interval_ms: u64,
    /// Rounds to run (default: until stopped).
    #[arg(long, value_name = "N")]
    rounds: Option<u64>,
}

/// One line of the watch.
#[derive(Debug, Default, Serialize)]
struct Line {
    /// `ready` (the backend is open, and the pages written with --put), then one `round` per read, a `put` when
    /// --put wrote pages a round found missing again, and `end` with why the watch ended.
    event: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    round: Option<u64>,
    /// `whole` (every page read, and right), `missing` (a page not in the store), `failed` (a page read wrong in
    /// the store's own terms: short, incomplete, its checksum), `error` (the call failed), `wrong` (a page read
    /// whole with other bytes than expected).
    #[serde(skip_serializing_if = "Option::is_none")]
    outcome: Option<&'static str>,
    /// Pages read whole (with the right bytes, when they are known); for `put`, the pages written again.
    pages_whole: usize,
    pages: usize,
    /// Pages read whole with other bytes than expected.
    pages_wrong: usize,
    /// How long the round's call took.
    #[serde(skip_serializing_if = "Option::is_none")]
    ms: Option<f64>,
    /// What went wrong first (the first wrong page, if any), or the backend for `ready`, or why the watch ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<String>,
}

pub(super) fn watch(args: &WatchArgs) -> anyhow::Result<()> {
    let mode = if args.put.is_some() { Mode::Write } else { Mode::Inspect };
    let opened = open(&args.target, mode)?;
    let keys = keys(&args.keys, opened.namespace.page_size)?;
    crate::memory::require(
        crate::memory::product(&[keys.len() as u64, opened.page_bytes as u64]),
        "the pages watched × --page-size (and the geometry)",
    )?;
    let expected = match (&args.put, &args.expect) {
        (Some(path), _) => Some(read_pages(path, "--put", keys.len(), opened.page_bytes)?),
        (None, Some(path)) => Some(read_pages(path, "--expect", keys.len(), opened.page_bytes)?),
        (None, None) => None,
    };
    let put = |bytes: &[u8]| -> anyhow::Result<usize> {
        let pages: Vec<PageSegments<'_>> = bytes.chunks(opened.page_bytes).map(|page| vec![page]).collect();
        let outcomes = opened.backend.batch_set(&keys, &pages)?;
        // written, not only taken: other processes (the ones the canary stands for) find the pages from now on
        opened.backend.flush()?;
        if let Some((key, SetOutcome::Failed(failure))) =
            keys.iter().zip(&outcomes).find(|(_, outcome)| matches!(outcome, SetOutcome::Failed(_)))
        {
            bail!("page {key} ({}): {failure}", opened.description);
        }
        Ok(outcomes.iter().filter(|outcome| **outcome == SetOutcome::Stored).count())
    };
    let canary = expected.as_deref().filter(|_| args.put.is_some());
    if let Some(bytes) = canary {
        put(bytes)?;
    }
    let stop = stop_signals()?;
    let stdin_closed = stdin_end();
    let mut out = Printer { json: args.target.json, out: std::io::stdout().lock() };
    let ready =
        Line { event: "ready", pages: keys.len(), message: Some(opened.description.clone()), ..Line::default() };
    out.line(&ready)?;
    let mut wrong_rounds = 0u64;
    let mut buffer = vec![0u8; keys.len() * opened.page_bytes];
    let mut round = 0;
    let ended = loop {
        if args.rounds.is_some_and(|rounds| round >= rounds) {
            break "rounds";
        }
        if stop.load(Ordering::Relaxed) {
            break "signal";
        }
        round += 1;
        buffer.fill(0);
        let started = Instant::now();
        let mut pages: Vec<PageSegmentsMut<'_>> = buffer.chunks_mut(opened.page_bytes).map(|page| vec![page]).collect();
        let answer = opened.backend.batch_get(&keys, &mut pages);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        drop(pages);
        let mut line = Line { event: "round", round: Some(round), pages: keys.len(), ms: Some(ms), ..Line::default() };
        match answer {
            Err(error) => (line.outcome, line.message) = (Some("error"), Some(error.to_string())),
            Ok(outcomes) => judge(&mut line, &outcomes, &keys, expected.as_deref(), &buffer, opened.page_bytes),
        }
        wrong_rounds += u64::from(line.outcome == Some("wrong"));
        let missing = line.outcome == Some("missing");
        out.line(&line)?;
        // a canary that lost pages (evicted, or a host that held them gone) writes them again
        if let (Some(bytes), true) = (canary, missing) {
            let line = match put(bytes) {
                Ok(stored) => Line { event: "put", pages: keys.len(), pages_whole: stored, ..Line::default() },
                Err(error) => {
                    Line { event: "put", pages: keys.len(), message: Some(error.to_string()), ..Line::default() }
                }
            };
            out.line(&line)?;
        }
        match stdin_closed.as_ref().map(|closed| closed.recv_timeout(Duration::from_millis(args.interval_ms))) {
            Some(Ok(()) | Err(RecvTimeoutError::Disconnected)) => break "the end of standard input",
            Some(Err(RecvTimeoutError::Timeout)) => {}
            None => std::thread::sleep(Duration::from_millis(args.interval_ms)),
        }
    };
    out.line(&Line {
        event: "end",
        round: Some(round),
        pages: keys.len(),
        message: Some(ended.into()),
        ..Line::default()
    })?;
    if wrong_rounds > 0 {
        bail!(
            "{wrong_rounds} of {round} rounds read pages whole with other bytes than expected ({})",
            opened.description
        );
    }
    Ok(())
}

/// A round's outcome from its pages' (`expected`: the bytes they must hold, if known; `buffer`: what was read).
fn judge(
    line: &mut Line,
    outcomes: &[GetOutcome],
    keys: &[PageKey],
    expected: Option<&[u8]>,
    buffer: &[u8],
    page_bytes: usize,
) {
    let mut wrong = None;
    for ((index, outcome), key) in outcomes.iter().enumerate().zip(keys) {
        let page = index * page_bytes..(index + 1) * page_bytes;
        match outcome {
            GetOutcome::Hit if expected.is_some_and(|bytes| bytes[page.clone()] != buffer[page]) => {
                line.pages_wrong += 1;
                wrong.get_or_insert_with(|| format!("page {key}: other bytes than expected"));
            }
            GetOutcome::Hit => line.pages_whole += 1,
            GetOutcome::Miss => {
                line.outcome.get_or_insert("missing");
                line.message.get_or_insert_with(|| format!("page {key}: not in the store"));
            }
            GetOutcome::Failed(failure) => {
                line.outcome.get_or_insert("failed");
                line.message.get_or_insert_with(|| format!("page {key}: {failure}"));
            }
        }
    }
    if let Some(wrong) = wrong {
        (line.outcome, line.message) = (Some("wrong"), Some(wrong));
    }
    line.outcome.get_or_insert("whole");
}

/// Lines as text or JSON (one object per line), flushed each.
struct Printer<W: std::io::Write> {
    json: bool,
    out: W,
}

impl<W: std::io::Write> Printer<W> {
    fn line(&mut self, line: &Line) -> anyhow::Result<()> {
        if self.json {
            serde_json::to_writer(&mut self.out, line)?;
            writeln!(self.out)?;
        } else if line.event != "round" {
            let detail = line.message.as_deref().unwrap_or_default();
            match line.event {
                "put" => {
                    writeln!(self.out, "put: {} of {} pages written again {detail}", line.pages_whole, line.pages)?
                }
                "end" => writeln!(self.out, "end after {} rounds: {detail}", line.round.unwrap_or_default())?,
                _ => writeln!(self.out, "{}: {} pages, {detail}", line.event, line.pages)?,
            }
        } else {
            write!(
                self.out,
                "round {}: {} ({} of {} pages whole, {} wrong) in {:.1} ms",
                line.round.unwrap_or_default(),
                line.outcome.unwrap_or_default(),
                line.pages_whole,
                line.pages,
                line.pages_wrong,
                line.ms.unwrap_or_default()
            )?;
            match &line.message {
                Some(message) => writeln!(self.out, ": {message}")?,
                None => writeln!(self.out)?,
            }
        }
        self.out.flush()?;
        Ok(())
    }
}

/// Set once SIGINT or SIGTERM arrives: the watch ends after its round (and closes its backend); a second one ends the
/// process at once, with 128 + the signal's number, as a shell reports a process killed by it.
fn stop_signals() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(signal, 128 + signal, stop.clone())?;
        signal_hook::flag::register(signal, stop.clone())?;
    }
    Ok(stop)
}

/// Told when standard input, if it is a pipe, ends (read to its end on a thread of its own); `None` for a terminal,
/// a file or nothing.
fn stdin_end() -> Option<Receiver<()>> {
    let stdin = std::io::stdin();
    let is_pipe = std::os::fd::AsFd::as_fd(&stdin)
        .try_clone_to_owned()
        .ok()
        .and_then(|fd| std::fs::File::from(fd).metadata().ok())
        .is_some_and(|metadata| metadata.file_type().is_fifo());
    if !is_pipe {
        return None;
    }
    let (sender, receiver) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("hicache-watch-stdin".into())
        .spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            let _ = sender.send(());
        })
        .ok()?;
    Some(receiver)
}
