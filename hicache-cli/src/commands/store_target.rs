//! What every `hicache store` command shares: the flags that name a backend, a namespace and pages, opening the
//! backend they name, and reading pages from a file.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use clap::{Args, ValueEnum};
use hicache_core::config::HiCacheConfig;
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PageHasher, PageKey};
use hicache_core::namespace::{EntryObject, StorageNamespace, sglang_mooncake_objects};
use hicache_core::storage::StorageBackend;
use hicache_core::tokens::parse_tokens;

use super::bench_transfer::GeometryArg;
use super::hash::PartialArg;
use crate::backends::{self, BackendName, BackendOptions, FileFormatArg};
use crate::exit::Usage;
use crate::replay::LayoutArg;

/// KV dtypes by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum DtypeArg {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
    /// FP8 E4M3.
    Fp8E4m3,
    /// FP8 E5M2.
    Fp8E5m2,
}

/// The backend and the namespace (shared by every store command).
#[derive(Debug, Args)]
pub(crate) struct TargetArgs {
    /// Storage backend (default: the config's storage_backend, else file).
    #[arg(long, value_parser = backends::backend_parser())]
    backend: Option<BackendName>,
    /// A hicache config (JSON, SGLang's names) supplying the backend, model, page size and layout.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Directory of file-like backends (default: $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else /tmp/hicache).
    #[arg(long, value_name = "PATH")]
    dir: Option<PathBuf>,
    /// File layout of the file backend.
    #[arg(long, value_enum, default_value_t = FileFormatArg::Native)]
    format: FileFormatArg,
    #[command(flatten)]
    network: crate::backends::NetworkArgs,
    /// Served model name: it only names the namespace (default: the config's model_name, else empty); the geometry
    /// (--geometry, or the flags below) decides how many bytes a page holds.
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// A known model's geometry instead of the flags below (a 64-token page of llama31-8b is 8 MiB, of deepseek-v3
    /// 4.3 MiB; `store stat` shows the page's bytes).
    #[arg(long, value_enum, conflicts_with_all = ["mla", "layers", "kv_heads", "head_dim", "kv_lora_rank", "rope_dim", "dtype"])]
    geometry: Option<GeometryArg>,
    /// Attention TP rank.
    #[arg(long, default_value_t = 0, value_name = "R")]
    tp_rank: usize,
    /// Attention TP size.
    #[arg(long, default_value_t = 1, value_name = "S")]
    tp_size: usize,
    /// Pipeline stage.
    #[arg(long, default_value_t = 0, value_name = "R")]
    pp_rank: usize,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1, value_name = "S")]
    pp_size: usize,
    /// The model's index of this stage's first layer (the unified key scheme names chunks by absolute layers).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub(super) start_layer: u64,
    /// An MLA model (keys shared by every rank): the geometry is --layers × (--kv-lora-rank + --rope-dim).
    #[arg(long)]
    mla: bool,
    /// Layers on this rank (the defaults of these flags are Llama-3.1-8B's).
    #[arg(long, default_value_t = 32, value_name = "N")]
    layers: usize,
    /// KV heads on this rank (MHA).
    #[arg(long, default_value_t = 8, value_name = "N")]
    kv_heads: usize,
    /// Head dimension (MHA).
    #[arg(long, default_value_t = 128, value_name = "N")]
    head_dim: usize,
    /// Latent rank (MLA).
    #[arg(long, default_value_t = 512, value_name = "N")]
    kv_lora_rank: usize,
    /// Rotary dimension (MLA).
    #[arg(long, default_value_t = 64, value_name = "N")]
    rope_dim: usize,
    /// KV element type.
    #[arg(long, value_enum, default_value_t = DtypeArg::Bf16)]
    dtype: DtypeArg,
    /// Host layout (decides the flat page's byte order; default: the config's mem_layout, else layer_first).
    #[arg(long, value_enum)]
    layout: Option<LayoutArg>,
    /// KV heads per head group of page-unified pages (default: the config's head_group, else the extra config's
    /// unified key scheme's, else one group of all the heads).
    #[arg(long, value_name = "N")]
    head_group: Option<usize>,
    /// Tokens per page (default: the config's page_size, else 64); a page's bytes are tokens × the geometry's bytes
    /// per token.
    #[arg(long, value_name = "N")]
    page_size: Option<usize>,
    /// Bytes of page files the namespace may hold in the directory, across processes (a put evicts least recently
    /// used pages beyond it; default: the config's storage_capacity_bytes, else no limit).
    #[arg(long, value_name = "BYTES")]
    capacity_bytes: Option<u64>,
    /// Bytes per page, checked against the geometry (a guard against the wrong geometry); with --pool, against
    /// --entry-bytes.
    #[arg(long, value_name = "B")]
    page_bytes: Option<usize>,
    /// A hybrid model's sidecar pool (`mamba`, `swa`, `indexer`, `draft`, ...): its entries under the pages' keys,
    /// in a namespace of its own, instead of the KV pages (needs --entry-bytes).
    #[arg(long, value_name = "NAME", requires = "entry_bytes")]
    pool: Option<String>,
    /// Bytes of one entry of the --pool (SGLang's `get_dummy_flat_data_page()` of the pool).
    #[arg(long, value_name = "B", requires = "pool")]
    entry_bytes: Option<usize>,
    /// How SGLang's Mooncake keys cut an entry of the --pool into objects, one per buffer of its host pool, in the
    /// entry's byte order: `NAME:BYTES` (the key carries the TP rank) or `NAME:BYTES:stage` (only the stage), comma
    /// separated, e.g. `temporal:2195456,conv_0:24576` for a Mamba state. Default: what the pool's name and the
    /// attention tell (an indexer's one object; a sliding window's or a draft model's K and V halves beside MHA, one
    /// object beside MLA); a Mamba state has none. Only Mooncake under `--key-scheme sglang` uses it.
    #[arg(long, value_name = "LIST", requires = "pool", value_parser = parse_entry_objects)]
    entry_objects: Option<EntryObjects>,
    /// Print JSON.
    #[arg(long)]
    pub(super) json: bool,
}

/// The pages a command is about: keys given, or computed from tokens.
#[derive(Debug, Args)]
pub(crate) struct KeysArgs {
    /// A page key (64 hex digits); repeatable, in order.
    #[arg(long = "key", value_name = "HEX")]
    keys: Vec<String>,
    /// A file of token ids whose page keys to use (integers separated by spaces or commas, or a JSON array).
    #[arg(long, value_name = "FILE", conflicts_with = "keys")]
    tokens: Option<PathBuf>,
    /// Key of the page before the first token, to continue a chain.
    #[arg(long, value_name = "HEX", requires = "tokens")]
    prior: Option<String>,
    /// What to do with a trailing partial page of --tokens.
    #[arg(long, value_enum, default_value_t = PartialArg::Reject)]
    pub(super) partial: PartialArg,
}

/// An opened backend and what is known about its pages.
pub(super) struct Opened {
    pub(super) backend: Box<dyn StorageBackend>,
    pub(super) namespace: StorageNamespace,
    pub(super) page_bytes: usize,
    pub(super) description: String,
}

/// What a store command does to the directory of a file-like backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Reads only: the directory must exist, and nothing in it is created, changed or removed.
    Inspect,
    /// Removes pages: the directory must exist.
    Remove,
    /// Writes pages: the directory is created if needed.
    Write,
}

/// A backend and namespace the flags name, not opened yet.
pub(super) struct Target {
    pub(super) backend: BackendName,
    pub(super) namespace: StorageNamespace,
    pub(super) options: BackendOptions,
    pub(super) page_bytes: usize,
}

pub(super) fn open(args: &TargetArgs, mode: Mode) -> anyhow::Result<Opened> {
    let Target { backend, namespace, options, page_bytes } = target(args, mode)?;
    let file_like = backend.is("file") || backend.is("nixl");
    if file_like && mode != Mode::Write {
        let dir = backends::dir_of(backend, &options);
        if !dir.is_dir() {
            bail!(Usage(format!("the storage directory {} does not exist (--dir)", dir.display())));
        }
    }
    let opened = backends::open(backend, &namespace, args.start_layer, &options)?;
    let description = if file_like {
        format!("{} backend in {}", opened.name(), backends::dir_of(backend, &options).display())
    } else {
        format!("{} backend", backend.name())
    };
    Ok(Opened { backend: opened, namespace, page_bytes, description })
}

pub(super) fn target(args: &TargetArgs, mode: Mode) -> anyhow::Result<Target> {
    let config = match &args.config {
        Some(path) => {
            let text = crate::input::read_text(Some(path), "config", crate::input::CONFIG_LIMIT)?;
            Some(HiCacheConfig::from_json(&text).with_context(|| format!("config {}", path.display()))?)
        }
        None => None,
    };
    let backend = match (args.backend, config.as_ref().and_then(|config| config.storage_backend.as_deref())) {
        (Some(backend), _) => backend,
        (None, Some(name)) => BackendName::parse(name)?,
        (None, None) => BackendName::parse("file")?,
    };
    let page_size = args.page_size.or(config.as_ref().map(|config| config.page_size)).unwrap_or(64);
    if page_size == 0 {
        bail!(Usage("--page-size must be at least 1".into()));
    }
    let layout = match args.layout {
        Some(layout) => crate::replay::host_layout(layout),
        None => config.as_ref().map_or(hicache_core::layout::HostLayout::LayerFirst, |config| config.mem_layout),
    };
    let dtype = match args.dtype {
        DtypeArg::Bf16 => KvDtype::Bf16,
        DtypeArg::F16 => KvDtype::F16,
        DtypeArg::F32 => KvDtype::F32,
        DtypeArg::Fp8E4m3 => KvDtype::Fp8E4m3,
        DtypeArg::Fp8E5m2 => KvDtype::Fp8E5m2,
    };
    let geometry = if let Some(known) = args.geometry {
        match known {
            GeometryArg::Llama31_8b => KvGeometry::llama31_8b(),
            GeometryArg::DeepseekV3 => KvGeometry::deepseek_v3(),
        }
    } else if args.mla {
        KvGeometry::mla(args.layers, args.kv_lora_rank, args.rope_dim, dtype)?
    } else {
        KvGeometry::mha(args.layers, args.kv_heads, args.head_dim, dtype)?
    };
    let model = args.model.clone().or(config.as_ref().and_then(|config| config.model_name.clone())).unwrap_or_default();
    let mut namespace = StorageNamespace::single_rank(model, geometry, layout, page_size);
    namespace.tp_rank = args.tp_rank;
    namespace.tp_size = args.tp_size;
    namespace.pp_rank = args.pp_rank;
    namespace.pp_size = args.pp_size;
    let mut namespace = namespace.validated()?;
    let mut page_bytes = geometry.bytes_per_page(page_size);
    if let (Some(pool), Some(entry_bytes)) = (&args.pool, args.entry_bytes) {
        namespace = namespace.sidecar(pool, entry_bytes).map_err(|error| Usage(format!("--pool: {error}")))?;
        let given = args.entry_objects.clone().map(|EntryObjects(objects)| objects);
        let objects = given.or_else(|| sglang_mooncake_objects(pool, geometry.is_mla(), entry_bytes));
        if let Some(objects) = objects {
            namespace =
                namespace.with_entry_objects(objects).map_err(|error| Usage(format!("--entry-objects: {error}")))?;
        }
        page_bytes = entry_bytes;
    }
    if let Some(given) = args.page_bytes
        && given != page_bytes
    {
        bail!(Usage(match args.pool {
            Some(_) => format!("--page-bytes {given} does not match --entry-bytes {page_bytes}"),
            None => format!(
                "--page-bytes {given} does not match the geometry: {page_size} tokens × {} bytes = {page_bytes}",
                geometry.bytes_per_token()
            ),
        }));
    }
    let options = BackendOptions {
        dir: args.dir.clone(),
        format: args.format,
        direct_io: false,
        io_threads: None,
        nixl_plugin: None,
        nixl_params: Vec::new(),
        read_only: mode == Mode::Inspect,
        network: args.network.clone(),
        config_extra: config.as_ref().and_then(|config| config.storage_backend_extra_config.clone()),
        capacity_bytes: args
            .capacity_bytes
            .or(config.as_ref().map(|config| config.storage_capacity_bytes))
            .filter(|&bytes| bytes > 0),
    };
    if args.head_group.is_some() && layout != hicache_core::layout::HostLayout::PageUnified {
        bail!(Usage(format!("--head-group cuts page-unified pages only, not {}", layout.name())));
    }
    let unified = backends::settings(backend, &options)?.unified;
    if args.pool.is_some() && unified.is_some() {
        bail!(Usage("--pool: the unified key scheme keeps no sidecar pools (its keys name chunks of KV pages)".into()));
    }
    let head_group = args
        .head_group
        .or(config.as_ref().and_then(|config| config.head_group))
        .or(unified.and_then(|agreements| agreements.head_group).map(|group| group as usize));
    let head_groups = HiCacheConfig { mem_layout: layout, head_group, ..HiCacheConfig::default() }
        .head_groups(&geometry)
        .map_err(|error| Usage(format!("the page's head groups: {error}")))?;
    namespace.head_groups = head_groups;
    Ok(Target { backend, namespace, options, page_bytes })
}

pub(super) fn keys(args: &KeysArgs, page_size: usize) -> anyhow::Result<Vec<PageKey>> {
    let keys = match &args.tokens {
        Some(path) => {
            let text = crate::input::read_text(Some(path), "token file", crate::input::TOKENS_LIMIT)?;
            let tokens = parse_tokens(&text).with_context(|| format!("reading tokens from {}", path.display()))?;
            let prior = args.prior.as_deref().map(str::parse::<PageKey>).transpose().context("--prior")?;
            PageHasher::new().page_keys(&tokens, page_size, prior, args.partial.into())?
        }
        None => args
            .keys
            .iter()
            .map(|key| key.parse::<PageKey>().with_context(|| format!("--key {key}")))
            .collect::<anyhow::Result<_>>()?,
    };
    if keys.is_empty() {
        bail!(Usage("no pages named: give --key HEX (repeatable) or --tokens FILE".into()));
    }
    Ok(keys)
}

/// The bytes of `pages` pages of `page_bytes` from `input` (the flag `flag`), which must hold exactly that many.
pub(super) fn read_pages(input: &Path, flag: &str, pages: usize, page_bytes: usize) -> anyhow::Result<Vec<u8>> {
    let expected = crate::memory::product(&[pages as u64, page_bytes as u64]);
    crate::memory::require(expected, "the pages given × --page-size (and the geometry)")?;
    let expected = expected.expect("required above");
    let cannot_read = |error: std::io::Error| Usage(format!("cannot read {flag} {}: {error}", input.display()));
    let file = std::fs::File::open(input).map_err(cannot_read)?;
    // a regular file's length is known before reading it; a device or a pipe is read to at most one byte more than
    // the pages take, so one that never ends (/dev/zero) stops there
    let length = match file.metadata().map_err(cannot_read)? {
        metadata if metadata.is_file() => Some(metadata.len()),
        _ => None,
    };
    let mut bytes = Vec::new();
    if length.is_none_or(|length| length == expected) {
        std::io::Read::read_to_end(&mut std::io::Read::take(file, expected + 1), &mut bytes).map_err(cannot_read)?;
    }
    let found = length.unwrap_or(bytes.len() as u64);
    if found != expected || bytes.len() as u64 != expected {
        let shown =
            if found > expected && length.is_none() { format!("more than {expected}") } else { found.to_string() };
        bail!(Usage(format!(
            "{flag} {} has {shown} bytes; {} of {page_bytes} bytes are {expected}",
            input.display(),
            plural(pages, "page"),
        )));
    }
    Ok(bytes)
}

/// `count` and `noun`, plural unless the count is 1.
pub(super) fn plural(count: usize, noun: &str) -> String {
    if count == 1 { format!("1 {noun}") } else { format!("{count} {noun}s") }
}

/// `--entry-objects`: one value (clap would take a `Vec` for values given one by one).
#[derive(Clone, Debug)]
struct EntryObjects(Vec<EntryObject>);

/// `--entry-objects`: `NAME:BYTES[:stage]`, comma separated.
fn parse_entry_objects(text: &str) -> Result<EntryObjects, String> {
    text.split(',')
        .map(|item| {
            let mut fields = item.split(':');
            let (Some(name), Some(bytes)) = (fields.next(), fields.next()) else {
                return Err(format!("{item:?} is not NAME:BYTES or NAME:BYTES:stage"));
            };
            let bytes = bytes.parse().map_err(|_| format!("{item:?}: {bytes:?} is not a number of bytes"))?;
            let per_rank = match fields.next() {
                None => true,
                Some("stage") => false,
                Some(other) => return Err(format!("{item:?}: {other:?} is not `stage`")),
            };
            if fields.next().is_some() {
                return Err(format!("{item:?} is not NAME:BYTES or NAME:BYTES:stage"));
            }
            Ok(EntryObject { name: name.to_owned(), bytes, per_rank })
        })
        .collect::<Result<_, _>>()
        .map(EntryObjects)
}
