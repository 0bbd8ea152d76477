//! `hicache store watch`: the same pages read again and again through one open backend, a line per round.
//!
//! An operator watches whether a host can read a store, and how fast, while the store, the network or other hosts
//! change; a test drives faults against a process that keeps its backend open (a link taken down and up, a peer
//! killed) and waits for the lines it needs. Each round reads every page into a zeroed buffer; with `--expect FILE`
//! (or `--put FILE`, which writes the pages first and keeps the backend open, so a Mooncake client lends its segment
//! while the watch runs) each page read whole is compared with the file. A page read whole with other bytes is
//! `wrong`, and the watch then exits with status 1 when it ends: a store must never serve it.
//!
//! Rounds start `--interval-ms` apart (after the last one ended). The watch ends after `--rounds`, on SIGINT or
//! SIGTERM (the round in flight ends first, and the backend is closed), or at the end of standard input when that is
//! a pipe (a test that drops its end stops the watch).

use std::os::unix::fs::FileTypeExt as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
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
#[derive(Debug, Serialize)]
struct Line {
    /// `ready` (the backend is open, and the pages written with --put), then one `round` per read.
    event: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    round: Option<u64>,
    /// `whole` (every page read, and right), `missing` (a page not in the store), `failed` (a page read wrong in
    /// the store's own terms: short, incomplete, its checksum), `error` (the call failed), `wrong` (a page read
    /// whole with other bytes than expected).
    #[serde(skip_serializing_if = "Option::is_none")]
    outcome: Option<&'static str>,
    /// Pages read whole (with the right bytes, when they are known).
    pages_whole: usize,
    pages: usize,
    /// Pages read whole with other bytes than expected.
    pages_wrong: usize,
    /// How long the round's call took.
    #[serde(skip_serializing_if = "Option::is_none")]
    ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<String>,
}

pub(super) fn watch(args: &WatchArgs) -> anyhow::Result<()> {
    let mode = if args.put.is_some() { Mode::Write } else { Mode::Inspect };
    let opened = open(&args.target, mode)?;
    let keys = keys(&args.keys, opened.namespace.page_size)?;
    let expected = match (&args.put, &args.expect) {
        (Some(path), _) => Some(read_pages(path, "--put", keys.len(), opened.page_bytes)?),
        (None, Some(path)) => Some(read_pages(path, "--expect", keys.len(), opened.page_bytes)?),
        (None, None) => None,
    };
    if let (Some(bytes), Some(_)) = (&expected, &args.put) {
        let pages: Vec<PageSegments<'_>> = bytes.chunks(opened.page_bytes).map(|page| vec![page]).collect();
        let outcomes = opened.backend.batch_set(&keys, &pages)?;
        if let Some((key, SetOutcome::Failed(failure))) =
            keys.iter().zip(&outcomes).find(|(_, outcome)| matches!(outcome, SetOutcome::Failed(_)))
        {
            bail!("page {key} ({}): {failure}", opened.description);
        }
    }
    let stop = stop_signals()?;
    let stdin_closed = stdin_end();
    let mut out = Printer { json: args.target.json, out: std::io::stdout().lock() };
    out.line(&Line {
        event: "ready",
        round: None,
        outcome: None,
        pages_whole: 0,
        pages: keys.len(),
        pages_wrong: 0,
        ms: None,
        message: Some(opened.description.clone()),
    })?;
    let mut wrong_rounds = 0u64;
    let mut buffer = vec![0u8; keys.len() * opened.page_bytes];
    let mut round = 0;
    while args.rounds.is_none_or(|rounds| round < rounds) && !stop.load(Ordering::Relaxed) {
        round += 1;
        buffer.fill(0);
        let started = Instant::now();
        let mut pages: Vec<PageSegmentsMut<'_>> = buffer.chunks_mut(opened.page_bytes).map(|page| vec![page]).collect();
        let answer = opened.backend.batch_get(&keys, &mut pages);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        drop(pages);
        let mut line = Line {
            event: "round",
            round: Some(round),
            outcome: None,
            pages_whole: 0,
            pages: keys.len(),
            pages_wrong: 0,
            ms: Some(ms),
            message: None,
        };
        match answer {
            Err(error) => (line.outcome, line.message) = (Some("error"), Some(error.to_string())),
            Ok(outcomes) => {
                for ((index, outcome), key) in outcomes.iter().enumerate().zip(&keys) {
                    let page = index * opened.page_bytes..(index + 1) * opened.page_bytes;
                    match outcome {
                        GetOutcome::Hit
                            if expected.as_ref().is_some_and(|bytes| bytes[page.clone()] != buffer[page]) =>
                        {
                            line.pages_wrong += 1;
                            line.message.get_or_insert_with(|| format!("page {key}: other bytes than expected"));
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
                if line.pages_wrong > 0 {
                    line.outcome = Some("wrong");
                    wrong_rounds += 1;
                }
                line.outcome.get_or_insert("whole");
            }
        }
        out.line(&line)?;
        if args.rounds.is_some_and(|rounds| round >= rounds) {
            break;
        }
        match stdin_closed.as_ref().map(|closed| closed.recv_timeout(Duration::from_millis(args.interval_ms))) {
            Some(Ok(()) | Err(RecvTimeoutError::Disconnected)) => break,
            Some(Err(RecvTimeoutError::Timeout)) => {}
            None => std::thread::sleep(Duration::from_millis(args.interval_ms)),
        }
    }
    if wrong_rounds > 0 {
        bail!(
            "{wrong_rounds} of {round} rounds read pages whole with other bytes than expected ({})",
            opened.description
        );
    }
    Ok(())
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
        } else if line.event == "ready" {
            writeln!(self.out, "ready: {} pages, {}", line.pages, line.message.as_deref().unwrap_or_default())?;
        } else {
            write!(
                self.out,
                "round {}: {} ({} of {} pages whole) in {:.1} ms",
                line.round.unwrap_or_default(),
                line.outcome.unwrap_or_default(),
                line.pages_whole,
                line.pages,
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

/// Set once SIGINT or SIGTERM arrives: the watch ends after its round.
fn stop_signals() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
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
