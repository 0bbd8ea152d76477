//! Progress for commands that run for more than a moment: drawn on stderr when stderr is a terminal and the command
//! prints text; hidden under `--json` and when stderr is not a terminal, so results and logs stay clean.

use std::io::IsTerminal as _;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar of `len` steps, `label` before it and `{msg}` (the current step) after it; redrawn every 200 ms, so the
/// elapsed time moves even while one step takes long.
pub(crate) fn bar(len: u64, label: &str, json: bool) -> anyhow::Result<ProgressBar> {
    if json || !std::io::stderr().is_terminal() {
        return Ok(ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden()));
    }
    let bar = ProgressBar::new(len);
    bar.set_style(ProgressStyle::with_template(&format!("{label} {{bar:40}} {{pos}}/{{len}} {{elapsed}} {{msg}}"))?);
    bar.enable_steady_tick(Duration::from_millis(200));
    Ok(bar)
}

/// A counter of steps whose total is not known up front, `label` before it and `{msg}` after it.
pub(crate) fn counter(label: &str, json: bool) -> anyhow::Result<ProgressBar> {
    if json || !std::io::stderr().is_terminal() {
        return Ok(ProgressBar::hidden());
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(ProgressStyle::with_template(&format!("{{spinner}} {label} {{pos}} {{elapsed}} {{msg}}"))?);
    bar.enable_steady_tick(Duration::from_millis(200));
    Ok(bar)
}
