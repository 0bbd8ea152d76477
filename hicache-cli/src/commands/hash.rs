//! `hicache hash`: SGLang-compatible page keys of a token sequence.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use hicache_core::hash::{PageHasher, PageKey, PartialPage, namespace_seed};
use hicache_core::tokens::parse_wide_tokens;

use crate::exit::Usage;

/// What to do with a trailing page shorter than the page size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum PartialArg {
    /// Refuse the input (a short page is never stored).
    Reject,
    /// Leave the tail unhashed, as SGLang's prefetch does.
    Drop,
    /// Hash the tail as a short page, as SGLang's get_hash_str does when given one.
    Hash,
}

impl From<PartialArg> for PartialPage {
    fn from(arg: PartialArg) -> Self {
        match arg {
            PartialArg::Reject => Self::Reject,
            PartialArg::Drop => Self::Drop,
            PartialArg::Hash => Self::Hash,
        }
    }
}

/// Arguments of `hicache hash`.
#[derive(Debug, Args)]
pub(crate) struct HashArgs {
    /// Tokens per page (SGLang's --page-size).
    #[arg(long, value_name = "N")]
    page_size: usize,
    /// Key of the page before the first one (64 hex digits), to continue a chain.
    #[arg(long, value_name = "HEX", conflicts_with_all = ["extra_key", "cache_salt"])]
    prior: Option<String>,
    /// The request's extra key (SGLang 0.5.20+, e.g. a LoRA adapter's name): its chain starts from a namespace seed.
    #[arg(long, value_name = "TEXT")]
    extra_key: Option<String>,
    /// The request's cache salt (SGLang 0.5.20+): its chain starts from a namespace seed.
    #[arg(long, value_name = "TEXT")]
    cache_salt: Option<String>,
    /// What to do with a trailing partial page.
    #[arg(long, value_enum, default_value_t = PartialArg::Reject)]
    partial: PartialArg,
    /// Print a JSON array of keys instead of one key per line.
    #[arg(long)]
    json: bool,
    /// File of token ids: whitespace- or comma-separated integers, or a JSON array; ids up to 2^64 - 1 (a page with
    /// an id of 2^32 or more is hashed by SGLang 0.5.20's wide rule). Standard input when absent or "-".
    #[arg(value_name = "FILE")]
    input: Option<PathBuf>,
}

pub(crate) fn run(args: &HashArgs) -> anyhow::Result<()> {
    if args.page_size == 0 {
        return Err(Usage("--page-size must be at least 1".into()).into());
    }
    let prior = match args.prior.as_deref() {
        Some(prior) => Some(prior.parse::<PageKey>().context("--prior")?),
        None => namespace_seed(args.extra_key.as_deref(), args.cache_salt.as_deref()),
    };
    let text = read_input(args.input.as_ref())?;
    let tokens =
        parse_wide_tokens(&text).with_context(|| format!("reading tokens from {}", input_name(args.input.as_ref())))?;
    if tokens.is_empty() {
        return Err(Usage(format!("no tokens in {}", input_name(args.input.as_ref()))).into());
    }
    let keys = PageHasher::new().page_keys_wide(&tokens, args.page_size, prior, args.partial.into())?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    if args.json {
        let shown: Vec<String> = keys.iter().map(PageKey::to_string).collect();
        serde_json::to_writer(&mut out, &shown)?;
        writeln!(out)?;
    } else {
        for key in &keys {
            writeln!(out, "{key}")?;
        }
    }
    out.flush()?;
    Ok(())
}

fn input_name(input: Option<&PathBuf>) -> String {
    match input {
        Some(path) if path.as_os_str() != "-" => path.display().to_string(),
        _ => "standard input".into(),
    }
}

fn read_input(input: Option<&PathBuf>) -> anyhow::Result<String> {
    crate::input::read_text(input.map(PathBuf::as_path), "token file", crate::input::TOKENS_LIMIT)
}
