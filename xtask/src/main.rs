//! Project automation: `cargo xtask ci` (every check CI runs), `cargo xtask fuzz` (bounded fuzzing), `cargo xtask
//! wheel` (the Python package) and `cargo xtask sglang` (its tests with SGLang's own code).
//!
//! Commands are run with argument arrays, never through a shell. Under `CI=true` a step that cannot run fails.
#![forbid(unsafe_code)]

mod bindgen;
mod fuzz;
mod hf3fs;
mod mooncake;
mod nixl;
mod nvrtc;
mod python;
#[cfg(test)]
mod tidy;
mod wheel;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

const USAGE: &str = "usage: cargo xtask ci [--no-fuzz] | cargo xtask fuzz [--seconds N] [TARGET...] | cargo xtask mooncake [--port N] | cargo xtask nixl | cargo xtask nvrtc | cargo xtask bindgen [--check] | cargo xtask wheel [--cuda] | cargo xtask sglang [UNITTEST ARGS]";

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            return std::process::ExitCode::SUCCESS;
        }
        Some("ci" | "bindgen" | "fuzz" | "mooncake" | "nixl" | "nvrtc" | "wheel" | "sglang") => {}
        _ => {
            eprintln!("{USAGE}");
            return std::process::ExitCode::from(2);
        }
    }
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("Error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> anyhow::Result<()> {
    let root = project_root();
    std::env::set_current_dir(&root).with_context(|| format!("entering {}", root.display()))?;
    match args.first().map(String::as_str) {
        Some("ci") => ci(&args[1..]),
        Some("bindgen") => bindgen::run(&args[1..]),
        Some("fuzz") => fuzz::run(&args[1..]),
        Some("mooncake") => mooncake::run(&args[1..]),
        Some("nixl") => {
            let dir = nixl::prepare()?;
            println!("{}", dir.display());
            Ok(())
        }
        Some("wheel") => python::wheel_command(&args[1..]),
        Some("sglang") => python::test(&args[1..], &[]),
        Some("nvrtc") => {
            let dir = nvrtc::prepare()?;
            println!("{}", dir.display());
            Ok(())
        }
        _ => bail!("{USAGE}"),
    }
}

fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// Installs Debian packages (as root; refreshing the package lists when a first try fails, as on a fresh machine).
/// `why` says what needs them, for the error when this is not root.
pub(crate) fn apt_install(packages: &[&str], why: &str) -> anyhow::Result<()> {
    let is_root = Command::new("id").arg("-u").output().is_ok_and(|output| output.stdout.starts_with(b"0\n"));
    if !is_root {
        bail!("{why}: install Debian's {}", packages.join(" "));
    }
    let mut install = vec!["install", "-y", "-q", "--no-install-recommends"];
    install.extend(packages);
    let env = [("DEBIAN_FRONTEND", "noninteractive")];
    if run_program("apt-get", &install, &env).is_err() {
        run_program("apt-get", &["update", "-q"], &env)?;
        run_program("apt-get", &install, &env)?;
    }
    Ok(())
}

/// Runs a program with arguments and extra environment; fails on a non-zero exit.
pub(crate) fn run_program(program: &str, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<()> {
    let started = Instant::now();
    eprintln!(
        "xtask: $ {}{program} {}",
        env.iter().map(|(key, value)| format!("{key}={value} ")).collect::<String>(),
        args.join(" ")
    );
    let status = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .status()
        .with_context(|| format!("starting {program}"))?;
    if !status.success() {
        bail!("{program} {} failed ({status})", args.join(" "));
    }
    eprintln!("xtask: ok in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Everything CI checks, in order of cost.
fn ci(args: &[String]) -> anyhow::Result<()> {
    let with_fuzz = match args {
        [] => true,
        [flag] if flag == "--no-fuzz" => false,
        _ => bail!("{USAGE}"),
    };
    let started = Instant::now();
    run_program("cargo", &["fmt", "--all", "--", "--check"], &[])?;
    // the fuzz workspace's lock file must be up to date, or running the fuzzers rewrites it
    let fuzz_lock = Command::new("cargo")
        .args(["metadata", "--locked", "--format-version", "1", "--manifest-path", "fuzz/Cargo.toml"])
        .stdout(std::process::Stdio::null())
        .status()
        .context("starting cargo metadata")?;
    if !fuzz_lock.success() {
        bail!("fuzz/Cargo.lock is out of date: run `cargo metadata --manifest-path fuzz/Cargo.toml` and commit it");
    }
    // the NIXL backend builds with libclang and is tested against the real library
    let nixl_dir = nixl::prepare()?;
    let nixl_dir = nixl_dir.to_str().context("the NIXL library path is not UTF-8")?;
    let nixl_env = [("HICACHE_NIXL_LIB_DIR", nixl_dir)];
    // each feature set: the defaults, every feature, the core library without its test helpers, the CLI without
    // its backends, the Python package's pure parts
    let feature_sets: [&[&str]; 5] = [
        &["--workspace", "--all-targets"],
        &["--workspace", "--all-targets", "--all-features"],
        &["-p", "hicache-core", "--lib", "--no-default-features"],
        &["-p", "hicache-cli", "--all-targets", "--no-default-features"],
        &["-p", "hicache-py", "--all-targets", "--no-default-features"],
    ];
    for set in feature_sets {
        let args: Vec<&str> =
            ["clippy"].into_iter().chain(set.iter().copied()).chain(["--locked", "--", "-D", "warnings"]).collect();
        run_program("cargo", &args, &[])?;
    }
    // the API docs, every feature on, build without a warning (a broken link, a public doc linking a private item)
    run_program(
        "cargo",
        &["doc", "--workspace", "--all-features", "--no-deps", "--locked"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )?;
    // NVRTC, so that the transfer kernels are compiled for every GPU architecture (no GPU needed)
    let nvrtc_dir = nvrtc::prepare()?;
    let library_path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(path) if !path.is_empty() => format!("{}:{path}", nvrtc_dir.display()),
        _ => nvrtc_dir.display().to_string(),
    };
    // Mooncake: a real master and the real store library (each test starts its own master on loopback ports; on a
    // machine without the CUDA driver the tests load the no-device stand-in themselves, so no other test sees it)
    let mooncake = mooncake::prepare()?;
    let mooncake_library = mooncake.library.to_str().context("the Mooncake library path is not UTF-8")?;
    let mooncake_master = mooncake.master.to_str().context("the mooncake_master path is not UTF-8")?;
    // 3FS: the committed declarations match the header, a real Redis, the USRBIO mock (3FS itself cannot run here)
    bindgen::run(&["--check".into()])?;
    let hf3fs = hf3fs::prepare()?;
    hf3fs::network_tools()?;
    let redis_server = hf3fs.redis_server.to_str().context("the redis-server path is not UTF-8")?;
    let mock_dir = hf3fs.mock_dir.to_str().context("the USRBIO mock path is not UTF-8")?;
    // unit, integration, property and doc tests, and the tidy test (xtask's own tests)
    run_program(
        "cargo",
        &[
            "test",
            "--workspace",
            "--all-features",
            "--locked",
            "--exclude",
            "hicache-storage-nixl",
            "--exclude",
            "hicache-py",
        ],
        &[
            nixl_env[0],
            ("LD_LIBRARY_PATH", &library_path),
            ("HICACHE_REQUIRE_NVRTC", "1"),
            ("MOONCAKE_STORE_LIBRARY", mooncake_library),
            ("HICACHE_MOONCAKE_MASTER_BIN", mooncake_master),
            ("HICACHE_REDIS_SERVER_BIN", redis_server),
            ("HF3FS_LIB_DIR", mock_dir),
        ],
    )?;
    // the examples an engine copies first, run as users run them
    run_program("cargo", &["run", "--locked", "-p", "hicache-examples", "--example", "engine_loop"], &[])?;
    // the Python package's pure parts (a test binary with the Python module in it would need libpython at run time)
    run_program("cargo", &["test", "-p", "hicache-py", "--no-default-features", "--locked"], &[])?;
    // the Python package, built as a wheel and tested with SGLang's own code (torch and SGLang from PyPI), and
    // through it the Mooncake tier against a real master
    python::test(
        &[],
        &[("MOONCAKE_STORE_LIBRARY", mooncake_library), ("HICACHE_MOONCAKE_MASTER_BIN", mooncake_master)],
    )?;
    // NIXL's own advice: one test at a time (each test still runs concurrent calls into one backend)
    run_program("cargo", &["test", "-p", "hicache-storage-nixl", "--locked", "--", "--test-threads=1"], &nixl_env)?;
    // the lock-free state machines, model-checked
    run_program(
        "cargo",
        &["test", "-p", "hicache-core", "--lib", "--release", "--locked", "--target-dir", "target/loom", "loom"],
        &[("RUSTFLAGS", "--cfg loom"), ("LOOM_MAX_PREEMPTIONS", "3")],
    )?;
    if with_fuzz {
        fuzz::run(&["--seconds".into(), "20".into()])?;
    }
    eprintln!("xtask: ci passed in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}
