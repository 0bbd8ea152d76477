//! `replay --processes`: each TP rank a process of its own, as a served model runs them. The launcher starts one
//! `hicache replay` per rank with the same arguments plus the rank and a meeting folder; each rank builds its pools,
//! controller and storage, joins the group (NCCL on GPU r with `--engine cuda`, a local socket with the CPU engine),
//! runs the workload and leaves its outcome in the meeting folder; the launcher compares the ranks' decisions and
//! prints the report as the threaded replay does. A rank that fails stops the others (its error is on stderr).
//!
//! The ranks end with their launcher, however it ends: each is started with the parent-death signal set to SIGTERM,
//! so when the launcher exits or is killed (SIGKILL included) the kernel stops the ranks, and their signal handler
//! removes the launcher's temporary folders (the meeting folder and the storage folder it made), which a killed
//! launcher cannot. A launcher stopped by SIGTERM, SIGINT or SIGHUP removes them itself.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

use super::rank::RankOutcome;
use super::{EngineName, RankGroup, ReplayArgs, SharedStorage};

/// How long joining the group and each collective may wait for the other ranks.
const DEADLINE: Duration = Duration::from_secs(60);

/// Starts the ranks, waits for them, and prints the report.
pub(super) fn launch(args: &ReplayArgs, storage: &SharedStorage) -> anyhow::Result<()> {
    let meeting = crate::cleanup::TempFolder::new("hicache-replay-ranks-")?;
    let mut base: Vec<OsString> = std::env::args_os().skip(1).collect();
    if let SharedStorage::Backend { _temp: Some(temp), .. } = storage {
        // the ranks share the launcher's temporary storage folder (and remove it if the launcher is killed)
        base.extend(["--dir".into(), temp.path().as_os_str().to_owned()]);
        base.extend(["--process-temp".into(), temp.path().as_os_str().to_owned()]);
    }
    let launcher = std::process::id();
    let program = std::env::current_exe().context("finding the hicache program")?;
    let mut children: Vec<Option<Child>> = Vec::new();
    for rank in 0..super::ranks(args) {
        let mut command = Command::new(&program);
        // SAFETY: between fork and exec the closure makes only async-signal-safe calls (prctl, getppid). The
        // parent-death signal follows the thread that forked, this (the launcher's main) thread, which outlives
        // the ranks.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // the launcher may have died before the signal was set
                if libc::getppid() as u32 != launcher {
                    return Err(std::io::Error::other("the launcher ended before its rank started"));
                }
                Ok(())
            });
        }
        let child = command
            .args(&base)
            .args([
                "--process-rank".into(),
                rank.to_string().into(),
                "--process-dir".into(),
                meeting.path().as_os_str().to_owned(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting rank {rank}"));
        match child {
            Ok(child) => children.push(Some(child)),
            Err(error) => {
                stop(&mut children);
                return Err(error);
            }
        }
    }
    // wait for every rank; the first that fails stops the others
    loop {
        let mut running = 0;
        for rank in 0..children.len() {
            let Some(child) = children[rank].as_mut() else { continue };
            match child.try_wait().context("waiting for a rank")? {
                None => running += 1,
                Some(status) if status.success() => children[rank] = None,
                Some(status) => {
                    children[rank] = None;
                    stop(&mut children);
                    bail!("rank {rank} (a process of its own) failed ({status}); its error is above");
                }
            }
        }
        if running == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let outcomes = (0..super::ranks(args))
        .map(|rank| {
            let path = outcome_path(meeting.path(), rank);
            let text = std::fs::read(&path).with_context(|| format!("reading rank {rank}'s outcome"))?;
            serde_json::from_slice::<RankOutcome>(&text).with_context(|| format!("rank {rank}'s outcome"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let description = super::describe(args, storage);
    super::report::print(args, &description, &outcomes, super::l3_layout(args, storage)?)
}

fn stop(children: &mut [Option<Child>]) {
    for child in children.iter_mut().filter_map(Option::take) {
        let mut child = child;
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn outcome_path(dir: &Path, rank: usize) -> std::path::PathBuf {
    dir.join(format!("rank-{rank}.json"))
}

/// One rank, in its own process: joins the group, runs, and leaves its outcome in `dir`.
pub(super) fn run_rank(args: &ReplayArgs, rank: usize, dir: &Path, storage: &SharedStorage) -> anyhow::Result<()> {
    // stopped by the parent-death signal (the launcher is gone): the launcher's folders go with this rank
    crate::cleanup::remove_on_signal(dir.to_owned());
    if let Some(temp) = &args.process_temp {
        crate::cleanup::remove_on_signal(temp.clone());
    }
    let nothing = |_: u64| {};
    let outcome = match args.engine {
        EngineName::Cpu => {
            let path = dir.join("collective.sock");
            let mut group = super::socket_group::SocketGroup::join(rank, super::ranks(args), &path, DEADLINE)?;
            super::run_one(args, rank, storage, RankGroup::Given(&mut group), &nothing, None)?
        }
        #[cfg(feature = "cuda")]
        EngineName::Cuda => {
            let settings = hicache_cuda::NcclSettings {
                rank,
                world_size: super::ranks(args),
                bootstrap: hicache_cuda::Bootstrap::File(dir.join("nccl.id")),
                deadline: DEADLINE,
            };
            super::run_one(args, rank, storage, RankGroup::Nccl(settings), &nothing, None)?
        }
        #[cfg(not(feature = "cuda"))]
        EngineName::Cuda => unreachable!("refused before the ranks start"),
    };
    let path = outcome_path(dir, rank);
    let partial = path.with_extension("json.partial");
    std::fs::write(&partial, serde_json::to_vec(&outcome)?)
        .with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
