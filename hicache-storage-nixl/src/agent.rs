//! One NIXL agent with one file plugin: creation, plugin choice, and transfers between host memory and files.

use std::collections::BTreeMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hicache_core::Error;
use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, OptArgs, RegistrationHandle,
    ThreadSync, XferDescList, XferOp, XferStatus,
};

/// SGLang's `auto` order of file plugins (docs/sglang.md#nixl-backend); the OBJ plugin comes after them when a bucket
/// is set.
pub const AUTO_PLUGINS: [&str; 4] = ["3FS", "POSIX", "GDS_MT", "GDS"];

/// Which plugin moves the bytes.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum PluginChoice {
    /// The first of [`AUTO_PLUGINS`] that the library has and that starts, as SGLang's `auto`.
    #[default]
    Auto,
    /// This plugin, or an error.
    Named(String),
}

/// A memory range to register: host memory (`Dram`, device 0) or a file (`File`, device = its descriptor, address =
/// offset 0).
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) address: usize,
    pub(crate) len: usize,
    pub(crate) mem_type: MemType,
    pub(crate) device: u64,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.address as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        self.mem_type
    }

    fn device_id(&self) -> u64 {
        self.device
    }
}

/// One piece of a transfer: `len` bytes at `address` in host memory ↔ at `offset` in the file `fd`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece {
    pub(crate) address: usize,
    pub(crate) len: usize,
    pub(crate) fd: RawFd,
    pub(crate) offset: usize,
}

/// An agent and its plugin.
#[derive(Debug)]
pub(crate) struct NixlAgent {
    agent: Agent,
    backend: Backend,
    /// The agent's name: a transfer to files names the agent itself as the remote one.
    name: String,
    plugin: String,
}

static AGENT_COUNTER: AtomicU64 = AtomicU64::new(0);

impl NixlAgent {
    /// Creates an agent `hicache_nixl_{pid}_{n}` and starts the chosen plugin with its default parameters, overridden
    /// by `params`.
    pub(crate) fn new(choice: &PluginChoice, params: &BTreeMap<String, String>) -> Result<Self, Error> {
        let name = format!("hicache_nixl_{}_{}", std::process::id(), AGENT_COUNTER.fetch_add(1, Ordering::Relaxed));
        // Strict: NIXL serialises the agent's calls itself, so the backend's threads may call it at once. No progress
        // thread: the file plugins progress when their status is asked for.
        let config =
            AgentConfig { enable_prog_thread: false, thread_sync: ThreadSync::Strict, ..AgentConfig::default() };
        let agent = Agent::new_configured(&name, &config).map_err(|failure| nixl("creating agent", &name, &failure))?;
        let available: Vec<String> = agent
            .get_available_plugins()
            .map_err(|failure| nixl("listing plugins", &name, &failure))?
            .iter()
            .filter_map(|plugin| plugin.ok().map(str::to_owned))
            .collect();
        let candidates: Vec<&str> = match choice {
            PluginChoice::Auto => {
                let mut found: Vec<&str> =
                    AUTO_PLUGINS.iter().copied().filter(|plugin| available.iter().any(|name| name == plugin)).collect();
                if found.is_empty() && std::env::var_os("AWS_DEFAULT_BUCKET").is_some() {
                    found.push("OBJ");
                }
                found
            }
            PluginChoice::Named(plugin) => {
                if !available.iter().any(|name| name == plugin) {
                    return Err(Error::InvalidArgument {
                        field: "plugin",
                        reason: format!("NIXL has no plugin {plugin:?}; it has {}", available.join(", ")),
                    });
                }
                vec![plugin.as_str()]
            }
        };
        if candidates.is_empty() {
            return Err(storage(format!(
                "none of the file plugins {} is in this NIXL (it has {})",
                AUTO_PLUGINS.join(", "),
                available.join(", ")
            )));
        }
        let mut failures = Vec::new();
        for plugin in candidates {
            if !AUTO_PLUGINS.contains(&plugin) {
                // the object plugin keeps pages as objects in a bucket, network plugins move memory between agents:
                // other data paths than files
                return Err(Error::Unsupported {
                    backend: "nixl".into(),
                    operation: "pages through a plugin other than the file plugins 3FS, POSIX, GDS_MT and GDS (OBJ \
                                keeps objects in a bucket, UCX and the like move memory between agents)",
                });
            }
            match start_plugin(&agent, plugin, params) {
                Ok(backend) => return Ok(Self { agent, backend, name, plugin: plugin.to_owned() }),
                Err(Error::InvalidArgument { field, reason }) => return Err(Error::InvalidArgument { field, reason }),
                Err(failure) => failures.push(failure.to_string()),
            }
        }
        Err(storage(format!("no file plugin started: {}", failures.join("; "))))
    }

    /// The plugin in use.
    pub(crate) fn plugin(&self) -> &str {
        &self.plugin
    }

    /// Registers a range with the plugin; deregistered when the handle drops.
    pub(crate) fn register(&self, region: &Region) -> Result<RegistrationHandle, NixlError> {
        let options = self.options()?;
        self.agent.register_memory(region, Some(&options))
    }

    fn options(&self) -> Result<OptArgs, NixlError> {
        let mut options = OptArgs::new()?;
        options.add_backend(&self.backend)?;
        Ok(options)
    }

    /// Moves every piece as one transfer request (`Read`: file → memory, `Write`: memory → file) and waits for it.
    ///
    /// The caller has registered every memory range and file the pieces touch, and keeps them alive and registered
    /// until this returns.
    pub(crate) fn transfer(&self, operation: XferOp, pieces: &[Piece]) -> Result<(), String> {
        if pieces.is_empty() {
            return Ok(());
        }
        let describe = |step: &str, failure: NixlError| {
            format!(
                "{step} of a {} of {} pieces ({} bytes) by the {} plugin: {failure}",
                if operation == XferOp::Read { "read" } else { "write" },
                pieces.len(),
                pieces.iter().map(|piece| piece.len).sum::<usize>(),
                self.plugin
            )
        };
        let mut memory = XferDescList::new(MemType::Dram).map_err(|failure| describe("describing", failure))?;
        let mut files = XferDescList::new(MemType::File).map_err(|failure| describe("describing", failure))?;
        for piece in pieces {
            memory.add_desc(piece.address, piece.len, 0);
            files.add_desc(piece.offset, piece.len, piece.fd as u64);
        }
        let options = self.options().map_err(|failure| describe("preparing", failure))?;
        let request = self
            .agent
            .create_xfer_req(operation, &memory, &files, &self.name, Some(&options))
            .map_err(|failure| describe("creating the request", failure))?;
        let mut in_progress =
            self.agent.post_xfer_req(&request, Some(&options)).map_err(|failure| describe("posting", failure))?;
        let started = Instant::now();
        while in_progress {
            pause(started.elapsed());
            in_progress = self.agent.get_xfer_status(&request).map_err(|failure| describe("completing", failure))?
                == XferStatus::InProgress;
        }
        Ok(())
    }
}

/// How long to wait before asking again, `elapsed` into a transfer: yield for the first 20 µs (a page-cache copy
/// completes in a few), then sleep 1/16 of the time spent so far, between 2 µs and 1 ms. A wait thus overshoots the
/// completion by at most ~6% (SGLang sleeps 100 µs per poll whatever the size: +100% on a 100 µs transfer).
fn pause(elapsed: Duration) {
    if elapsed < Duration::from_micros(20) {
        std::thread::yield_now();
    } else {
        std::thread::sleep((elapsed / 16).clamp(Duration::from_micros(2), Duration::from_millis(1)));
    }
}

fn start_plugin(agent: &Agent, plugin: &str, params: &BTreeMap<String, String>) -> Result<Backend, Error> {
    let (_, mut defaults) =
        agent.get_plugin_params(plugin).map_err(|failure| nixl("reading parameters of", plugin, &failure))?;
    let known: Vec<String> = defaults
        .iter()
        .map_err(|failure| nixl("reading parameters of", plugin, &failure))?
        .filter_map(|entry| entry.ok().map(|(key, _)| key.to_owned()))
        .collect();
    for (key, value) in params {
        if !known.contains(key) {
            return Err(Error::InvalidArgument {
                field: "plugin_params",
                reason: format!("the {plugin} plugin has no parameter {key:?}; it has {}", known.join(", ")),
            });
        }
        defaults.set(key, value).map_err(|failure| nixl("setting a parameter of", plugin, &failure))?;
    }
    agent.create_backend(plugin, &defaults).map_err(|failure| nixl("starting the plugin", plugin, &failure))
}

fn nixl(step: &str, subject: &str, failure: &NixlError) -> Error {
    storage(format!("{step} {subject}: {failure} (NIXL logs the plugin's reason on stderr)"))
}

pub(crate) fn storage(message: String) -> Error {
    Error::storage("nixl", message)
}
