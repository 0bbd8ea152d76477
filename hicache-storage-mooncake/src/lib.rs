//! The Mooncake Store tier: pages as objects in a Mooncake cluster (docs/sglang.md#backends), moved straight from
//! and into the host pool.
//!
//! * **Objects.** One object per page part (`keys`): K and V for MHA, the latent for MLA, each the contiguous half
//!   (or the whole) of the flat page, so a page-first host pool is read and written in place. Under native keys a
//!   page also has a checksum object (8 bytes: XXH3-64 of the namespace digest, the key and the page), put after its
//!   parts in the same batch; a page is present only with it, and read only when its bytes match it
//!   ([`MooncakeConfig::verify_checksum`]). A hybrid model's sidecar pool ([`StorageNamespace::sidecar`]) keeps one
//!   object per entry (and its checksum) under the native key scheme, whose namespace digest covers the pool and its
//!   entry size. Under SGLang 0.5.23's keys an entry is the objects SGLang's own store cuts it into, one per buffer
//!   of its host pool ([`EntryObject`](hicache_core::namespace::EntryObject): a Mamba state's temporal and conv
//!   buffers, an MHA sliding window's K and V), each at its place in the flat entry; a pool opened without them is
//!   refused (naming `key_scheme`), as is any under 0.5.2's (naming `sglang_release`). (A `page_unified` page keeps
//!   K and V together inside each layer: its halves, still keyed `_k` and `_v`, are its first and second halves of
//!   head groups or layers.) Where a part
//!   is not one contiguous range of the caller's memory (a `layer_first` pool), it goes through a staging buffer,
//!   counted in `staging_bytes`.
//! * **Host memory.** The host pool is registered with Mooncake once
//!   ([`register_host_memory`](StorageBackend::register_host_memory)). Over TCP, memory that was not registered is
//!   moved in place too (the TCP transport reads and writes local memory by address); over RDMA it is staged through
//!   a buffer registered for the call.
//! * **Writes.** `batch_is_exist` first, then `batch_put_from` of the objects that are missing: an object already
//!   stored is never put again (keys name content). A page whose every object was present is `AlreadyPresent`.
//! * **Placement.** Puts ask for this client's own segment first ([`MooncakeConfig::prefer_local_segment`]), so a
//!   page this host wrote stays on the host both ways; the master places elsewhere when that segment is full.
//! * **Reads.** `batch_get_into`; per object the bytes read. A page is a hit when every object arrived whole (and
//!   its bytes match its checksum, else `Corrupt`); a miss when none was found (an object evicted after
//!   `batch_is_exist` is a miss, never wrong bytes); an object found and another not is a failed page (`Corrupt`:
//!   incomplete); fewer bytes than the object is `Corrupt` (short read); an object larger than the part is
//!   `SizeMismatch`.
//! * **Failures the store cannot vouch for.** Mooncake settles most failures before or after the transfer (no space,
//!   not found, the master did not answer, and a `TRANSFER_FAIL` that came back before Mooncake's 60 s transfer
//!   deadline: its transfers all ended, as when a peer died; `sys::TRANSFER_DEADLINE_SETTLES_BEFORE`). Any other
//!   failure of a read or write (a `TRANSFER_FAIL` at the deadline, with transfers still running; a code hicache
//!   does not know) may leave a transfer in flight that still touches the caller's memory. After one, the call
//!   closes its client, which stops the client's transfers, before it returns, so the host pool pages it was given
//!   are never written late; calls that used the same client return only once it is closed too ([`Replaceable`]).
//!   Closing unmounts the segment this client lends, and its objects go with it. A new client then connects on a
//!   thread of its own (retried every half second, registering the host memory); until it does, calls fail at once,
//!   saying why. A client whose close does not end within [`CLOSE_DEADLINE`] leaves the backend refusing every call
//!   for good: reopen it.
//! * **Removal.** `remove` deletes an object unless a reader holds its lease (Mooncake's 10 s read lease, `-706`),
//!   in which case it waits for the lease up to [`MooncakeConfig::lease_wait`]. `clear` removes exactly this
//!   namespace's objects by a regular expression over their keys, leases or not (an operator's wipe; a reader in
//!   flight at that moment may fail). SGLang's `clear` removed every object in the cluster. `list` is not offered:
//!   the C API cannot enumerate keys.
//! * **The master.** Opening (the master accepting a connection, then the client's setup) ends within
//!   [`MooncakeConfig::connect_timeout`] (Mooncake's own setup retries for minutes against a stopped master). A
//!   master that stops answering fails the calls in flight within Mooncake's own RPC deadline, and every later call
//!   at once (naming its address), until a probe finds it answering again; the client then reconnects. Dropping the
//!   backend waits for the segment's unmount up to the connect timeout.
//!
//! The library is Mooncake's C API, loaded at run time (the crate's `sys` module).

mod client;
mod config;
mod keys;
pub(crate) mod sys;
#[cfg(feature = "testing")]
pub mod testing;
mod tier;

use std::ffi::CString;
use std::ops::Range;
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use hicache_core::Error;
use hicache_core::hash::PageKey;
use hicache_core::host_memory::MemoryRegion;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::replaceable::{Generation, Replaceable, Retired};
use hicache_core::storage::{
    FailureKind, GetOutcome, PageFailure, PageSegments, PageSegmentsMut, SetOutcome, StatsRecorder, StorageBackend,
    StorageStats, check_batch, segments_len, size_mismatch,
};

use crate::client::{Client, PROBE_INTERVAL, Setup};
pub use crate::config::{DEFAULT_GLOBAL_SEGMENT_SIZE, DEFAULT_LOCAL_BUFFER_SIZE, MooncakeConfig};
use crate::keys::KeyRenderer;
pub use crate::keys::{KeyScheme, SglangRelease};
use crate::sys::code;
pub use crate::tier::MOONCAKE_TIER;

/// Bytes of a page's checksum object (native keys).
const CHECKSUM_BYTES: usize = 8;
/// Bytes of pages in one call from which their checksums are computed on several threads.
const PARALLEL_HASH_BYTES: usize = 2 << 20;
/// The most threads computing checksums for one call.
const MAX_HASH_THREADS: usize = 8;

/// How long a read waits for an object whose replica another writer is still putting.
const NOT_READY_WAIT: Duration = Duration::from_secs(2);

/// How long a call whose failure may have left transfers in flight waits for its client to close: the transfers end
/// within Mooncake's own 60 s deadline, the unmount within its RPC deadline.
pub const CLOSE_DEADLINE: Duration = Duration::from_secs(90);

/// A Mooncake Store backend for one namespace.
pub struct MooncakeStorage {
    /// The namespace it serves.
    namespace: StorageNamespace,
    link: Arc<Link>,
    keys: KeyRenderer,
    /// The namespace digest, bound into every page's checksum.
    digest: String,
    page_bytes: usize,
    stats: StatsRecorder,
}

/// The client, and what connecting a new one takes (shared with the thread that does).
struct Link {
    api: &'static sys::Api,
    config: MooncakeConfig,
    client: Replaceable<Client>,
    /// The host memory registered with the backend, registered with every client it has.
    regions: RwLock<Vec<MemoryRegion>>,
    /// Set (under the `regions` lock) when the backend is dropped: a client connected after that registers nothing
    /// and is not put in.
    closing: std::sync::atomic::AtomicBool,
}

impl Link {
    fn connect(api: &'static sys::Api, config: &MooncakeConfig) -> Result<Client, String> {
        Client::connect(
            api,
            &Setup {
                local_hostname: &config.local_hostname,
                metadata_server: &config.metadata_server,
                global_segment_size: config.global_segment_size,
                local_buffer_size: config.local_buffer_size,
                protocol: &config.protocol,
                device: &config.device,
                master: &config.master,
                connect_timeout: config.connect_timeout,
                // a client that lends nothing has no segment to prefer
                prefer_local_segment: config.prefer_local_segment && config.global_segment_size > 0,
            },
        )
    }

    /// Connects a new client on a thread of its own, again every [`PROBE_INTERVAL`] until one connects or the
    /// backend is gone; registers the host memory with it and puts it in.
    fn replace(link: Weak<Self>) {
        let spawned = std::thread::Builder::new().name("hicache-mooncake-reconnect".into()).spawn(move || {
            loop {
                let Some(link) = link.upgrade() else { return };
                match Self::connect(link.api, &link.config) {
                    Ok(client) => {
                        // held across the install: a region registered meanwhile waits, then finds the new client
                        let regions = link.regions.read().unwrap_or_else(|poisoned| poisoned.into_inner());
                        if link.closing.load(std::sync::atomic::Ordering::Acquire) {
                            return;
                        }
                        // SAFETY: a region stays mapped while it is in the list (`unregister_host_memory` takes it
                        // out and unregisters it from the client then in place; the backend's drop sets `closing`).
                        let registered = regions
                            .iter()
                            .try_for_each(|region| unsafe { client.register(region.address(), region.len()) });
                        match registered {
                            Ok(()) => {
                                link.client.install(client);
                                tracing::info!(master = %link.config.master, "a new Mooncake client connected");
                                return;
                            }
                            // a client without the host memory would fail every transfer into it: try another
                            Err(why) => tracing::warn!(%why, "registering host memory with a new Mooncake client"),
                        }
                    }
                    Err(why) => tracing::debug!(%why, "connecting a new Mooncake client"),
                }
                drop(link);
                std::thread::sleep(PROBE_INTERVAL);
            }
        });
        if let Err(why) = spawned {
            tracing::error!(%why, "cannot start the Mooncake reconnect thread: the backend stays without a client");
        }
    }
}

/// Where the bytes of one object are: in place in the caller's memory, or in the call's staging buffer.
#[derive(Clone, Copy)]
enum Place {
    /// The address of the part in the caller's segments.
    Direct(usize),
    /// The offset of the part in the staging buffer.
    Staged(usize),
}

impl MooncakeStorage {
    /// Connects to the master and mounts this client's segment.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] / [`Error::InvalidArgument`] naming the field; [`Error::Storage`] when the library
    /// cannot be loaded (naming `MOONCAKE_STORE_LIBRARY`) or the master does not answer (naming its address).
    pub fn open(config: MooncakeConfig, namespace: &StorageNamespace) -> Result<Self, Error> {
        let config = config.validated()?;
        let namespace = namespace.clone().validated()?;
        let keys = KeyRenderer::new(&config.scheme, &namespace)?;
        // a KV page, or a sidecar pool's entry
        let page_bytes = namespace.page_bytes();
        let api = sys::load(&sys::resolve_library(config.library.as_deref())).map_err(error)?;
        let client = Replaceable::new(Link::connect(api, &config).map_err(error)?);
        let link = Arc::new(Link {
            api,
            config,
            client,
            regions: RwLock::new(Vec::new()),
            closing: std::sync::atomic::AtomicBool::new(false),
        });
        Ok(Self {
            digest: namespace.digest(),
            namespace: namespace.clone(),
            link,
            keys,
            page_bytes,
            stats: StatsRecorder::default(),
        })
    }

    /// Runs `f` on the client in place (failing at once while there is none); its generation with the answer.
    fn call<R>(&self, f: impl FnOnce(&Client) -> Result<R, String>) -> Result<(Generation, R), Error> {
        match self.link.client.call(f) {
            Ok((generation, Ok(answer))) => Ok((generation, answer)),
            Ok((_, Err(why))) | Err(why) => Err(error(why)),
        }
    }

    /// [`call`](Self::call), on the client of `on` when given (a call whose staging buffer that client registered):
    /// a client connected since is not tried.
    fn call_for<R>(
        &self,
        on: Option<Generation>,
        f: impl FnOnce(&Client) -> Result<R, String>,
    ) -> Result<(Generation, R), Error> {
        let Some(generation) = on else { return self.call(f) };
        match self.link.client.call_on(generation, f) {
            Some(Ok(answer)) => Ok((generation, answer)),
            Some(Err(why)) => Err(error(why)),
            None => Err(error(format!(
                "the client that registered this call's staging buffer was replaced before the transfer (the master \
                 at {}); the call is not tried",
                self.master()
            ))),
        }
    }

    /// After `call` on the client of `generation` failed with `status`, which may leave its transfers in flight:
    /// closes that client (or waits for another call closing it) and starts a new one. The error to return, and
    /// whether the client is closed (else memory the call used may still be touched: keep it).
    fn unsettled(&self, generation: Generation, call: &str, status: i64) -> (Error, bool) {
        let why = format!(
            "a {call} at the master {} failed with {}, after which Mooncake may still move bytes of that call",
            self.master(),
            sys::code_name(status)
        );
        tracing::warn!("{why}: closing the client, which stops its transfers, and connecting a new one");
        let close = |client: Client| client.close(CLOSE_DEADLINE);
        match self.link.client.retire(generation, why.clone(), close, CLOSE_DEADLINE) {
            Ok(retired) => {
                if retired == Retired::ByThisCall {
                    Link::replace(Arc::downgrade(&self.link));
                }
                let closed = format!("{why}; the client is closed (its transfers stopped) and a new one connects");
                (error(closed), true)
            }
            Err(stuck) => {
                tracing::error!("{stuck}");
                (error(stuck), false)
            }
        }
    }

    fn master(&self) -> &str {
        &self.link.config.master
    }

    /// `batch_is_exist` of every object of `keys` (its parts, then its checksum's, per key, in order): 1 present,
    /// 0 absent, negative a failure code.
    fn object_states(&self, keys: &[PageKey]) -> Result<Vec<i64>, Error> {
        Ok(self.call(|client| client.batch_is_exist(&self.c_keys(keys)))?.1)
    }

    /// The error of a `batch_is_exist` that answered `status` for an object.
    fn exist_failure(&self, status: i64) -> Error {
        error(format!("batch_is_exist at the master {} failed: {}", self.master(), sys::code_name(status)))
    }

    /// Why calls fail at once now (no client: a new one is connecting, or the backend must be reopened).
    pub fn down(&self) -> Option<String> {
        self.link.client.down()
    }

    /// The segment puts ask the master for first: this client's own (its name as the master knows it), when
    /// [`MooncakeConfig::prefer_local_segment`] is set and the library names it.
    pub fn preferred_segment(&self) -> Option<String> {
        let preferred = self.link.client.call(|client| client.preferred_segment().map(std::ffi::CStr::to_owned));
        preferred.ok()?.1.map(|name| name.to_string_lossy().into_owned())
    }

    /// The settings it was opened with.
    pub fn config(&self) -> &MooncakeConfig {
        &self.link.config
    }

    /// Host memory regions registered now (told with `register_host_memory`).
    pub fn registered_regions(&self) -> usize {
        self.link.regions.read().unwrap_or_else(|poisoned| poisoned.into_inner()).len()
    }

    /// Whether the client and its master are well.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] naming the master and Mooncake's code.
    pub fn health_check(&self) -> Result<(), Error> {
        self.call(Client::health_check).map(|_| ())
    }

    /// The object keys of a page, as stored in Mooncake: its parts, then (native keys) its checksum's.
    pub fn object_keys(&self, key: &PageKey) -> Vec<String> {
        (0..self.keys.objects()).map(|object| self.keys.object_key(key, object)).collect()
    }

    /// The checksums of `pages` (each a key and its segments): [`checksums`] in this namespace.
    fn checksums<S: AsRef<[u8]> + Sync>(&self, pages: &[(&PageKey, &[S])]) -> Vec<u64> {
        checksums(&self.digest, pages, pages.len() * self.page_bytes)
    }

    /// The bytes of object `object` of a page: a part's, or the checksum's.
    fn object_bytes(&self, object: usize) -> usize {
        if object < self.keys.parts() { self.keys.part(object).len() } else { CHECKSUM_BYTES }
    }

    fn c_keys(&self, keys: &[PageKey]) -> Vec<CString> {
        keys.iter()
            .flat_map(|key| (0..self.keys.objects()).map(move |part| (key, part)))
            .map(|(key, part)| {
                CString::new(self.keys.object_key(key, part)).expect("keys are hex digits and the prefix")
            })
            .collect()
    }

    /// Where object `part` of a page given as segments (lengths `lens`, starting at `starts`) lies: in place when
    /// the part is inside one segment and the transport may use that memory, else staged.
    fn place(&self, starts: &[usize], lens: &[usize], part: usize, staged: &mut usize) -> Place {
        let range = self.keys.part(part);
        if let [(index, within, _)] = range_pieces(lens, range.start, range.len()).as_slice()
            && self.may_use(starts[*index] + within.start, range.len())
        {
            return Place::Direct(starts[*index] + within.start);
        }
        let at = *staged;
        *staged += range.len();
        Place::Staged(at)
    }

    fn may_use(&self, address: usize, len: usize) -> bool {
        self.link.config.protocol == "tcp"
            || self
                .link
                .regions
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .iter()
                .any(|region| region.contains(address, len))
    }

    /// Reads object `i` into `sizes[i]` bytes at `addresses[i]`; per object the bytes read or an error code. A key
    /// named twice is read once per call (Mooncake serves one destination per key in a batch), so repeats go in
    /// later rounds; an object whose replica is still being written (another writer's put in flight) is read again
    /// for up to [`NOT_READY_WAIT`].
    ///
    /// # Safety
    ///
    /// Each `[addresses[i], addresses[i] + sizes[i])` is writable, and neither read nor written by anyone else
    /// until the call returns. After a failure that may leave a transfer in flight, `Err` says whether the client
    /// was closed: if not, the memory must be given up. `on`: the client the call must run on (the one that
    /// registered its staging buffer), if any.
    unsafe fn read_objects(
        &self,
        keys: &[CString],
        addresses: &[usize],
        sizes: &[usize],
        on: Option<Generation>,
    ) -> Result<Vec<i64>, (Error, bool)> {
        let mut results = vec![code::OBJECT_NOT_FOUND; keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        let deadline = Instant::now() + NOT_READY_WAIT;
        while !pending.is_empty() {
            let mut seen = std::collections::HashSet::new();
            let (round, later): (Vec<usize>, Vec<usize>) =
                pending.iter().partition(|&&object| seen.insert(&keys[object]));
            let round_keys: Vec<CString> = round.iter().map(|&object| keys[object].clone()).collect();
            let round_addresses: Vec<usize> = round.iter().map(|&object| addresses[object]).collect();
            let round_sizes: Vec<usize> = round.iter().map(|&object| sizes[object]).collect();
            let started = Instant::now();
            // SAFETY: the caller vouches for every address and length.
            let (generation, answers) = self
                .call_for(on, |client| unsafe { client.batch_get_into(&round_keys, &round_addresses, &round_sizes) })
                .map_err(|failure| (failure, true))?;
            let took = started.elapsed();
            if let Some(&status) = answers.iter().find(|&&status| status < 0 && !sys::is_settled_failure(status, took))
            {
                return Err(self.unsettled(generation, "batch_get_into", status));
            }
            pending = later;
            let mut not_ready = false;
            for (&object, &status) in round.iter().zip(&answers) {
                results[object] = status;
                if status == code::REPLICA_IS_NOT_READY && Instant::now() < deadline {
                    pending.push(object);
                    not_ready = true;
                }
            }
            if not_ready {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Ok(results)
    }
}

#[cfg(feature = "testing")]
impl MooncakeStorage {
    /// Puts `bytes` under the object key `object` in place of what is stored there, or (`None`) only removes it:
    /// how a test damages or drops one object of a page as a faulty writer, store or network would.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the store refuses the removal or the put.
    pub fn replace_object(&self, object: &str, bytes: Option<&[u8]>) -> Result<(), Error> {
        let key = CString::new(object).map_err(|why| error(format!("object key {object:?}: {why}")))?;
        let (_, removed) = self.call(|client| client.remove(&key))?;
        if removed != 0 && removed != code::OBJECT_NOT_FOUND {
            return Err(error(format!("removing {object}: {}", sys::code_name(removed))));
        }
        let Some(bytes) = bytes else { return Ok(()) };
        let mut staging = Staging::new(bytes.len(), self)?;
        staging.bytes.copy_from_slice(bytes);
        let address = staging.address(0);
        // SAFETY: the staging buffer (registered for the call where the transport needs it) outlives the call.
        let (_, results) = self.call_for(staging.generation(), |client| unsafe {
            client.batch_put_from(std::slice::from_ref(&key), &[address], &[bytes.len()], 1)
        })?;
        match results.as_slice() {
            [0] => Ok(()),
            [status] => Err(error(format!("putting {object}: {}", sys::code_name(*status)))),
            _ => Err(error(format!("putting {object}: no answer"))),
        }
    }
}

impl Drop for MooncakeStorage {
    fn drop(&mut self) {
        // a client still connecting registers nothing of memory its owner may free after this
        let _regions = self.link.regions.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        self.link.closing.store(true, std::sync::atomic::Ordering::Release);
    }
}

/// A staging buffer for the objects of one call that cannot move in place; registered for the call (with the
/// client in place) when the transport needs it.
struct Staging<'a> {
    bytes: Vec<u8>,
    registered: Option<(&'a Link, Generation)>,
}

impl<'a> Staging<'a> {
    fn new(len: usize, storage: &'a MooncakeStorage) -> Result<Self, Error> {
        let bytes = vec![0u8; len];
        let registered = if len > 0 && storage.link.config.protocol != "tcp" {
            // SAFETY: the buffer is owned by this value and stays allocated until `Drop` unregisters it (or is
            // leaked, with its registration, when a transfer may still use it).
            let (generation, ()) = storage.call(|client| unsafe { client.register(bytes.as_ptr() as usize, len) })?;
            Some((&*storage.link, generation))
        } else {
            None
        };
        Ok(Self { bytes, registered })
    }

    fn address(&self, offset: usize) -> usize {
        self.bytes.as_ptr() as usize + offset
    }

    /// The client the buffer is registered with, which the call's transfer must use.
    fn generation(&self) -> Option<Generation> {
        self.registered.map(|(_, generation)| generation)
    }

    /// Keeps the buffer (and its registration) for the rest of the process: a transfer may still use it.
    fn abandon(self) {
        std::mem::forget(self);
    }
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        // a client closed since knows nothing of the buffer any more
        if let Some((link, generation)) = self.registered {
            link.client.call_on(generation, |client| client.unregister(self.bytes.as_ptr() as usize));
        }
    }
}

/// The pieces of `len` bytes from `offset` of the concatenation of segments of lengths `lens`: per piece, the
/// segment, the range in it and the range in the `len` bytes.
fn range_pieces(lens: &[usize], mut offset: usize, len: usize) -> Vec<(usize, Range<usize>, Range<usize>)> {
    let mut pieces = Vec::new();
    let mut done = 0;
    for (index, &segment_len) in lens.iter().enumerate() {
        if done == len {
            break;
        }
        if offset >= segment_len {
            offset -= segment_len;
            continue;
        }
        let take = (segment_len - offset).min(len - done);
        pieces.push((index, offset..offset + take, done..done + take));
        done += take;
        offset = 0;
    }
    pieces
}

/// Copies `out.len()` bytes from the concatenation of `segments`, starting at `offset`, into `out`.
fn gather_range(segments: &[&[u8]], offset: usize, out: &mut [u8]) {
    let lens: Vec<usize> = segments.iter().map(|segment| segment.len()).collect();
    for (index, from, to) in range_pieces(&lens, offset, out.len()) {
        out[to].copy_from_slice(&segments[index][from]);
    }
}

/// Copies `bytes` into the concatenation of `segments`, starting at `offset`.
fn scatter_range(bytes: &[u8], segments: &mut [&mut [u8]], offset: usize) {
    let lens: Vec<usize> = segments.iter().map(|segment| segment.len()).collect();
    for (index, to, from) in range_pieces(&lens, offset, bytes.len()) {
        segments[index][to].copy_from_slice(&bytes[from]);
    }
}

fn error(message: String) -> Error {
    Error::storage("mooncake", message)
}

/// A page's checksum (native keys): XXH3-64 of the namespace digest, the key and the page's bytes, so bytes of
/// another page or namespace, or bytes damaged or replaced in the store, never pass as this page.
fn checksum<S: AsRef<[u8]>>(digest: &str, key: &PageKey, segments: &[S]) -> u64 {
    use std::hash::Hasher as _;
    let mut hasher = twox_hash::XxHash3_64::with_seed(0);
    hasher.write(digest.as_bytes());
    hasher.write(key.as_bytes());
    for segment in segments {
        hasher.write(segment.as_ref());
    }
    hasher.finish()
}

/// The checksums of `pages` (each a key and its segments, `bytes` in all), on several threads when they are long
/// enough to gain from it.
fn checksums<S: AsRef<[u8]> + Sync>(digest: &str, pages: &[(&PageKey, &[S])], bytes: usize) -> Vec<u64> {
    let threads = std::thread::available_parallelism().map_or(1, usize::from).min(MAX_HASH_THREADS);
    let one = |(key, segments): &(&PageKey, &[S])| checksum(digest, key, segments);
    if bytes < PARALLEL_HASH_BYTES || threads < 2 || pages.len() < 2 {
        return pages.iter().map(one).collect();
    }
    let chunk = pages.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> =
            pages.chunks(chunk).map(|part| scope.spawn(move || part.iter().map(one).collect::<Vec<u64>>())).collect();
        handles
            .into_iter()
            .flat_map(|handle| handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .collect()
    })
}

/// The failure of one object with a settled error code.
fn object_failure(status: i64, master: &str, page_bytes: usize) -> PageFailure {
    match status {
        code::RPC_FAIL | code::RPC_TIMEOUT => PageFailure::new(
            FailureKind::Io,
            format!("the master at {master} did not answer: {}", sys::code_name(status)),
        ),
        code::NO_AVAILABLE_HANDLE | code::TENANT_QUOTA_EXCEEDED => {
            PageFailure::new(FailureKind::Rejected, format!("refused by the store: {}", sys::code_name(status)))
        }
        code::INVALID_PARAMS => PageFailure::new(
            FailureKind::SizeMismatch,
            format!("a stored object is larger than its part of this namespace's {page_bytes}-byte pages"),
        ),
        _ => PageFailure::new(FailureKind::Io, sys::code_name(status)),
    }
}

impl StorageBackend for MooncakeStorage {
    fn name(&self) -> &str {
        "mooncake"
    }

    fn namespace(&self) -> Option<&StorageNamespace> {
        Some(&self.namespace)
    }

    fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error> {
        if keys.is_empty() {
            return Ok(0);
        }
        let results = self.object_states(keys)?;
        let mut found = 0;
        for page in results.chunks(self.keys.objects()) {
            if let Some(&status) = page.iter().find(|&&status| status < 0)
                && found == 0
            {
                return Err(self.exist_failure(status));
            }
            if !page.iter().all(|&status| status == 1) {
                break;
            }
            found += 1;
        }
        self.stats.record_exists(keys.len(), found);
        Ok(found)
    }

    fn batch_contains(&self, keys: &[PageKey]) -> Result<Vec<bool>, Error> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let results = self.object_states(keys)?;
        if let Some(&status) = results.iter().find(|&&status| status < 0) {
            return Err(self.exist_failure(status));
        }
        // a page is there when every object of it is
        let held: Vec<bool> =
            results.chunks(self.keys.objects()).map(|page| page.iter().all(|&status| status == 1)).collect();
        self.stats.record_exists(keys.len(), held.iter().filter(|&&held| held).count());
        Ok(held)
    }

    fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error> {
        check_batch(keys.len(), pages.len())?;
        let (parts, objects) = (self.keys.parts(), self.keys.objects());
        let mut outcomes: Vec<Option<GetOutcome>> = vec![None; keys.len()];
        let (mut object_keys, mut places, mut owners) = (Vec::new(), Vec::new(), Vec::new());
        let mut staged = 0;
        let all_keys = self.c_keys(keys);
        for (index, segments) in pages.iter().enumerate() {
            let len = segments_len(segments);
            if len != self.page_bytes {
                outcomes[index] = Some(GetOutcome::Failed(size_mismatch(len, self.page_bytes)));
                continue;
            }
            let starts: Vec<usize> = segments.iter().map(|segment| segment.as_ptr() as usize).collect();
            let lens: Vec<usize> = segments.iter().map(|segment| segment.len()).collect();
            for object in 0..objects {
                object_keys.push(all_keys[index * objects + object].clone());
                places.push(if object < parts {
                    self.place(&starts, &lens, object, &mut staged)
                } else {
                    // the checksum lands in the staging buffer
                    staged += CHECKSUM_BYTES;
                    Place::Staged(staged - CHECKSUM_BYTES)
                });
                owners.push((index, object));
            }
        }
        let staging = Staging::new(staged, self)?;
        let addresses: Vec<usize> = places
            .iter()
            .map(|place| match *place {
                Place::Direct(address) => address,
                Place::Staged(offset) => staging.address(offset),
            })
            .collect();
        let sizes: Vec<usize> = owners.iter().map(|&(_, object)| self.object_bytes(object)).collect();
        // SAFETY: every address is either inside one segment of `pages` (`place` found the whole part in it), which
        // this call borrows mutably, or inside `staging`, which outlives the call; each range is its object's size
        // and no two overlap (distinct parts of distinct pages, each page's segments distinct by the borrow).
        let results = match unsafe { self.read_objects(&object_keys, &addresses, &sizes, staging.generation()) } {
            Ok(results) => results,
            Err((failure, closed)) => {
                if !closed {
                    // a transfer may still write the staging buffer
                    staging.abandon();
                }
                return Err(failure);
            }
        };
        let mut by_page: Vec<Vec<(usize, i64, Place)>> = vec![Vec::new(); keys.len()];
        for ((&(index, part), &status), &place) in owners.iter().zip(&results).zip(&places) {
            by_page[index].push((part, status, place));
        }
        let master = self.master();
        let mut to_verify: Vec<(usize, u64)> = Vec::new();
        for (index, page) in by_page.into_iter().enumerate() {
            if outcomes[index].is_some() {
                continue;
            }
            let whole = |object: usize| self.object_bytes(object) as i64;
            let outcome = if page.iter().all(|&(object, status, _)| status == whole(object)) {
                let mut stored = None;
                for &(object, _, place) in &page {
                    let Place::Staged(offset) = place else { continue };
                    let bytes = &staging.bytes[offset..offset + self.object_bytes(object)];
                    if object == parts {
                        stored = Some(u64::from_le_bytes(bytes.try_into().expect("a checksum's bytes")));
                        continue;
                    }
                    scatter_range(bytes, &mut pages[index], self.keys.part(object).start);
                    self.stats.record_staging(bytes.len());
                }
                if let Some(stored) = stored.filter(|_| self.link.config.verify_checksum) {
                    // checked below, all pages at once
                    to_verify.push((index, stored));
                }
                GetOutcome::Hit
            } else if page.iter().all(|&(_, status, _)| status == code::OBJECT_NOT_FOUND) {
                GetOutcome::Miss
            } else if let Some(&(_, status, _)) =
                page.iter().find(|&&(_, status, _)| status < 0 && status != code::OBJECT_NOT_FOUND)
            {
                GetOutcome::Failed(object_failure(status, master, self.page_bytes))
            } else if let Some(&(object, status, _)) =
                page.iter().find(|&&(object, status, _)| (0..whole(object)).contains(&status))
            {
                let what = if object == parts { "the checksum".to_owned() } else { format!("part {object}") };
                GetOutcome::Failed(PageFailure::new(
                    FailureKind::Corrupt,
                    format!("short read of {what}: {status} of {} bytes", whole(object)),
                ))
            } else {
                let missing: Vec<String> = page
                    .iter()
                    .filter(|&&(_, status, _)| status == code::OBJECT_NOT_FOUND)
                    .map(|&(object, _, _)| if object == parts { "checksum".to_owned() } else { object.to_string() })
                    .collect();
                GetOutcome::Failed(PageFailure::new(
                    FailureKind::Corrupt,
                    format!(
                        "incomplete page: object(s) {} of its {parts} part(s){} are gone (evicted or removed)",
                        missing.join(", "),
                        if page.len() > parts { " and checksum" } else { "" }
                    ),
                ))
            };
            outcomes[index] = Some(outcome);
        }
        let work: Vec<(&PageKey, &[&mut [u8]])> =
            to_verify.iter().map(|&(index, _)| (&keys[index], pages[index].as_slice())).collect();
        for (&(index, stored), computed) in to_verify.iter().zip(self.checksums(&work)) {
            if stored != computed {
                outcomes[index] = Some(GetOutcome::Failed(PageFailure::new(
                    FailureKind::Corrupt,
                    format!(
                        "page {}: its bytes do not match its checksum (damaged, or replaced under its key)",
                        keys[index]
                    ),
                )));
            }
        }
        let outcomes: Vec<GetOutcome> =
            outcomes.into_iter().map(|outcome| outcome.unwrap_or(GetOutcome::Miss)).collect();
        self.stats.record_get(&outcomes, |_| self.page_bytes);
        Ok(outcomes)
    }

    fn batch_set(&self, keys: &[PageKey], pages: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error> {
        check_batch(keys.len(), pages.len())?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (parts, objects) = (self.keys.parts(), self.keys.objects());
        let all_keys = self.c_keys(keys);
        let (generation, present) = self.call(|client| client.batch_is_exist(&all_keys))?;
        let mut outcomes: Vec<Option<SetOutcome>> = vec![None; keys.len()];
        // per object: Ok(true) stored now, Ok(false) present before, Err(status) failed
        let mut object_results: Vec<Result<bool, i64>> = vec![Ok(false); all_keys.len()];
        let (mut put_keys, mut put_places, mut put_objects) = (Vec::new(), Vec::new(), Vec::new());
        let mut first_put: std::collections::HashMap<&CString, usize> = std::collections::HashMap::new();
        let mut duplicates = Vec::new();
        let mut staged = 0;
        for (index, segments) in pages.iter().enumerate() {
            let len = segments_len(segments);
            if len != self.page_bytes {
                outcomes[index] = Some(SetOutcome::Failed(size_mismatch(len, self.page_bytes)));
                continue;
            }
            let starts: Vec<usize> = segments.iter().map(|segment| segment.as_ptr() as usize).collect();
            let lens: Vec<usize> = segments.iter().map(|segment| segment.len()).collect();
            // the checksum object goes last: a reader that finds it finds the parts put before it in the batch
            for part in 0..objects {
                let object = index * objects + part;
                if present[object] == 1 {
                    continue;
                }
                if let Some(&first) = first_put.get(&all_keys[object]) {
                    // the same key twice in one batch: put once, both share the outcome
                    duplicates.push((object, first));
                    continue;
                }
                first_put.insert(&all_keys[object], object);
                put_keys.push(all_keys[object].clone());
                let place = if part < parts {
                    self.place(&starts, &lens, part, &mut staged)
                } else {
                    staged += CHECKSUM_BYTES;
                    Place::Staged(staged - CHECKSUM_BYTES)
                };
                put_places.push((place, index, part));
                put_objects.push(object);
            }
        }
        let mut staging = Staging::new(staged, self)?;
        // the checksums to put, all pages at once
        let summed: Vec<usize> =
            put_places.iter().filter(|&&(_, _, part)| part == parts).map(|&(_, index, _)| index).collect();
        let work: Vec<(&PageKey, &[&[u8]])> =
            summed.iter().map(|&index| (&keys[index], pages[index].as_slice())).collect();
        let mut sums = self.checksums(&work).into_iter();
        let mut addresses = Vec::with_capacity(put_places.len());
        for &(place, index, part) in &put_places {
            addresses.push(match place {
                Place::Direct(address) => address,
                Place::Staged(offset) if part == parts => {
                    let checksum = sums.next().expect("a checksum per checksum object").to_le_bytes();
                    staging.bytes[offset..offset + CHECKSUM_BYTES].copy_from_slice(&checksum);
                    staging.address(offset)
                }
                Place::Staged(offset) => {
                    let range = self.keys.part(part);
                    let out = &mut staging.bytes[offset..offset + range.len()];
                    gather_range(&pages[index], range.start, out);
                    self.stats.record_staging(range.len());
                    staging.address(offset)
                }
            });
        }
        let sizes: Vec<usize> = put_places.iter().map(|&(_, _, part)| self.object_bytes(part)).collect();
        let replicas = self.link.config.replicas;
        let started = Instant::now();
        let (generation, results) = if put_keys.is_empty() {
            (generation, Vec::new())
        } else {
            // SAFETY: every address is inside one segment of `pages` (borrowed for this call, so nobody writes
            // them) or inside `staging`, which outlives the call; each range is its object's size. After an
            // unsettled failure the client is closed before the call returns, or the staging buffer leaked.
            self.call_for(staging.generation(), |client| unsafe {
                client.batch_put_from(&put_keys, &addresses, &sizes, replicas)
            })?
        };
        let took = started.elapsed();
        if let Some(&status) = results.iter().find(|&&status| status < 0 && !sys::is_settled_failure(status, took)) {
            let (failure, closed) = self.unsettled(generation, "batch_put_from", status);
            if !closed {
                staging.abandon();
            }
            return Err(failure);
        }
        for (&object, &status) in put_objects.iter().zip(&results) {
            object_results[object] = match status {
                0 => Ok(true),
                code::OBJECT_ALREADY_EXISTS => Ok(false),
                failed => Err(failed),
            };
        }
        for (object, first) in duplicates {
            object_results[object] = object_results[first].map(|_| false);
        }
        let master = self.master();
        for (index, outcome) in outcomes.iter_mut().enumerate() {
            if outcome.is_some() {
                continue;
            }
            let page = &object_results[index * objects..(index + 1) * objects];
            *outcome = Some(if let Some(&Err(status)) = page.iter().find(|result| result.is_err()) {
                SetOutcome::Failed(object_failure(status, master, self.page_bytes))
            } else if page.contains(&Ok(true)) {
                SetOutcome::Stored
            } else {
                SetOutcome::AlreadyPresent
            });
        }
        let outcomes: Vec<SetOutcome> =
            outcomes.into_iter().map(|outcome| outcome.expect("every page decided")).collect();
        self.stats.record_set(&outcomes, |_| self.page_bytes);
        Ok(outcomes)
    }

    fn remove(&self, keys: &[PageKey]) -> Result<usize, Error> {
        let object_keys = self.c_keys(keys);
        let mut removed_pages = 0;
        for page in object_keys.chunks(self.keys.objects()) {
            let mut any = false;
            for key in page {
                let deadline = Instant::now() + self.link.config.lease_wait;
                loop {
                    match self.call(|client| client.remove(key))?.1 {
                        0 => any = true,
                        code::OBJECT_NOT_FOUND => {}
                        code::OBJECT_HAS_LEASE if Instant::now() < deadline => {
                            std::thread::sleep(std::time::Duration::from_millis(50));
                            continue;
                        }
                        status => {
                            return Err(error(format!(
                                "removing {} at the master {}: {}{}",
                                key.to_string_lossy(),
                                self.master(),
                                sys::code_name(status),
                                if status == code::OBJECT_HAS_LEASE {
                                    format!(
                                        " (still read after {} ms; lease_wait)",
                                        self.link.config.lease_wait.as_millis()
                                    )
                                } else {
                                    String::new()
                                }
                            )));
                        }
                    }
                    break;
                }
            }
            removed_pages += usize::from(any);
        }
        self.stats.record_removed(removed_pages as u64);
        Ok(removed_pages)
    }

    fn clear(&self) -> Result<u64, Error> {
        let (_, objects) = self.call(|client| client.remove_by_regex(self.keys.pattern(), true))?;
        let pages = objects.div_ceil(self.keys.objects() as u64);
        self.stats.record_removed(pages);
        Ok(pages)
    }

    fn stats(&self) -> StorageStats {
        self.stats.snapshot()
    }

    fn register_host_memory(&self, region: &MemoryRegion) -> Result<(), Error> {
        let mut regions = self.link.regions.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        // SAFETY: the caller keeps the region mapped until `unregister_host_memory` with the same region (the
        // trait's contract), which unregisters it here; a client that connects later registers it from the list.
        match self.link.client.call(|client| unsafe { client.register(region.address(), region.len()) }) {
            Ok((_, Err(why))) => return Err(error(why)),
            Ok((_, Ok(()))) | Err(_) => {}
        }
        regions.push(region.clone());
        Ok(())
    }

    fn unregister_host_memory(&self, region: &MemoryRegion) {
        let mut regions = self.link.regions.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(at) = regions.iter().position(|known| known == region) {
            regions.remove(at);
            let _ = self.link.client.call(|client| client.unregister(region.address()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On several threads or one, each page's checksum is its own, in order, and binds the digest and the key.
    #[test]
    fn checksums_on_threads_are_each_pages_own() {
        let keys: Vec<PageKey> = (0..37u8).map(|seed| PageKey::from_bytes([seed; 32])).collect();
        let data: Vec<Vec<u8>> = (0..37).map(|_| (0..128 << 10).map(|_| rand::random::<u8>()).collect()).collect();
        // each page in two segments
        let pages: Vec<(&PageKey, Vec<&[u8]>)> =
            keys.iter().zip(&data).map(|(key, bytes)| (key, vec![&bytes[..1000], &bytes[1000..]])).collect();
        let work: Vec<(&PageKey, &[&[u8]])> = pages.iter().map(|(key, segments)| (*key, segments.as_slice())).collect();
        let bytes = 37 * (128 << 10);
        assert!(bytes >= PARALLEL_HASH_BYTES);
        let expected: Vec<u64> = keys.iter().zip(&data).map(|(key, page)| checksum("d", key, &[page])).collect();
        assert_eq!(checksums("d", &work, bytes), expected);
        assert_eq!(checksums("d", &work, 0), expected, "on one thread");
        assert_ne!(checksum("e", &keys[0], &[&data[0]]), expected[0], "another namespace");
        assert_ne!(checksum("d", &keys[1], &[&data[0]]), expected[0], "another key");
    }

    #[test]
    fn gather_and_scatter_agree_with_the_flat_page_for_any_cuts() {
        for _ in 0..200 {
            let total = 1 + rand::random::<u32>() as usize % 300;
            let mut cuts: Vec<usize> =
                (0..rand::random::<u32>() % 6).map(|_| rand::random::<u32>() as usize % total).collect();
            cuts.extend([0, total]);
            cuts.sort_unstable();
            let flat: Vec<u8> = (0..total).map(|_| rand::random()).collect();
            let segments: Vec<&[u8]> = cuts.windows(2).map(|pair| &flat[pair[0]..pair[1]]).collect();
            let offset = rand::random::<u32>() as usize % total;
            let len = rand::random::<u32>() as usize % (total - offset + 1);
            let mut out = vec![0u8; len];
            gather_range(&segments, offset, &mut out);
            assert_eq!(out, flat[offset..offset + len], "cuts {cuts:?}, offset {offset}, len {len}");
            let mut copy = vec![0u8; total];
            let mut targets: Vec<&mut [u8]> = Vec::new();
            let mut rest: &mut [u8] = &mut copy;
            for pair in cuts.windows(2) {
                let (head, tail) = rest.split_at_mut(pair[1] - pair[0]);
                targets.push(head);
                rest = tail;
            }
            scatter_range(&out, &mut targets, offset);
            let mut expected = vec![0u8; total];
            expected[offset..offset + len].copy_from_slice(&flat[offset..offset + len]);
            assert_eq!(copy, expected, "cuts {cuts:?}, offset {offset}, len {len}");
        }
    }
}
