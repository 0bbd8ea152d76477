//! Native libraries from wheels on PyPI, for the tests: downloaded with pip for a fixed Python and platform tag
//! (whatever Python this machine has), and only the wanted members unpacked under `target/`.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::run_program;

/// A wheel and what to keep of it.
pub(crate) struct Wheel<'a> {
    /// What pip is asked for, e.g. `nixl-cu12==1.5.1`.
    pub(crate) spec: &'a str,
    /// The Python version whose tag is asked for.
    pub(crate) python: &'a str,
    /// Platform tags pip may take (it matches them exactly).
    pub(crate) platforms: &'a [&'a str],
    /// Members whose path contains one of these are unpacked...
    pub(crate) keep: &'a [&'a str],
    /// ...unless their path contains one of these.
    pub(crate) skip: &'a [&'a str],
}

/// Downloads `wheel` and unpacks its kept members under `dir/lib` (keeping their permission bits); the wheel itself
/// is deleted. Returns `dir/lib`.
pub(crate) fn fetch(wheel: &Wheel<'_>, dir: &Path) -> anyhow::Result<PathBuf> {
    let wheels = dir.join("wheel");
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    let wheels_arg = wheels.to_str().context("the download folder is not UTF-8")?;
    let mut args = vec![
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        wheel.python,
        "--disable-pip-version-check",
        "-d",
        wheels_arg,
    ];
    for platform in wheel.platforms {
        args.extend(["--platform", platform]);
    }
    args.push(wheel.spec);
    run_program("python3", &args, &[])?;
    let file = std::fs::read_dir(&wheels)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .find(|path| path.extension().is_some_and(|extension| extension == "whl"))
        .with_context(|| format!("pip left no wheel in {}", wheels.display()))?;
    let unpacked = dir.join("lib");
    let unzip = "import os, sys, zipfile\n\
        wheel, out, keep, skip = sys.argv[1], sys.argv[2], sys.argv[3].split('|'), sys.argv[4].split('|')\n\
        with zipfile.ZipFile(wheel) as archive:\n\
        \x20   for member in archive.infolist():\n\
        \x20       name = member.filename\n\
        \x20       wanted = any(part in name for part in keep) and not any(part and part in name for part in skip)\n\
        \x20       if wanted and not member.is_dir():\n\
        \x20           path = archive.extract(member, out)\n\
        \x20           os.chmod(path, (member.external_attr >> 16) or 0o644)\n";
    run_program(
        "python3",
        &[
            "-c",
            unzip,
            file.to_str().context("the wheel's path is not UTF-8")?,
            unpacked.to_str().context("the unpack folder is not UTF-8")?,
            &wheel.keep.join("|"),
            &wheel.skip.join("|"),
        ],
        &[],
    )?;
    std::fs::remove_dir_all(&wheels).with_context(|| format!("removing {}", wheels.display()))?;
    Ok(unpacked)
}

/// The folder under `dir` (at most `depth` levels down) that holds a file named `name`.
pub(crate) fn find_file(dir: &Path, name: &str, depth: usize) -> Option<PathBuf> {
    if dir.join(name).is_file() {
        return Some(dir.to_path_buf());
    }
    if depth == 0 {
        return None;
    }
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir).ok()?.filter_map(|entry| entry.ok().map(|entry| entry.path())).collect();
    entries.sort();
    entries.into_iter().filter(|path| path.is_dir()).find_map(|path| find_file(&path, name, depth - 1))
}
