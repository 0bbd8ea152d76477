//! Opening a storage backend by name: the tiers this build links, from the table of tiers the Python package reads
//! too (`hicache_core::storage::tiers`), with the flags turned into the tier's settings, and a clear answer for a
//! tier this build leaves out.

use std::path::PathBuf;

use clap::ValueEnum;
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use hicache_core::extra_config::{UnifiedAgreements, take_shared, throttled};
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::l3_layout::L3Layout;
use hicache_core::storage::tiers::{self, TierEntry, TierFields};
use hicache_core::storage::{StorageBackend, UnifiedStorage};
use hicache_core::unified_keys::{UnifiedRank, plan};
use serde_json::Value;

use crate::exit::Usage;

// The tiers' crates register themselves in the table of tiers; naming each one here links it in.
#[cfg(feature = "3fs")]
use hicache_storage_3fs as _;
#[cfg(feature = "file")]
use hicache_storage_file as _;
#[cfg(feature = "mooncake")]
use hicache_storage_mooncake as _;
#[cfg(feature = "nixl")]
use hicache_storage_nixl as _;

/// The tiers this command can be built with, by cargo feature (name, aliases): a name here that the table lacks gets
/// the feature to rebuild with.
const FEATURE_TIERS: [(&str, &[&str]); 4] = [("file", &[]), ("nixl", &[]), ("mooncake", &[]), ("3fs", &["hf3fs"])];

/// A storage tier by name (`--backend`): an entry of the table of tiers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BackendName(&'static TierEntry);

impl PartialEq for BackendName {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for BackendName {}

impl BackendName {
    /// The tier's entry in the table.
    pub(crate) fn entry(self) -> &'static TierEntry {
        self.0
    }

    /// The tier named `name` (or an alias).
    ///
    /// # Errors
    ///
    /// [`Usage`] naming the feature to rebuild with, or the tiers there are.
    pub(crate) fn parse(name: &str) -> Result<Self, Usage> {
        if let Some(entry) = tiers::find(name) {
            return Ok(Self(entry));
        }
        match FEATURE_TIERS.iter().find(|(feature, aliases)| *feature == name || aliases.contains(&name)) {
            Some((feature, _)) => Err(Usage(format!(
                "the {feature} backend is not compiled into this hicache; rebuild with `cargo build --release -p \
                 hicache-cli --features {feature}`"
            ))),
            None => Err(Usage(format!("{name:?} is not a storage backend ({})", tiers::names()))),
        }
    }

    /// The tier's name.
    pub(crate) fn name(self) -> &'static str {
        self.0.name
    }

    /// Whether this is the tier named `name`.
    pub(crate) fn is(self, name: &str) -> bool {
        self.0.name == name
    }
}

/// The values `--backend` takes: every tier of the table, and (hidden) the ones left out of this build, which
/// [`BackendName::parse`] answers with the feature to rebuild with; `none` too where `with_none`.
fn possible_values(with_none: bool) -> Vec<PossibleValue> {
    let mut values: Vec<PossibleValue> = tiers::all()
        .into_iter()
        .map(|entry| PossibleValue::new(entry.name).aliases(entry.aliases.iter().copied()).help(entry.about))
        .collect();
    if with_none {
        values.insert(0, PossibleValue::new("none").help("no storage tier: device and host only"));
    }
    for (feature, aliases) in FEATURE_TIERS {
        if tiers::find(feature).is_none() {
            values.push(PossibleValue::new(feature).aliases(aliases.iter().copied()).hide(true));
        }
    }
    values
}

/// `--backend`'s parser: a tier of the table.
pub(crate) fn backend_parser() -> impl TypedValueParser<Value = BackendName> {
    PossibleValuesParser::new(possible_values(false)).try_map(|name| BackendName::parse(&name))
}

/// `--backend`'s parser where no tier at all is a choice (`none`).
pub(crate) fn optional_backend_parser() -> impl TypedValueParser<Value = OptionalBackend> {
    PossibleValuesParser::new(possible_values(true)).try_map(|name| match name.as_str() {
        "none" => Ok(OptionalBackend(None)),
        name => BackendName::parse(name).map(|name| OptionalBackend(Some(name))),
    })
}

/// A storage tier, or none (`--backend none`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OptionalBackend(pub(crate) Option<BackendName>);

impl OptionalBackend {
    /// The tier's name, or `none`.
    pub(crate) fn name(self) -> &'static str {
        self.0.map_or("none", BackendName::name)
    }
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
    pub(crate) direct_io: bool,
    /// Threads per batch of file-like backends (default: two per core, between 2 and 16).
    pub(crate) io_threads: Option<usize>,
    /// The NIXL plugin; `None`: SGLang's `auto` choice.
    pub(crate) nixl_plugin: Option<String>,
    /// NIXL plugin parameters over the plugin's defaults.
    pub(crate) nixl_params: Vec<(String, String)>,
    /// Bytes of page files the namespace may hold in the directory, across processes (the file backend).
    pub(crate) capacity_bytes: Option<u64>,
    /// Open for inspection: create, change and remove nothing (the file backend).
    pub(crate) read_only: bool,
    /// The extra config and Mooncake's key flags.
    pub(crate) network: NetworkArgs,
    /// The config file's `storage_backend_extra_config`, used where `--extra-config` is not given.
    pub(crate) config_extra: Option<serde_json::Value>,
}

/// The tier's settings as SGLang takes them, and Mooncake's key flags.
#[derive(Clone, Debug, Default, clap::Args)]
pub(crate) struct NetworkArgs {
    /// The backend's settings as a JSON object, SGLang's --hicache-storage-backend-extra-config, read strictly by the
    /// tier (a key a flag such as --dir also gives is refused; throttle_read_gbps holds any tier's reads). file: dir
    /// (or SGLang's file_storage_path), format, capacity, io_threads, direct_io, read_only, segment_threshold,
    /// segment_bytes, io_uring, read_ahead, write_behind, preallocate, write_split. nixl: dir, plugin, plugin_params,
    /// lib_dir, max_open_files, max_registered_regions. mooncake: master_server_address, protocol, device_name,
    /// global_segment_size, local_buffer_size, metadata_server, local_hostname, replica_num, key_scheme,
    /// sglang_release, extra_backend_tag, ... 3fs: file_path_prefix, file_size, numjobs, entries, metadata_server_url
    /// (redis://host:port), io_timeout_s, metadata_timeout_s, library_dir, verify_checksum. Default: the config file's,
    /// else SGLang's variables (MOONCAKE_MASTER, ... or MOONCAKE_CONFIG_PATH; SGLANG_HICACHE_HF3FS_CONFIG_PATH).
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

impl NetworkArgs {
    /// Whether `--extra-config` sets one of `keys` (false when it is not a JSON object: refused later).
    pub(crate) fn sets_any(&self, keys: &[&str]) -> bool {
        let given = self.extra_config.as_deref().and_then(|text| serde_json::from_str::<Value>(text).ok());
        given.as_ref().and_then(Value::as_object).is_some_and(|object| keys.iter().any(|key| object.contains_key(*key)))
    }

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

/// Refuses what does nothing with backend `name` (`None`: no storage tier), rather than run as if it did: an
/// `--extra-config` that is not a JSON object, or any extra config without a tier; `--key-scheme` and
/// `--sglang-release` for any backend but Mooncake; `--format sglang` for any backend but the file tier. (What the
/// extra config says is read by the tier itself, strictly: [`settings`].)
///
/// # Errors
///
/// [`Usage`] naming the option.
pub(crate) fn check_options(
    name: Option<BackendName>,
    format: FileFormatArg,
    network: &NetworkArgs,
) -> anyhow::Result<()> {
    let backend = name.map_or("none", BackendName::name);
    if let Some(text) = &network.extra_config {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|error| Usage(format!("--extra-config is not JSON: {error}")))?;
        let Some(object) = value.as_object() else {
            return Err(Usage("--extra-config must be a JSON object".into()).into());
        };
        if let (None, Some(key)) = (name, object.keys().next()) {
            return Err(Usage(format!("--extra-config key `{key}` does nothing with --backend none")).into());
        }
    }
    if !name.is_some_and(|name| name.is("mooncake")) {
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
    if format == FileFormatArg::Sglang && !name.is_some_and(|name| name.is("file")) {
        return Err(
            Usage(format!("--format sglang does nothing with --backend {backend} (the file tier's layout)")).into()
        );
    }
    Ok(())
}

/// What a tier is opened with: its own settings, and the throttle of its reads (`throttle_read_gbps`).
#[derive(Debug)]
pub(crate) struct TierSettings {
    /// The tier's own keys.
    pub(crate) fields: TierFields,
    /// Storage gets held to this many bytes per second; `None`: not held.
    pub(crate) throttle_read_bytes_per_s: Option<u64>,
    /// `key_scheme: "unified"` in the extra config: the fleet's agreements on the chunks.
    pub(crate) unified: Option<UnifiedAgreements>,
}

/// The tier's settings: the extra config (`--extra-config`, else the config file's; the keys every tier shares are
/// read as the Python package reads them, SGLang's own are ignored), and the flags under the tier's own keys:
/// `--dir` as the file and NIXL tiers' `dir` (and as 3FS's `file_path_prefix` `{dir}/hicache` when the extra config
/// names none), `--format`, `--io-threads`, `--direct-io`, `--capacity-bytes`, NIXL's plugin and its parameters,
/// Mooncake's key scheme and release. A key given both ways is refused; the tier checks the result.
///
/// # Errors
///
/// [`Usage`] naming the key at fault.
pub(crate) fn settings(name: BackendName, options: &BackendOptions) -> anyhow::Result<TierSettings> {
    check_options(Some(name), options.format, &options.network)?;
    let mut fields = match options.network.extra(options.config_extra.as_ref())? {
        Some(Value::Object(fields)) => fields,
        _ => TierFields::new(),
    };
    let shared = take_shared(&mut fields)
        .map_err(|error| Usage(format!("--extra-config key `{}`: {}", error.key, error.reason)))?;
    if let Some(backend) = shared.backend
        && !name.0.is_named(&backend)
    {
        return Err(
            Usage(format!("--extra-config key `backend`: {backend:?} differs from --backend {}", name.name())).into()
        );
    }
    let mut flags = TierFields::new();
    let dir = options.dir.as_ref().map(|dir| Value::from(dir.display().to_string()));
    match name.name() {
        "file" => {
            flags.extend(dir.map(|dir| ("dir".to_owned(), dir)));
            if options.format == FileFormatArg::Sglang {
                flags.insert("format".into(), "sglang".into());
            }
            flags.extend(options.io_threads.map(|threads| ("io_threads".to_owned(), threads.into())));
            flags.extend(options.capacity_bytes.map(|bytes| ("capacity".to_owned(), bytes.into())));
            if options.direct_io {
                flags.insert("direct_io".into(), true.into());
            }
            if options.read_only {
                flags.insert("read_only".into(), true.into());
            }
        }
        "nixl" => {
            flags.extend(dir.map(|dir| ("dir".to_owned(), dir)));
            flags.extend(options.nixl_plugin.clone().map(|plugin| ("plugin".to_owned(), plugin.into())));
            if !options.nixl_params.is_empty() {
                let params = options.nixl_params.iter().map(|(key, value)| (key.clone(), value.clone().into()));
                flags.insert("plugin_params".into(), Value::Object(params.collect()));
            }
        }
        "3fs" => {
            if let Some(dir) = &options.dir
                && !fields.contains_key("file_path_prefix")
            {
                flags.insert("file_path_prefix".into(), dir.join("hicache").display().to_string().into());
            }
        }
        "mooncake" => {
            let network = &options.network;
            flags.extend(network.key_scheme.map(|scheme| ("key_scheme".to_owned(), crate::value_name(&scheme).into())));
            flags.extend(network.sglang_release.clone().map(|release| ("sglang_release".to_owned(), release.into())));
        }
        _ => {}
    }
    for (key, value) in flags {
        if fields.contains_key(&key) {
            return Err(Usage(format!(
                "--backend {}: `{key}` is given twice, by a flag and by the extra config; give it once",
                name.name()
            ))
            .into());
        }
        fields.insert(key, value);
    }
    name.0
        .check(&fields)
        .map_err(|error| Usage(format!("--backend {} setting `{}`: {}", name.name(), error.key, error.reason)))?;
    Ok(TierSettings { fields, throttle_read_bytes_per_s: shared.throttle_read_bytes_per_s, unified: shared.unified })
}

/// Opens `name` for `namespace` (whose pipeline stage starts at the model's layer `first_layer`) with its
/// [`settings`].
pub(crate) fn open(
    name: BackendName,
    namespace: &StorageNamespace,
    first_layer: u64,
    options: &BackendOptions,
) -> anyhow::Result<Box<dyn StorageBackend>> {
    let settings = settings(name, options)?;
    let open = |namespace: &StorageNamespace| open_tier(name, &settings, namespace);
    match settings.unified {
        None => Ok(open(namespace)?),
        Some(agreements) => Ok(Box::new(open_unified(namespace, stage(namespace, first_layer), agreements, &open)?)),
    }
}

/// The pipeline stage of `namespace` as the unified key scheme takes it: its first layer (`first_layer`, the
/// model's index), and whether it is the last stage.
pub(crate) fn stage(namespace: &StorageNamespace, first_layer: u64) -> (u64, bool) {
    (first_layer, namespace.pp_rank + 1 == namespace.pp_size)
}

/// The L3 key layout of the stage of `namespace` (every TP rank of it; its first layer the model's `first_layer`)
/// on `name` with its [`settings`], for routers ([`L3Layout::describe`]). Nothing is opened.
///
/// # Errors
///
/// [`Usage`] naming the setting or the unified plan's field at fault.
pub(crate) fn l3_layout(
    name: BackendName,
    namespace: &StorageNamespace,
    first_layer: u64,
    options: &BackendOptions,
) -> anyhow::Result<L3Layout> {
    let settings = settings(name, options)?;
    let stage = stage(namespace, first_layer);
    L3Layout::describe(name.0, &settings.fields, namespace, settings.unified.map(|agreements| (agreements, stage)))
        .map_err(|error| Usage(format!("the L3 layout: {error}")).into())
}

/// Adds a hybrid model's sidecar pool to `layout` ([`L3Layout::add_sidecar`]), with `name`'s settings.
///
/// # Errors
///
/// A usage error for the settings or the pool.
pub(crate) fn add_sidecar_layout(
    layout: &mut L3Layout,
    name: BackendName,
    kv: &StorageNamespace,
    sidecar: &hicache_core::namespace::Sidecar,
    policy: hicache_core::storage::groups::HitPolicy,
    options: &BackendOptions,
) -> anyhow::Result<()> {
    let settings = settings(name, options)?;
    layout
        .add_sidecar(name.0, &settings.fields, kv, sidecar, policy)
        .map_err(|error| Usage(format!("the L3 layout of --pool {}: {error}", sidecar.pool)).into())
}

/// Opens `name` for `namespace` with `settings` as it is, held to its throttle (a chunk namespace's tier, under the
/// unified key scheme).
///
/// # Errors
///
/// The tier's failure to open.
pub(crate) fn open_tier(
    name: BackendName,
    settings: &TierSettings,
    namespace: &StorageNamespace,
) -> Result<Box<dyn StorageBackend>, hicache_core::Error> {
    Ok(throttled(name.0.open(&settings.fields, namespace)?, settings.throttle_read_bytes_per_s))
}

/// The pages of `namespace` as unified-key chunks on the tier `open` opens: a pipeline stage whose first layer is
/// `stage.0` (the model's index), the last stage when `stage.1`.
///
/// # Errors
///
/// [`Usage`] naming the agreement or the pool's field SGLang's plan or the pool refuses; the tier's errors.
pub(crate) fn open_unified(
    namespace: &StorageNamespace,
    stage: (u64, bool),
    agreements: UnifiedAgreements,
    open: &hicache_core::storage::OpenTier<'_>,
) -> anyhow::Result<UnifiedStorage> {
    let rank = UnifiedRank::of(namespace, stage, agreements.head_group, agreements.layer_partition);
    let plan = plan(&rank).map_err(|error| Usage(format!("key_scheme unified: {error}")))?;
    UnifiedStorage::open(namespace.clone(), &plan, open).map_err(|error| match error.kind() {
        hicache_core::ErrorKind::InvalidInput => Usage(format!("key_scheme unified: {error}")).into(),
        _ => anyhow::Error::from(error),
    })
}

/// The 3FS settings the flags and the extra config give ([`settings`]).
#[cfg(feature = "3fs")]
pub(crate) fn hf3fs_config(options: &BackendOptions) -> anyhow::Result<hicache_storage_3fs::Hf3fsConfig> {
    let settings = settings(BackendName(&hicache_storage_3fs::HF3FS_TIER), options)?;
    Ok(hicache_storage_3fs::Hf3fsConfig::from_fields(&settings.fields)?)
}

/// The Mooncake settings the flags and the extra config give ([`settings`]).
#[cfg(feature = "mooncake")]
pub(crate) fn mooncake_config(options: &BackendOptions) -> anyhow::Result<hicache_storage_mooncake::MooncakeConfig> {
    let settings = settings(BackendName(&hicache_storage_mooncake::MOONCAKE_TIER), options)?;
    Ok(hicache_storage_mooncake::MooncakeConfig::from_fields(&settings.fields)?)
}

/// The directory a file-like backend uses: the given one (`--dir`, else the extra config's `dir`), else its
/// environment variable, else its default.
pub(crate) fn dir_of(name: BackendName, options: &BackendOptions) -> PathBuf {
    if let Some(dir) = &options.dir {
        return dir.clone();
    }
    let extra = options.network.extra(options.config_extra.as_ref()).ok().flatten();
    if let Some(dir) = extra.as_ref().and_then(|extra| extra.get("dir")).and_then(Value::as_str) {
        return PathBuf::from(dir);
    }
    match name.name() {
        #[cfg(feature = "nixl")]
        "nixl" => hicache_storage_nixl::NixlConfig::resolve_dir(None),
        #[cfg(feature = "file")]
        _ => hicache_storage_file::FileConfig::resolve_dir(None),
        #[cfg(not(feature = "file"))]
        _ => PathBuf::from("/tmp/hicache"),
    }
}
