//! `cargo xtask fuzz`: every fuzz target for a bounded time, installing cargo-fuzz from the crates registry if absent.
//!
//! cargo-fuzz needs nightly flags; `RUSTC_BOOTSTRAP=1` lets the stable toolchain accept them.

use std::process::Command;

use anyhow::{Context, bail};

use crate::run_program;

/// Version of cargo-fuzz installed when none is on the PATH.
const CARGO_FUZZ_VERSION: &str = "0.13.2";

pub(crate) fn run(args: &[String]) -> anyhow::Result<()> {
    let mut seconds = 30u64;
    let mut targets: Vec<String> = Vec::new();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--seconds" => {
                let value = rest.next().context("--seconds needs a value")?;
                seconds = value.parse().with_context(|| format!("--seconds {value:?} is not a whole number"))?;
            }
            name if !name.starts_with('-') => targets.push(name.to_owned()),
            other => bail!("unknown fuzz option {other:?}"),
        }
    }
    ensure_cargo_fuzz()?;
    let all = list_targets()?;
    if targets.is_empty() {
        targets = all.clone();
    }
    if let Some(unknown) = targets.iter().find(|target| !all.contains(target)) {
        bail!("no fuzz target {unknown:?}; there are: {}", all.join(", "));
    }
    let time = format!("-max_total_time={seconds}");
    for target in &targets {
        // corpus under fuzz/corpus/<target> (ignored by git); crashes land in fuzz/artifacts/<target>
        run_program(
            "cargo",
            &["fuzz", "run", "--fuzz-dir", "fuzz", target, "--", &time, "-rss_limit_mb=2048"],
            &[("RUSTC_BOOTSTRAP", "1")],
        )?;
    }
    Ok(())
}

fn ensure_cargo_fuzz() -> anyhow::Result<()> {
    let present =
        Command::new("cargo").args(["fuzz", "--version"]).output().is_ok_and(|output| output.status.success());
    if !present {
        run_program("cargo", &["install", "--locked", "cargo-fuzz", "--version", CARGO_FUZZ_VERSION], &[])?;
    }
    Ok(())
}

fn list_targets() -> anyhow::Result<Vec<String>> {
    let output = Command::new("cargo")
        .args(["fuzz", "list", "--fuzz-dir", "fuzz"])
        .env("RUSTC_BOOTSTRAP", "1")
        .output()
        .context("running cargo fuzz list")?;
    if !output.status.success() {
        bail!("cargo fuzz list failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    Ok(String::from_utf8(output.stdout)?
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(str::to_owned)
        .collect())
}
