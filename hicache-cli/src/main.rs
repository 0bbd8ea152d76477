//! The `hicache` command: page keys, benchmarks and (as the backends land) manual transfers and workload replay.
//!
//! Exit codes: 0 success, 1 runtime failure, 2 usage or configuration error. Errors are one line on stderr.

mod backends;
mod cleanup;
mod commands;
mod exit;
mod input;
mod memory;
mod metrics;
mod progress;
mod replay;

use clap::{Parser, Subcommand};

/// The name a command-line value is given as (`layer-first`, `3fs`), for messages and JSON results.
pub(crate) fn value_name(value: &impl clap::ValueEnum) -> String {
    value.to_possible_value().map(|value| value.get_name().to_owned()).unwrap_or_default()
}

/// hicache: a hierarchical KV cache for LLM inference (device → pinned host → storage).
#[derive(Debug, Parser)]
#[command(name = "hicache", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print SGLang-compatible page keys of a token sequence, one per line.
    Hash(commands::hash::HashArgs),
    /// Measure performance; each figure is printed next to a reference measured in the same run.
    #[command(subcommand)]
    Bench(commands::bench::BenchCommand),
    /// Replay a multi-turn chat workload through the cache and report hits per tier, TTFT and bytes moved.
    Replay(replay::ReplayArgs),
    /// Move pages by hand between local files and a storage backend, and inspect it.
    #[command(subcommand)]
    Store(commands::store::StoreCommand),
    /// Check configuration files.
    #[command(subcommand)]
    Config(commands::config::ConfigCommand),
}

fn main() {
    let cli = Cli::parse();
    // the store commands inspect storage an operator looks after: what they skip (an unreadable folder) is said
    metrics::init_tracing(if matches!(cli.command, Command::Store(_)) { "warn" } else { "off" });
    let result = match cli.command {
        Command::Hash(args) => commands::hash::run(&args),
        Command::Bench(command) => commands::bench::run(&command),
        Command::Config(command) => commands::config::run(&command),
        Command::Replay(args) => replay::run(&args),
        Command::Store(command) => commands::store::run(&command),
    };
    let code = match result {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("hicache: error: {error:#}");
            exit::code_for(&error)
        }
    };
    cleanup::close();
    exit::now(code)
}
