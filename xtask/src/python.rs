//! The Python package `hicache` (crate `hicache-py`): `cargo xtask wheel` builds its wheel with maturin;
//! `cargo xtask sglang` tests it with SGLang's own code.
//!
//! Both use one virtual environment, `target/python/venv`, made with this machine's `python3` and filled from PyPI:
//! maturin, the torch wheel (used on the CPU), the `sglang` wheel without its dependencies (most are GPU kernels), and
//! what the import chain of SGLang's storage and host-pool modules needs. A marker file records what was installed,
//! so a second run installs nothing.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use crate::run_program;

const VENV: &str = "target/python/venv";
const WHEELS: &str = "target/python/wheels";
const MATURIN: &str = "maturin==1.16.0";
const TORCH: &str = "torch==2.14.1";
const SGLANG: &str = "sglang==0.5.23";
/// What `sglang.srt.mem_cache.hicache_storage`, `...storage.backend_factory`, `...pool_host.mha` and
/// `...pool_host.mla` import, at the versions `sglang==0.5.23` pins where it pins one.
const SGLANG_IMPORTS: &[&str] = &[
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "packaging",
    "pillow",
    "starlette",
    "msgspec",
    "pydantic",
    "pyzmq",
    "tqdm",
    "ipython",
    "aiohttp",
    "transformers==5.19.0",
    "torchvision",
    "dill",
    "apache-tvm-ffi==0.1.11",
    "sentencepiece==0.2.1",
    "compressed-tensors==0.18.0",
    "gguf",
    "prometheus-client",
    // SGLang compiles its page-key hashing (C++, linked with OpenSSL's libcrypto) with torch's extension builder
    "ninja",
];

/// `cargo xtask wheel [--cuda]`: builds the wheel (with `--cuda`, with the CUDA engine under `hicache.Cache`) and
/// prints its path.
pub(crate) fn wheel_command(args: &[String]) -> anyhow::Result<()> {
    let cuda = match args {
        [] => false,
        [flag] if flag == "--cuda" => true,
        other => bail!("cargo xtask wheel: unknown arguments {other:?} (usage: cargo xtask wheel [--cuda])"),
    };
    let venv = venv(false)?;
    println!("{}", build_wheel(&venv, cuda)?.display());
    Ok(())
}

/// `cargo xtask sglang [UNITTEST ARGS]` (and `ci`): builds and installs the wheel into the SGLang environment, then
/// runs the package's tests (`hicache-py/tests`) there with `args` added, and `env`.
pub(crate) fn test(args: &[String], env: &[(&str, &str)]) -> anyhow::Result<()> {
    let venv = venv(true)?;
    let wheel = build_wheel(&venv, false)?;
    let python = python_of(&venv);
    let python = python.to_str().context("the venv path is not UTF-8")?;
    let wheel = wheel.to_str().context("the wheel path is not UTF-8")?;
    run_program(
        python,
        &["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--force-reinstall", wheel],
        &[],
    )?;
    let mut unittest = vec!["-m", "unittest", "discover", "--start-directory", "hicache-py/tests", "--verbose"];
    unittest.extend(args.iter().map(String::as_str));
    // the venv's programs first (SGLang's extension builder runs `ninja`)
    let bin = std::fs::canonicalize(venv.join("bin")).context("finding the venv")?;
    let path = match std::env::var("PATH") {
        Ok(path) if !path.is_empty() => format!("{}:{path}", bin.display()),
        _ => bin.display().to_string(),
    };
    let mut env = env.to_vec();
    env.push(("PATH", &path));
    run_program(python, &unittest, &env)
}

/// The venv's Python.
pub(crate) fn python_of(venv: &Path) -> PathBuf {
    venv.join("bin/python")
}

/// The environment, made and filled where it lacks something; with `sglang`, also torch and SGLang.
pub(crate) fn venv(sglang: bool) -> anyhow::Result<PathBuf> {
    if sglang && !Path::new("/usr/include/openssl/sha.h").is_file() {
        crate::apt_install(&["libssl-dev"], "SGLang's page-key hashing compiles against OpenSSL")?;
    }
    let venv = PathBuf::from(VENV);
    let python = python_of(&venv);
    if !python.is_file() {
        run_program("python3", &["-m", "venv", VENV], &[])?;
    }
    let python = python.to_str().context("the venv path is not UTF-8")?;
    let mut wanted: Vec<&str> = vec![MATURIN];
    if sglang {
        wanted.push(TORCH);
        wanted.push(SGLANG);
        wanted.extend(SGLANG_IMPORTS);
    }
    let marker = venv.join(".hicache-installed");
    let installed = std::fs::read_to_string(&marker).unwrap_or_default();
    let missing: Vec<&str> =
        wanted.iter().copied().filter(|spec| !installed.lines().any(|line| line == *spec)).collect();
    if missing.is_empty() {
        return Ok(venv);
    }
    let pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"];
    // SGLang itself without its dependencies (most are GPU kernels); the rest with theirs
    let (sglang_spec, others): (Vec<&str>, Vec<&str>) = missing.iter().partition(|spec| **spec == SGLANG);
    if !others.is_empty() {
        let args: Vec<&str> = pip[1..].iter().copied().chain(others.iter().copied()).collect();
        run_program(python, &args, &[])?;
    }
    if !sglang_spec.is_empty() {
        let args: Vec<&str> = pip[1..].iter().copied().chain(["--no-deps", SGLANG]).collect();
        run_program(python, &args, &[])?;
    }
    let record: String = installed.lines().chain(missing.iter().copied()).map(|line| format!("{line}\n")).collect();
    std::fs::write(&marker, record).with_context(|| format!("writing {}", marker.display()))?;
    Ok(venv)
}

/// Builds the release wheel into `target/python/wheels` (emptied first), with the `cuda` feature when asked;
/// returns its path.
fn build_wheel(venv: &Path, cuda: bool) -> anyhow::Result<PathBuf> {
    let _ = std::fs::remove_dir_all(WHEELS);
    let maturin = venv.join("bin/maturin");
    let python = python_of(venv);
    let mut args = vec![
        "build",
        "--release",
        "--locked",
        "--manifest-path",
        "hicache-py/Cargo.toml",
        "--out",
        WHEELS,
        "--interpreter",
        python.to_str().context("the venv path is not UTF-8")?,
    ];
    if cuda {
        args.extend(["--features", "cuda"]);
    }
    run_program(maturin.to_str().context("the venv path is not UTF-8")?, &args, &[])?;
    let wheels: Vec<PathBuf> = std::fs::read_dir(WHEELS)
        .with_context(|| format!("reading {WHEELS}"))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|extension| extension == "whl"))
        .collect();
    match wheels.as_slice() {
        [wheel] => Ok(wheel.clone()),
        other => bail!("maturin left {} wheels in {WHEELS}, expected one", other.len()),
    }
}
