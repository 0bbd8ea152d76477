//! Tensor-parallel ranks in separate processes, one GPU each, agreeing through NCCL: [`NcclGroup`] is the core's
//! `Collective` over an NCCL communicator on the caller's GPU.
//!
//! * **Joining.** Rank 0 makes NCCL's unique id and the others get it out of band: through a file every rank can
//!   read ([`Bootstrap::File`]: rank 0 writes it atomically, the others wait for it), or as text the caller ships its
//!   own way ([`Bootstrap::Id`], from [`NcclGroup::unique_id`]; an environment variable, say). Every rank then joins
//!   within the deadline; a rank that does not come makes the others fail with an error naming it (with a file
//!   bootstrap each rank leaves an arrival mark beside the id file, so the missing ranks are known), never a hang.
//! * **Each collective** is checked as `InProcessGroup` checks it: a fixed-size header (round, operation, length) is
//!   all-reduced first to its minimum and maximum in one call (the maximum of the header and of its negation), so
//!   every rank learns whether all ranks entered the same collective before any values are combined; then the
//!   values. Every call waits at most the deadline for the GPU to finish it; a rank that never arrives makes the
//!   others abort the communicator and fail. After a mismatch or a timeout the group is broken and every later call
//!   fails at once.
//! * **NCCL** is loaded at run time (`libnccl.so`, found by the loader); missing, joining is an error saying so.
//!
//! Bytes move through a small device buffer with synchronous copies while the group's own (non-blocking) stream is
//! idle, so a collective stuck on the GPU never blocks other work's copies.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use hicache_core::Error;
use hicache_core::collective::{Collective, ReduceOp};

use crate::device::Device;
use crate::driver::{DeviceBuffer, driver};

/// How the ranks learn NCCL's unique id from rank 0.
#[derive(Clone, Debug)]
pub enum Bootstrap {
    /// A path every rank can read (a shared or local file system): rank 0 writes the id there, the others wait for
    /// it. Use a fresh path for each group: a file left by an earlier group would be read as this one's.
    File(PathBuf),
    /// The id as [`NcclGroup::unique_id`] gave it to rank 0, shipped by the caller (rank 0 passes it too).
    Id(String),
}

/// Who this rank is and how the group forms.
#[derive(Clone, Debug)]
pub struct NcclSettings {
    /// This rank, below `world_size`.
    pub rank: usize,
    /// Ranks in the group (one process and one GPU each).
    pub world_size: usize,
    /// How the unique id reaches every rank.
    pub bootstrap: Bootstrap,
    /// How long joining and each collective may wait for the other ranks.
    pub deadline: Duration,
}

/// An NCCL communicator; aborted when dropped.
struct Communicator(nccl_sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not overlap; it is only used
// through `&mut NcclGroup` (or, while joining, by the one thread that made it).
unsafe impl Send for Communicator {}

impl Drop for Communicator {
    fn drop(&mut self) {
        // SAFETY: the communicator was initialised and is aborted once; abort also stops a collective stuck on the
        // GPU waiting for a rank that never came.
        let _ = unsafe { nccl::comm_abort(self.0) };
    }
}

/// The core's `Collective` over NCCL: one rank of a group of processes.
pub struct NcclGroup {
    // dropped (aborted) before the stream and buffer it may still be using
    communicator: Option<Communicator>,
    stream: Arc<CudaStream>,
    done: CudaEvent,
    buffer: DeviceBuffer,
    device: Device,
    rank: usize,
    world_size: usize,
    deadline: Duration,
    round: i64,
    broken: Option<String>,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("round", &self.round)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

/// Header elements: round, operation, length.
const HEADER: usize = 3;

/// Whether NCCL can be loaded here.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the NCCL library and reports whether that worked.
    unsafe { nccl_sys::is_culib_present() }
}

fn nccl_error(operation: &'static str) -> impl FnOnce(nccl::NcclError) -> Error {
    move |error| Error::device(operation, format!("NCCL: {:?}", error.0))
}

impl NcclGroup {
    /// A new NCCL unique id, as text for [`Bootstrap::Id`] (call it on rank 0 and ship the text to every rank).
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when NCCL cannot be loaded or fails.
    pub fn unique_id() -> Result<String, Error> {
        require_nccl()?;
        let id = nccl::get_uniqueid().map_err(nccl_error("make a unique id"))?;
        Ok(id.internal.iter().map(|&byte| format!("{:02x}", byte as u8)).collect())
    }

    /// Joins the group as `settings.rank` on `device`; returns when every rank has joined.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a rank outside the group or a malformed id; [`Error::Timeout`] naming the
    /// ranks that did not come (where known) when the group did not form within the deadline; [`Error::Device`]
    /// when NCCL is missing or fails.
    pub fn join(device: &Device, settings: &NcclSettings) -> Result<Self, Error> {
        let (rank, world_size) = (settings.rank, settings.world_size);
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument {
                field: "rank",
                reason: format!("rank {rank} is not in a group of {world_size}"),
            });
        }
        require_nccl()?;
        let started = Instant::now();
        let id = match &settings.bootstrap {
            Bootstrap::Id(text) => parse_id(text)?,
            Bootstrap::File(path) => {
                let id = exchange_id(path, rank, started, settings.deadline)?;
                mark_arrival(path, rank)?;
                id
            }
        };
        let context = device.context().clone();
        let (sender, receiver) = mpsc::channel();
        // NCCL's join blocks until every rank has come; it runs on a thread of its own so that this one can stop
        // waiting at the deadline (the thread then stays blocked in NCCL until the process ends)
        std::thread::Builder::new()
            .name(format!("hicache-nccl-join-{rank}"))
            .spawn(move || {
                let joined = context.bind_to_thread().map_err(driver("bind the context")).and_then(|()| {
                    let mut raw: nccl_sys::ncclComm_t = std::ptr::null_mut();
                    // SAFETY: `raw` is a place for the new communicator; the id is the group's.
                    unsafe { nccl::comm_init_rank(&mut raw, world_size as i32, id, rank as i32) }
                        .map(|_| Communicator(raw))
                        .map_err(nccl_error("join the group"))
                });
                let _ = sender.send(joined);
            })
            .map_err(|error| Error::device("join the group", error.to_string()))?;
        let left = settings.deadline.saturating_sub(started.elapsed());
        let communicator = match receiver.recv_timeout(left) {
            Ok(joined) => joined?,
            Err(_) => {
                let missing = match &settings.bootstrap {
                    Bootstrap::File(path) => missing_ranks(path, world_size),
                    Bootstrap::Id(_) => "not every rank came".into(),
                };
                return Err(Error::Timeout {
                    backend: format!("NCCL group at rank {rank} of {world_size} ({missing})"),
                    operation: "join",
                    waited_ms: settings.deadline.as_millis() as u64,
                });
            }
        };
        let stream = device.context().new_stream().map_err(driver("create the collective's stream"))?;
        let done = device.context().new_event(None).map_err(driver("create the collective's event"))?;
        let buffer = DeviceBuffer::zeroed(device, 2 * HEADER * size_of::<i64>())?;
        Ok(Self {
            communicator: Some(communicator),
            stream,
            done,
            buffer,
            device: device.clone(),
            rank,
            world_size,
            deadline: settings.deadline,
            round: 0,
            broken: None,
        })
    }

    /// One collective: the header check, then (for an all-reduce) the values.
    fn collective(&mut self, values: &mut [i64], op: Option<ReduceOp>) -> Result<(), Error> {
        if let Some(reason) = &self.broken {
            return Err(Error::CollectiveMismatch {
                rank: self.rank,
                reason: format!("group broken earlier: {reason}"),
            });
        }
        self.round += 1;
        let code = match op {
            None => 0,
            Some(ReduceOp::Min) => 1,
            Some(ReduceOp::Max) => 2,
            Some(ReduceOp::Sum) => 3,
        };
        let header = [self.round, code, values.len() as i64];
        let mut both: Vec<i64> = header.iter().copied().chain(header.iter().map(|value| -value)).collect();
        self.reduce(&mut both, ReduceOp::Max, "check the collective")?;
        let (highest, lowest): (Vec<i64>, Vec<i64>) =
            (both[..HEADER].to_vec(), both[HEADER..].iter().map(|v| -v).collect());
        if highest != lowest {
            let reason = format!(
                "ranks entered different collectives in round {}: (round, operation, length) from {lowest:?} to \
                 {highest:?} (operation 0 barrier, 1 min, 2 max, 3 sum)",
                self.round
            );
            self.broken = Some(reason.clone());
            return Err(Error::CollectiveMismatch { rank: self.rank, reason });
        }
        match op {
            Some(op) if !values.is_empty() => self.reduce(values, op, "all_reduce"),
            _ => Ok(()),
        }
    }

    /// All-reduces `values` in place on the GPU, waiting at most the deadline.
    fn reduce(&mut self, values: &mut [i64], op: ReduceOp, operation: &'static str) -> Result<(), Error> {
        let bytes = size_of_val(values);
        if bytes > self.buffer.len() {
            self.buffer = DeviceBuffer::zeroed(&self.device, bytes.next_power_of_two())?;
        }
        let communicator = self.communicator.as_ref().ok_or_else(|| Error::Internal("no communicator".into()))?;
        self.buffer.write(0, as_bytes(values))?;
        let nccl_op = match op {
            ReduceOp::Min => nccl_sys::ncclRedOp_t::ncclMin,
            ReduceOp::Max => nccl_sys::ncclRedOp_t::ncclMax,
            ReduceOp::Sum => nccl_sys::ncclRedOp_t::ncclSum,
        };
        let address = self.buffer.pointer() as *mut std::ffi::c_void;
        // SAFETY: in place over `values.len()` i64 of the group's buffer, which outlives the call (the group waits
        // for it below, or aborts the communicator before the buffer can go); the stream is the group's.
        unsafe {
            nccl::all_reduce(
                address,
                address,
                values.len(),
                nccl_sys::ncclDataType_t::ncclInt64,
                nccl_op,
                communicator.0,
                self.stream.cu_stream() as nccl_sys::cudaStream_t,
            )
        }
        .map_err(nccl_error("all-reduce"))?;
        self.done.record(&self.stream).map_err(driver("record the collective's event"))?;
        let started = Instant::now();
        loop {
            match self.done.try_is_complete() {
                Ok(true) => break,
                Ok(false) => {}
                Err(error) => {
                    self.broken = Some(format!("the GPU failed the collective: {error:?}"));
                    self.communicator = None;
                    return Err(driver("wait for the collective")(error));
                }
            }
            if started.elapsed() > self.deadline {
                // abort: the collective stays stuck on the GPU until then
                self.communicator = None;
                self.broken = Some(format!("round {} did not complete within {:?}", self.round, self.deadline));
                return Err(Error::Timeout {
                    backend: format!(
                        "NCCL group at rank {} of {} (a rank did not enter round {})",
                        self.rank, self.world_size, self.round
                    ),
                    operation,
                    waited_ms: self.deadline.as_millis() as u64,
                });
            }
            if started.elapsed() < Duration::from_millis(1) {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        self.buffer.read(0, as_bytes_mut(values))
    }
}

impl Collective for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&mut self, values: &mut [i64], op: ReduceOp) -> Result<(), Error> {
        self.collective(values, Some(op))
    }

    fn barrier(&mut self) -> Result<(), Error> {
        self.collective(&mut [], None)
    }
}

fn require_nccl() -> Result<(), Error> {
    if nccl_present() {
        return Ok(());
    }
    Err(Error::device(
        "load NCCL",
        "libnccl.so cannot be loaded: install NCCL (the CUDA toolkit's, or a libnccl.so link to the \
                  nvidia-nccl wheel's libnccl.so.2) where the loader finds it",
    ))
}

fn as_bytes(values: &[i64]) -> &[u8] {
    // SAFETY: i64 has no padding and any byte pattern of it is valid; the length is the slice's size.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), size_of_val(values)) }
}

fn as_bytes_mut(values: &mut [i64]) -> &mut [u8] {
    // SAFETY: as `as_bytes`; every byte pattern written is a valid i64.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), size_of_val(values)) }
}

fn parse_id(text: &str) -> Result<nccl_sys::ncclUniqueId, Error> {
    let bad = |reason: String| Error::InvalidArgument { field: "bootstrap", reason };
    let text = text.trim();
    if text.len() != 256 || !text.bytes().all(|byte| byte.is_ascii_hexdigit()) {
        return Err(bad(format!("an NCCL unique id is 256 hex digits, found {} characters", text.len())));
    }
    let mut internal = [0 as std::ffi::c_char; 128];
    for (byte, pair) in internal.iter_mut().zip(text.as_bytes().chunks_exact(2)) {
        let pair = std::str::from_utf8(pair).map_err(|error| bad(error.to_string()))?;
        *byte = u8::from_str_radix(pair, 16).map_err(|error| bad(error.to_string()))? as std::ffi::c_char;
    }
    Ok(nccl_sys::ncclUniqueId { internal })
}

/// Rank 0 writes a new id to `path` (atomically); the others wait for it, at most `deadline` from `started`.
fn exchange_id(
    path: &Path,
    rank: usize,
    started: Instant,
    deadline: Duration,
) -> Result<nccl_sys::ncclUniqueId, Error> {
    let io = |what: &str, error: std::io::Error| {
        Error::device_caused("share the NCCL id", format!("{what} {}: {error}", path.display()), error)
    };
    if rank == 0 {
        let text = NcclGroup::unique_id()?;
        let temporary = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&temporary, &text).map_err(|error| io("writing", error))?;
        std::fs::rename(&temporary, path).map_err(|error| io("renaming into", error))?;
        return parse_id(&text);
    }
    loop {
        match std::fs::read_to_string(path) {
            Ok(text) => return parse_id(&text),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(io("reading", error)),
        }
        if started.elapsed() > deadline {
            return Err(Error::Timeout {
                backend: format!("NCCL group at rank {rank} (rank 0 did not write {})", path.display()),
                operation: "join",
                waited_ms: deadline.as_millis() as u64,
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The arrival mark of `rank` beside the id file.
fn arrival_path(path: &Path, rank: usize) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".rank-{rank}"));
    path.with_file_name(name)
}

fn mark_arrival(path: &Path, rank: usize) -> Result<(), Error> {
    let mark = arrival_path(path, rank);
    std::fs::write(&mark, b"").map_err(|error| {
        Error::device_caused("share the NCCL id", format!("writing {}: {error}", mark.display()), error)
    })
}

/// "ranks 1, 3 did not come", from the arrival marks.
fn missing_ranks(path: &Path, world_size: usize) -> String {
    let missing: Vec<String> =
        (0..world_size).filter(|&rank| !arrival_path(path, rank).exists()).map(|rank| rank.to_string()).collect();
    match missing.as_slice() {
        [] => "every rank arrived, but NCCL did not connect them".into(),
        [one] => format!("rank {one} did not come"),
        many => format!("ranks {} did not come", many.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_survive_text_and_bad_text_is_named() {
        let mut internal = [0 as std::ffi::c_char; 128];
        for (at, byte) in internal.iter_mut().enumerate() {
            *byte = (at * 7 % 256) as u8 as std::ffi::c_char;
        }
        let text: String = internal.iter().map(|&byte| format!("{:02x}", byte as u8)).collect();
        assert_eq!(parse_id(&text).unwrap().internal, internal);
        assert!(parse_id("abc").unwrap_err().to_string().starts_with("bootstrap: an NCCL unique id is 256 hex digits"));
        assert!(parse_id(&"zz".repeat(128)).is_err());
    }

    #[test]
    fn missing_ranks_come_from_the_arrival_marks() {
        let dir = std::env::temp_dir().join(format!("hicache-nccl-marks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let id = dir.join("id");
        mark_arrival(&id, 0).unwrap();
        mark_arrival(&id, 2).unwrap();
        assert_eq!(missing_ranks(&id, 4), "ranks 1, 3 did not come");
        assert_eq!(missing_ranks(&id, 2), "rank 1 did not come");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
