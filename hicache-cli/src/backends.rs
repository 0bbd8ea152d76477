//! Opening a storage backend by name: the ones compiled in, and a clear answer for the others.

use std::path::PathBuf;

use clap::ValueEnum;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{MemoryStorage, StorageBackend};

use crate::exit::Usage;

/// Storage backends by name (`--backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendName {
    /// In-process memory.
    Memory,
    /// Local files (cargo feature `file`, on by default).
    File,
    /// NIXL (cargo feature `nixl`).
    Nixl,
    /// Mooncake Store (cargo feature `mooncake`).
    Mooncake,
    /// DeepSeek 3FS (cargo feature `3fs`).
    #[value(name = "3fs", alias = "hf3fs")]
    ThreeFs,
}

/// Layout of the file backend (`--format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum FileFormatArg {
    /// hicache's namespaced, checksummed pages.
    Native,
    /// SGLang 0.5.2's HiCacheFile names and raw bytes.
    Sglang,
}

/// Where and how a backend keeps its pages.
#[derive(Clone, Debug)]
pub(crate) struct BackendOptions {
    /// Directory of file-like backends; else the backend's environment variable, else its default.
    pub(crate) dir: Option<PathBuf>,
    /// File layout.
    pub(crate) format: FileFormatArg,
    /// Read and write the file backend's page files with O_DIRECT when the host memory is aligned.
    #[cfg_attr(not(feature = "file"), expect(dead_code, reason = "read only by the file backend"))]
    pub(crate) direct_io: bool,
    /// Threads per batch of file-like backends (default: two per core, between 2 and 16).
    #[cfg_attr(not(feature = "file"), expect(dead_code, reason = "read only by the file backend"))]
    pub(crate) io_threads: Option<usize>,
    /// The NIXL plugin; `None`: SGLang's `auto` choice.
    #[cfg_attr(not(feature = "nixl"), expect(dead_code, reason = "read only by the NIXL backend"))]
    pub(crate) nixl_plugin: Option<String>,
    /// NIXL plugin parameters over the plugin's defaults.
    #[cfg_attr(not(feature = "nixl"), expect(dead_code, reason = "read only by the NIXL backend"))]
    pub(crate) nixl_params: Vec<(String, String)>,
    /// Bytes of page files the namespace may hold in the directory, across processes (the file backend).
    #[cfg_attr(not(feature = "file"), expect(dead_code, reason = "read only by the file backend"))]
    pub(crate) capacity_bytes: Option<u64>,
    /// Open for inspection: create, change and remove nothing (the file backend).
    #[cfg_attr(not(feature = "file"), expect(dead_code, reason = "read only by the file backend"))]
    pub(crate) read_only: bool,
    /// Settings of the networked backends.
    pub(crate) network: NetworkArgs,
    /// The config file's `storage_backend_extra_config`, used where `--extra-config` is not given.
    #[cfg_attr(
        not(any(feature = "mooncake", feature = "3fs")),
        expect(dead_code, reason = "read only by the Mooncake and 3FS backends")
    )]
    pub(crate) config_extra: Option<serde_json::Value>,
}

/// Settings of the networked backends (Mooncake), as SGLang takes them.
#[derive(Clone, Debug, Default, clap::Args)]
pub(crate) struct NetworkArgs {
    /// The backend's settings as a JSON object, SGLang's --hicache-storage-backend-extra-config. Mooncake:
    /// master_server_address, protocol, device_name, global_segment_size, local_buffer_size, metadata_server,
    /// local_hostname, replica_num, key_scheme, sglang_release, extra_backend_tag. 3fs: file_path_prefix,
    /// file_size, numjobs, entries, metadata_server_url (redis://host:port), io_timeout_s, metadata_timeout_s,
    /// library_dir, verify_checksum. Default: the config file's, else SGLang's variables (MOONCAKE_MASTER, ... or
    /// MOONCAKE_CONFIG_PATH; SGLANG_HICACHE_HF3FS_CONFIG_PATH).
    #[arg(long, value_name = "JSON")]
    pub(crate) extra_config: Option<String>,
    /// Object keys: hicache's namespaced ones, or SGLang's (to share one store with SGLang).
    #[arg(long, value_enum)]
    pub(crate) key_scheme: Option<KeySchemeArg>,
    /// The SGLang release whose keys `--key-scheme sglang` uses: 0.5.2 or 0.5.23 (default).
    #[arg(long, value_name = "RELEASE")]
    pub(crate) sglang_release: Option<String>,
}

/// Key schemes by name (`--key-scheme`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum KeySchemeArg {
    /// hicache's keys: a digest of the whole namespace in every key.
    Native,
    /// SGLang's keys, as the release named by --sglang-release writes them.
    Sglang,
}

#[cfg(any(feature = "mooncake", feature = "3fs"))]
impl NetworkArgs {
    /// The extra config as JSON: `--extra-config`, else the config file's.
    fn extra(&self, from_config: Option<&serde_json::Value>) -> anyhow::Result<Option<serde_json::Value>> {
        match &self.extra_config {
            Some(text) => {
                let value: serde_json::Value = serde_json::from_str(text)
                    .map_err(|error| Usage(format!("--extra-config is not JSON: {error}")))?;
                if !value.is_object() {
                    return Err(Usage("--extra-config must be a JSON object".into()).into());
                }
                Ok(Some(value))
            }
            None => Ok(from_config.cloned()),
        }
    }
}

/// Refuses what does nothing with backend `name` (`None`: no storage tier), rather than run as if it did:
/// `--extra-config` that is not a JSON object, or that has keys for a backend that reads none (every backend but
/// Mooncake and 3FS takes its settings as flags); `--key-scheme` and `--sglang-release` for any backend but
/// Mooncake, `--sglang-release` without `--key-scheme sglang` (checked with Mooncake's own config); `--format
/// sglang` for any backend but the file tier.
///
/// # Errors
///
/// [`Usage`] naming the option.
pub(crate) fn check_options(
    name: Option<BackendName>,
    format: FileFormatArg,
    network: &NetworkArgs,
) -> anyhow::Result<()> {
    let backend = name.map_or_else(|| "none".to_owned(), |name| crate::value_name(&name));
    if let Some(text) = &network.extra_config {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|error| Usage(format!("--extra-config is not JSON: {error}")))?;
        let Some(object) = value.as_object() else {
            return Err(Usage("--extra-config must be a JSON object".into()).into());
        };
        let reads_extra = matches!(name, Some(BackendName::Mooncake | BackendName::ThreeFs));
        if let (false, Some(key)) = (reads_extra, object.keys().next()) {
            return Err(Usage(format!(
                "--extra-config key `{key}` does nothing with --backend {backend} (only mooncake and 3fs read an \
                 extra config; the other backends take flags: --dir, --capacity, --io-threads, ...)"
            ))
            .into());
        }
    }
    if name != Some(BackendName::Mooncake) {
        for (flag, given) in
            [("--key-scheme", network.key_scheme.is_some()), ("--sglang-release", network.sglang_release.is_some())]
        {
            if given {
                return Err(
                    Usage(format!("{flag} does nothing with --backend {backend} (Mooncake's keys only)")).into()
                );
            }
        }
    }
    if format == FileFormatArg::Sglang && name != Some(BackendName::File) {
        return Err(
            Usage(format!("--format sglang does nothing with --backend {backend} (the file tier's layout)")).into()
        );
    }
    Ok(())
}

/// Opens `name` for `namespace`, after [`check_options`].
pub(crate) fn open(
    name: BackendName,
    namespace: &StorageNamespace,
    options: &BackendOptions,
) -> anyhow::Result<Box<dyn StorageBackend>> {
    check_options(Some(name), options.format, &options.network)?;
    match name {
        BackendName::Memory => Ok(Box::new(MemoryStorage::new(namespace))),
        BackendName::File => open_file(namespace, options),
        BackendName::Nixl => open_nixl(namespace, options),
        BackendName::Mooncake => open_mooncake(namespace, options),
        BackendName::ThreeFs => open_3fs(namespace, options),
    }
}

#[cfg(feature = "3fs")]
fn open_3fs(namespace: &StorageNamespace, options: &BackendOptions) -> anyhow::Result<Box<dyn StorageBackend>> {
    let config = hf3fs_config(options)?;
    Ok(Box::new(hicache_storage_3fs::Hf3fsStorage::open(config, namespace)?))
}

/// The 3FS settings: `--extra-config` (else the config file's extra config) with SGLang's keys, its
/// `file_path_prefix` defaulting to `{--dir}/hicache`; else the file at `SGLANG_HICACHE_HF3FS_CONFIG_PATH`; else
/// SGLang's defaults with data files `{--dir}/hicache.{rank}.bin` (`/data/hicache` without `--dir`).
#[cfg(feature = "3fs")]
pub(crate) fn hf3fs_config(options: &BackendOptions) -> anyhow::Result<hicache_storage_3fs::Hf3fsConfig> {
    use hicache_storage_3fs::{CONFIG_ENV, Hf3fsConfig};
    let prefix = || options.dir.as_ref().map(|dir| dir.join("hicache"));
    match options.network.extra(options.config_extra.as_ref())? {
        Some(mut extra) => {
            if let (Some(object), Some(prefix)) = (extra.as_object_mut(), prefix())
                && !object.contains_key("file_path_prefix")
            {
                object.insert("file_path_prefix".into(), prefix.display().to_string().into());
            }
            Hf3fsConfig::from_json(&extra).map_err(|error| Usage(format!("--extra-config: {error}")).into())
        }
        None if std::env::var_os(CONFIG_ENV).is_some_and(|path| !path.is_empty()) => {
            Hf3fsConfig::from_env().map_err(|error| Usage(error.to_string()).into())
        }
        None => Ok(prefix().map_or_else(|| Hf3fsConfig::new("/data/hicache"), Hf3fsConfig::new)),
    }
}

#[cfg(not(feature = "3fs"))]
fn open_3fs(_: &StorageNamespace, _: &BackendOptions) -> anyhow::Result<Box<dyn StorageBackend>> {
    Err(not_compiled(BackendName::ThreeFs))
}

#[cfg(feature = "file")]
fn open_file(namespace: &StorageNamespace, options: &BackendOptions) -> anyhow::Result<Box<dyn StorageBackend>> {
    use hicache_storage_file::{FileConfig, FileFormat, FileStorage};
    let format = match options.format {
        FileFormatArg::Native => FileFormat::Native,
        FileFormatArg::Sglang => FileFormat::Sglang,
    };
    let dir = FileConfig::resolve_dir(options.dir.as_deref());
    let mut config = FileConfig::new(dir, format);
    config.io_threads = options.io_threads.unwrap_or(config.io_threads);
    config.direct_io = options.direct_io;
    config.read_only = options.read_only;
    config.capacity_bytes = options.capacity_bytes;
    Ok(Box::new(FileStorage::open(config, namespace)?))
}

#[cfg(not(feature = "file"))]
fn open_file(_: &StorageNamespace, _: &BackendOptions) -> anyhow::Result<Box<dyn StorageBackend>> {
    Err(not_compiled(BackendName::File))
}

#[cfg(feature = "nixl")]
fn open_nixl(namespace: &StorageNamespace, options: &BackendOptions) -> anyhow::Result<Box<dyn StorageBackend>> {
    use hicache_storage_nixl::{NixlConfig, NixlStorage, PluginChoice};
    let mut config = NixlConfig::new(NixlConfig::resolve_dir(options.dir.as_deref()));
    if let Some(plugin) = &options.nixl_plugin {
        config.plugin = PluginChoice::Named(plugin.clone());
    }
    config.plugin_params.extend(options.nixl_params.iter().cloned());
    Ok(Box::new(NixlStorage::open(config, namespace)?))
}

#[cfg(not(feature = "nixl"))]
fn open_nixl(_: &StorageNamespace, _: &BackendOptions) -> anyhow::Result<Box<dyn StorageBackend>> {
    Err(not_compiled(BackendName::Nixl))
}

#[cfg(feature = "mooncake")]
fn open_mooncake(namespace: &StorageNamespace, options: &BackendOptions) -> anyhow::Result<Box<dyn StorageBackend>> {
    let config = mooncake_config(options)?;
    Ok(Box::new(hicache_storage_mooncake::MooncakeStorage::open(config, namespace)?))
}

/// The Mooncake settings: `--extra-config` (else the config file's extra config) with the master from
/// `MOONCAKE_MASTER` where it names none, else SGLang's variables; then `--key-scheme` and `--sglang-release`.
#[cfg(feature = "mooncake")]
pub(crate) fn mooncake_config(options: &BackendOptions) -> anyhow::Result<hicache_storage_mooncake::MooncakeConfig> {
    use hicache_storage_mooncake::{KeyScheme, MooncakeConfig, SglangRelease};
    let network = &options.network;
    let mut config = match network.extra(options.config_extra.as_ref())? {
        Some(extra) => {
            MooncakeConfig::from_extra_config(&extra).map_err(|error| Usage(format!("--extra-config: {error}")))?
        }
        None => MooncakeConfig::from_env().map_err(|error| Usage(error.to_string()))?,
    };
    let release = match &network.sglang_release {
        Some(text) => Some(SglangRelease::parse(text).map_err(|error| Usage(format!("--sglang-release: {error}")))?),
        None => None,
    };
    match (network.key_scheme, &mut config.scheme) {
        (Some(KeySchemeArg::Native), _) => {
            if release.is_some() {
                return Err(Usage("--sglang-release applies to --key-scheme sglang only".into()).into());
            }
            config.scheme = KeyScheme::Native;
        }
        (Some(KeySchemeArg::Sglang), KeyScheme::Sglang { release: current, .. }) => {
            *current = release.unwrap_or(*current);
        }
        (Some(KeySchemeArg::Sglang), scheme) => {
            *scheme = KeyScheme::Sglang { release: release.unwrap_or(SglangRelease::V0_5_23), tag: None };
        }
        (None, KeyScheme::Sglang { release: current, .. }) => *current = release.unwrap_or(*current),
        (None, KeyScheme::Native) if release.is_some() => {
            return Err(Usage("--sglang-release needs --key-scheme sglang".into()).into());
        }
        (None, KeyScheme::Native) => {}
    }
    Ok(config)
}

#[cfg(not(feature = "mooncake"))]
fn open_mooncake(_: &StorageNamespace, _: &BackendOptions) -> anyhow::Result<Box<dyn StorageBackend>> {
    Err(not_compiled(BackendName::Mooncake))
}

#[cfg(not(all(feature = "file", feature = "nixl", feature = "mooncake", feature = "3fs")))]
fn not_compiled(name: BackendName) -> anyhow::Error {
    let feature = crate::value_name(&name);
    Usage(format!(
        "the {feature} backend is not compiled into this hicache; rebuild with `cargo build --release -p hicache-cli \
         --features {feature}`"
    ))
    .into()
}

/// The directory a file-like backend uses: the given one, else its environment variable, else its default.
pub(crate) fn dir_of(name: BackendName, options: &BackendOptions) -> PathBuf {
    if let Some(dir) = &options.dir {
        return dir.clone();
    }
    match name {
        #[cfg(feature = "nixl")]
        BackendName::Nixl => hicache_storage_nixl::NixlConfig::resolve_dir(None),
        #[cfg(feature = "file")]
        _ => hicache_storage_file::FileConfig::resolve_dir(None),
        #[cfg(not(feature = "file"))]
        _ => PathBuf::from("/tmp/hicache"),
    }
}
