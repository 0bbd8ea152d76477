//! `hicache config check FILE`: validates a config and prints every value as it will be used; `hicache config
//! example`: a config file with every field at its default, to start from.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use hicache_core::config::HiCacheConfig;

use crate::exit::Usage;

/// Config commands.
#[derive(Debug, Subcommand)]
pub(crate) enum ConfigCommand {
    /// Validate a config file (JSON) and print the resolved values, defaults included.
    Check(CheckArgs),
    /// Print a config file (JSON) with every field at its default (SGLang 0.5.2's values), to edit and check.
    Example,
}

/// Arguments of `hicache config check`.
#[derive(Debug, Args)]
pub(crate) struct CheckArgs {
    /// The config file: a JSON object with SGLang's names (page_size, hicache_ratio, write_policy, ...).
    #[arg(value_name = "FILE")]
    file: PathBuf,
    /// Print the resolved config as one JSON object (the same field names as the file).
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(command: &ConfigCommand) -> anyhow::Result<()> {
    let args = match command {
        ConfigCommand::Check(args) => args,
        ConfigCommand::Example => {
            println!("{}", serde_json::to_string_pretty(&HiCacheConfig::default())?);
            return Ok(());
        }
    };
    let text = crate::input::read_text(Some(&args.file), "config file", crate::input::CONFIG_LIMIT)?;
    let config = HiCacheConfig::from_json(&text).map_err(|error| Usage(format!("{}: {error}", args.file.display())))?;
    let resolved = serde_json::to_value(&config)?;
    if args.json {
        println!("{resolved}");
    } else {
        println!("{}: valid", args.file.display());
        if let serde_json::Value::Object(fields) = resolved {
            for (name, value) in fields {
                println!("  {name} = {value}");
            }
        }
    }
    Ok(())
}
