//! Storage key namespaces: SGLang's key strings for each backend, and hicache's native namespaced keys.
//!
//! SGLang's keys are the page hash plus a backend-specific suffix (docs/sglang.md#zero-copy-meta, #backends). They omit
//! the KV dtype, the host layout (which decides the byte order of a generic flat page), the page size and the pipeline
//! stage, so two deployments that differ in any of these read each other's bytes as their own
//! (docs/sglang.md#fixed-10). The native form adds a digest of all of them to every key;
//! [`StorageNamespace::descriptor`] is the readable text behind the digest.

use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use crate::error::Error;
use crate::geometry::{Attention, KvGeometry};
use crate::hash::PageKey;
use crate::layout::{HostLayout, HostLayoutMap};

/// Which object of a page a key names, for backends that store K and V apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ObjectPart {
    /// The whole flat page.
    Page,
    /// The K half of an MHA page.
    K,
    /// The V half of an MHA page.
    V,
}

/// Everything that decides the bytes stored under a page key on one rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StorageNamespace {
    /// Served model name, as given (SGLang's `served_model_name`); may be empty.
    pub model: String,
    /// KV geometry of this rank.
    pub geometry: KvGeometry,
    /// Host layout (decides the generic flat page's byte order).
    pub layout: HostLayout,
    /// Head groups of a `page_unified` page (they decide its byte order too); 1 otherwise.
    pub head_groups: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Attention tensor-parallel rank.
    pub tp_rank: usize,
    /// Attention tensor-parallel size.
    pub tp_size: usize,
    /// Pipeline stage.
    pub pp_rank: usize,
    /// Pipeline stages.
    pub pp_size: usize,
    /// For a sidecar pool of a hybrid model (its entries under the KV pages' keys), the pool; `None` for the KV.
    pub sidecar: Option<Sidecar>,
}

/// A sidecar pool of a hybrid model: a Mamba state, a sliding window, an indexer, a draft model's KV. Its entries
/// are kept under the same page keys as the KV pages, as objects of their own.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sidecar {
    /// The pool's name, as SGLang names it (`mamba`, `swa`, `indexer`, `draft`, ...).
    pub pool: String,
    /// Bytes of one entry (one page of the pool, flat).
    pub entry_bytes: usize,
    /// How SGLang's Mooncake store cuts an entry into objects, in the flat entry's byte order (each object's bytes
    /// follow the one before it); empty where it was not said. Only key schemes that name SGLang's objects use it:
    /// the bytes stored are the same either way, so it is not part of the [digest](StorageNamespace::digest).
    pub objects: Vec<EntryObject>,
}

/// How SGLang 0.5.23's Mooncake store cuts an entry of the sidecar pool `pool` (`entry_bytes`) into objects where
/// the pool's name and the KV's attention tell (its `_get_hybrid_page_component_keys`): a DSA indexer's or a DeepSeek
/// V4 pool's entry is one object named after the pool and the stage; a sliding window's (and a draft model's) is its
/// K and V halves per TP rank beside MHA, one object per stage beside MLA. `None` where only the host pool tells: a
/// Mamba state (a temporal buffer and conv buffers of the model's sizes), and pools SGLang's store does not keep.
/// A draft model's pool is taken to have the target's attention (EAGLE beside MHA, MTP beside MLA). What an
/// operator's tools assume where no host pool is at hand; the Python package reads the objects from the pool.
pub fn sglang_mooncake_objects(pool: &str, mla: bool, entry_bytes: usize) -> Option<Vec<EntryObject>> {
    let whole = |name: &str| vec![EntryObject { name: name.to_owned(), bytes: entry_bytes, per_rank: false }];
    let halves = |k: &str, v: &str| {
        entry_bytes.is_multiple_of(2).then(|| {
            [k, v].map(|name| EntryObject { name: name.to_owned(), bytes: entry_bytes / 2, per_rank: true }).to_vec()
        })
    };
    match pool {
        "indexer" | "draft_indexer" => Some(whole(pool)),
        _ if pool.starts_with("deepseek_v4_") => Some(whole(pool)),
        "swa" | "draft_swa" if mla => Some(whole(pool)),
        "swa" | "draft_swa" => halves(&format!("{pool}_k"), &format!("{pool}_v")),
        "draft" if mla => Some(whole("draft_k")),
        "draft" => halves("draft_k", "draft_v"),
        _ => None,
    }
}

/// One object of a sidecar pool's entry as SGLang's Mooncake store names it: the key is
/// `{hash}_{rank}_{name}`, where the rank is the tensor-parallel rank (with the stage, when there are stages) for a
/// pool each rank holds its own shard of, else only the stage (SGLang's `mha_suffix` and `mla_suffix`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EntryObject {
    /// The name after the rank: `temporal` and `conv_0` (a Mamba state), `swa_k` and `swa_v` (a sliding window of
    /// MHA), `indexer`, `draft_k`, ...
    pub name: String,
    /// Bytes of the object.
    pub bytes: usize,
    /// Whether the key carries the tensor-parallel rank (SGLang's `mha_suffix`) rather than only the stage.
    pub per_rank: bool,
}

impl StorageNamespace {
    /// A single-rank namespace (TP 1, PP 1).
    pub fn single_rank(model: impl Into<String>, geometry: KvGeometry, layout: HostLayout, page_size: usize) -> Self {
        let model = model.into();
        Self {
            model,
            geometry,
            layout,
            head_groups: 1,
            page_size,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            sidecar: None,
        }
    }

    /// The namespace of the sidecar pool `pool` of this rank's pages, whose entries are `entry_bytes` each.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `pool` when it is empty, `kv`, or not lowercase letters, digits and `_`
    /// (it goes into keys and file names), or `entry_bytes` when it is 0.
    pub fn sidecar(&self, pool: &str, entry_bytes: usize) -> Result<Self, Error> {
        let valid = |byte: u8| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'_';
        if pool.is_empty() || pool == "kv" || pool.len() > 64 || !pool.bytes().all(valid) {
            return Err(Error::InvalidArgument {
                field: "pool",
                reason: format!("{pool:?} is not a sidecar pool name (lowercase letters, digits and `_`; not `kv`)"),
            });
        }
        if entry_bytes == 0 {
            return Err(Error::InvalidArgument { field: "entry_bytes", reason: "must be at least 1".into() });
        }
        Ok(Self { sidecar: Some(Sidecar { pool: pool.to_owned(), entry_bytes, objects: Vec::new() }), ..self.clone() })
    }

    /// This sidecar pool's namespace with its entries cut into `objects` as SGLang's Mooncake store cuts them.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `objects` when this is not a sidecar pool's namespace, when the objects'
    /// bytes do not add up to one entry, or when a name is empty or not lowercase letters, digits and `_`.
    pub fn with_entry_objects(&self, objects: Vec<EntryObject>) -> Result<Self, Error> {
        let bad = |reason: String| Err(Error::InvalidArgument { field: "objects", reason });
        let Some(sidecar) = &self.sidecar else {
            return bad("only a sidecar pool's entries are cut into objects".into());
        };
        let valid = |byte: u8| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'_';
        if let Some(object) = objects
            .iter()
            .find(|object| object.name.is_empty() || object.name.len() > 64 || !object.name.bytes().all(valid))
        {
            return bad(format!("{:?} is not an object name (lowercase letters, digits and `_`)", object.name));
        }
        if let Some(object) = objects.iter().find(|object| object.bytes == 0) {
            return bad(format!("object `{}` has no bytes", object.name));
        }
        let total = objects.iter().try_fold(0usize, |sum, object| sum.checked_add(object.bytes));
        if !objects.is_empty() && total != Some(sidecar.entry_bytes) {
            return bad(format!(
                "the objects of pool `{}` add up to {} bytes, not one entry of {}",
                sidecar.pool,
                total.map_or_else(|| "more than usize::MAX".to_owned(), |total| total.to_string()),
                sidecar.entry_bytes
            ));
        }
        let sidecar = Sidecar { objects, ..sidecar.clone() };
        Ok(Self { sidecar: Some(sidecar), ..self.clone() })
    }

    /// Bytes of one object of the namespace: a KV page, or a sidecar pool's entry.
    pub fn page_bytes(&self) -> usize {
        match &self.sidecar {
            Some(sidecar) => sidecar.entry_bytes,
            None => self.geometry.bytes_per_page(self.page_size),
        }
    }

    /// Whether each tensor-parallel rank holds objects of its own: the KV of MHA, and a Mamba state whatever the
    /// attention (SGLang keeps the state sharded by rank even where MLA's latent is the same on every rank).
    pub fn per_rank(&self) -> bool {
        !self.geometry.is_mla() || self.sidecar.as_ref().is_some_and(|sidecar| sidecar.pool == "mamba")
    }

    /// Checks ranks against sizes and the page size.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the field.
    pub fn validated(self) -> Result<Self, Error> {
        let bad = |field: &'static str, reason: String| Err(Error::InvalidArgument { field, reason });
        if self.page_size == 0 {
            return bad("page_size", "must be at least 1".into());
        }
        if self.tp_rank >= self.tp_size {
            return bad("tp_rank", format!("{} is not below tp_size {}", self.tp_rank, self.tp_size));
        }
        if self.pp_rank >= self.pp_size {
            return bad("pp_rank", format!("{} is not below pp_size {}", self.pp_rank, self.pp_size));
        }
        self.geometry.validated()?;
        if let Some(sidecar) = &self.sidecar {
            self.sidecar(&sidecar.pool, sidecar.entry_bytes)?.with_entry_objects(sidecar.objects.clone())?;
        }
        if self.geometry.checked_bytes_per_page(self.page_size).is_none() {
            return bad(
                "page_size",
                format!("{} tokens of {} bytes overflow a page", self.page_size, self.geometry.bytes_per_token()),
            );
        }
        Ok(self)
    }

    /// SGLang's model name in keys: `/` replaced by `-`.
    pub fn sglang_model(&self) -> String {
        self.model.replace('/', "-")
    }

    /// [`sglang_model`](Self::sglang_model), checked for use in a file name (file-like backends).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `model` when it holds a NUL byte or is over 128 bytes.
    pub fn file_name_model(&self) -> Result<String, Error> {
        let model = self.sglang_model();
        if model.contains('\0') || model.len() > 128 {
            return Err(Error::InvalidArgument {
                field: "model",
                reason: format!("{:?} cannot be part of a file name (NUL byte, or over 128 bytes)", self.model),
            });
        }
        Ok(model)
    }

    /// The canonical text of the namespace, one `key=value` per field, fixed order.
    ///
    /// MLA drops the TP rank and size: the latent is identical on every TP rank, so all ranks share objects (as
    /// SGLang's MLA keys do).
    pub fn descriptor(&self) -> String {
        let mut text = String::from("hicache-namespace-v1");
        let _ = write!(text, ";model={}", self.model);
        let _ = match self.geometry.attention {
            Attention::Mha { kv_heads, head_dim } => {
                write!(text, ";attention=mha;layers={};kv_heads={kv_heads};head_dim={head_dim}", self.geometry.layers)
            }
            Attention::Mla { kv_lora_rank, rope_dim } => write!(
                text,
                ";attention=mla;layers={};kv_lora_rank={kv_lora_rank};rope_dim={rope_dim}",
                self.geometry.layers
            ),
        };
        let _ = write!(
            text,
            ";dtype={};layout={};page_size={}",
            self.geometry.dtype.name(),
            self.layout.name(),
            self.page_size
        );
        // one group is every layout's order; only more change it (and only they change the digest)
        if self.head_groups > 1 {
            let _ = write!(text, ";head_groups={}", self.head_groups);
        }
        if self.per_rank() {
            let _ = write!(text, ";tp={}/{}", self.tp_rank, self.tp_size);
        }
        let _ = write!(text, ";pp={}/{}", self.pp_rank, self.pp_size);
        // a sidecar pool's objects are its own (the KV's descriptor is as before pools existed)
        if let Some(sidecar) = &self.sidecar {
            let _ = write!(text, ";pool={};entry_bytes={}", sidecar.pool, sidecar.entry_bytes);
        }
        text
    }

    /// Checks that this namespace holds the pages of the host pool `host` (a storage backend opened for it serving a
    /// controller over that pool), naming the first field that differs. A sidecar pool's host pool holds its entries:
    /// pages of the same tokens whose flat bytes are an entry, whatever their geometry.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `page_size`, `geometry`, `mem_layout`, `head_group` or (a sidecar pool's)
    /// `entry_bytes`.
    pub fn check_pages(&self, host: &HostLayoutMap) -> Result<(), Error> {
        let (geometry, layout, page_size) = (host.geometry(), host.layout(), host.page_size());
        let differ = |field: &'static str, theirs: String, ours: String| {
            Err(Error::InvalidArgument {
                field,
                reason: format!(
                    "the storage backend was opened for model {:?} with {theirs}, the engine's pools hold {ours}",
                    self.model
                ),
            })
        };
        if self.page_size != page_size {
            return differ("page_size", format!("pages of {} tokens", self.page_size), format!("pages of {page_size}"));
        }
        if let Some(sidecar) = &self.sidecar {
            let ours = geometry.bytes_per_page(page_size);
            if sidecar.entry_bytes != ours {
                return differ(
                    "entry_bytes",
                    format!("entries of {} bytes in pool `{}`", sidecar.entry_bytes, sidecar.pool),
                    format!("pages of {ours} bytes"),
                );
            }
            return Ok(());
        }
        if self.geometry != *geometry {
            return differ("geometry", format!("{:?}", self.geometry), format!("{geometry:?}"));
        }
        if self.layout != layout {
            return differ("mem_layout", format!("layout {}", self.layout.name()), layout.name().to_owned());
        }
        if self.head_groups != host.head_groups() {
            return differ(
                "head_group",
                format!("{} head groups per page", self.head_groups),
                format!("{}", host.head_groups()),
            );
        }
        Ok(())
    }

    /// The first 16 hex digits of SHA-256 of the [descriptor](Self::descriptor).
    pub fn digest(&self) -> String {
        hex::encode(&Sha256::digest(self.descriptor().as_bytes())[..8])
    }

    /// The native key of a page object: `{hash}_{digest}` for the whole page, `{hash}_{digest}_k|_v` for halves.
    pub fn native_key(&self, key: &PageKey, part: ObjectPart) -> String {
        native_key_with_digest(key, &self.digest(), part)
    }

    /// SGLang's file backend key (`HiCacheFile`; the file is `{dir}/{key}.bin`): `{hash}_{suffix}` (a sidecar
    /// pool's entry: `{hash}.{pool}_{suffix}`), with the [suffix](Self::sglang_file_suffix) of this rank.
    pub fn sglang_file_key(&self, key: &PageKey) -> String {
        format!("{key}{}", self.sglang_file_tail())
    }

    /// What follows the hash in SGLang's file backend key: `_{suffix}` for a KV page, `.{pool}_{suffix}` for a
    /// sidecar pool's entry (SGLang 0.5.23's `HiCacheFile` v2 names).
    pub fn sglang_file_tail(&self) -> String {
        match &self.sidecar {
            Some(sidecar) => format!(".{}_{}", sidecar.pool, self.sglang_file_suffix()),
            None => format!("_{}", self.sglang_file_suffix()),
        }
    }

    /// What follows the hash in SGLang's NIXL backend names: the file backend's `_{suffix}` for a KV page,
    /// `_{suffix}_{pool}` for a sidecar pool's whole page (SGLang 0.5.23's NIXL v2 names).
    pub fn sglang_nixl_tail(&self) -> String {
        match &self.sidecar {
            Some(sidecar) => format!("_{}_{}", self.sglang_file_suffix(), sidecar.pool),
            None => format!("_{}", self.sglang_file_suffix()),
        }
    }

    /// What SGLang's file backend puts after the hash: `{model}_{tp_rank}_{tp_size}` for MHA (and a Mamba state),
    /// `{model}` for MLA, and with pipeline stages `_{pp_size}_{pp_rank}` after either (SGLang 0.5.23; 0.5.2 left the
    /// stage out, so stages overwrote each other's pages).
    pub fn sglang_file_suffix(&self) -> String {
        let mut suffix = if !self.per_rank() {
            self.sglang_model()
        } else {
            format!("{}_{}_{}", self.sglang_model(), self.tp_rank, self.tp_size)
        };
        if self.pp_size > 1 {
            let _ = write!(suffix, "_{}_{}", self.pp_size, self.pp_rank);
        }
        suffix
    }
}

/// The native key for a precomputed namespace digest (backends compute the digest once).
pub fn native_key_with_digest(key: &PageKey, digest: &str, part: ObjectPart) -> String {
    match part {
        ObjectPart::Page => format!("{key}_{digest}"),
        ObjectPart::K => format!("{key}_{digest}_k"),
        ObjectPart::V => format!("{key}_{digest}_v"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::KvDtype;
    use crate::hash::page_key;

    fn llama(layout: HostLayout) -> StorageNamespace {
        StorageNamespace {
            tp_rank: 1,
            tp_size: 2,
            ..StorageNamespace::single_rank("meta-llama/Llama-3.1-8B", KvGeometry::llama31_8b(), layout, 64)
        }
    }

    #[test]
    fn sglang_key_strings() {
        let key = page_key(None, &[1, 2, 3]);
        let hash = key.to_string();
        let mha = llama(HostLayout::PageFirst);
        assert_eq!(mha.sglang_file_key(&key), format!("{hash}_meta-llama-Llama-3.1-8B_1_2"));
        let mla = StorageNamespace {
            tp_rank: 3,
            tp_size: 8,
            ..StorageNamespace::single_rank(
                "deepseek-ai/DeepSeek-V3",
                KvGeometry::deepseek_v3(),
                HostLayout::PageFirst,
                64,
            )
        };
        assert_eq!(mla.sglang_file_key(&key), format!("{hash}_deepseek-ai-DeepSeek-V3"));
        let staged_mla = StorageNamespace { pp_rank: 0, pp_size: 4, ..mla.clone() };
        assert_eq!(staged_mla.sglang_file_key(&key), format!("{hash}_deepseek-ai-DeepSeek-V3_4_0"));
        let staged = StorageNamespace { pp_rank: 1, pp_size: 2, ..mha.clone() };
        assert_eq!(staged.sglang_file_key(&key), format!("{hash}_meta-llama-Llama-3.1-8B_1_2_2_1"));
        let unnamed = StorageNamespace { model: String::new(), ..mha };
        assert_eq!(unnamed.sglang_file_key(&key), format!("{hash}__1_2"));
    }

    #[test]
    fn native_keys_separate_what_sglang_keys_do_not() {
        let key = page_key(None, &[7; 64]);
        let base = llama(HostLayout::LayerFirst);
        let variants = [
            StorageNamespace { layout: HostLayout::PageFirst, ..base.clone() },
            StorageNamespace { page_size: 32, ..base.clone() },
            StorageNamespace { geometry: KvGeometry { dtype: KvDtype::Fp8E4m3, ..base.geometry }, ..base.clone() },
            StorageNamespace { tp_rank: 0, ..base.clone() },
            StorageNamespace { tp_size: 4, ..base.clone() },
            StorageNamespace { pp_rank: 1, pp_size: 2, ..base.clone() },
            StorageNamespace { model: "other".into(), ..base.clone() },
        ];
        for variant in &variants {
            assert_eq!(
                base.sglang_file_key(&key) == variant.sglang_file_key(&key),
                variant.tp_rank == base.tp_rank
                    && variant.tp_size == base.tp_size
                    && variant.pp_size == base.pp_size
                    && variant.model == base.model
            );
            assert_ne!(
                base.native_key(&key, ObjectPart::Page),
                variant.native_key(&key, ObjectPart::Page),
                "{}",
                variant.descriptor()
            );
        }
        assert_eq!(
            base.descriptor(),
            "hicache-namespace-v1;model=meta-llama/Llama-3.1-8B;attention=mha;layers=32;kv_heads=8;head_dim=128;dtype=bf16;layout=layer_first;page_size=64;tp=1/2;pp=0/1"
        );
        let native = base.native_key(&key, ObjectPart::K);
        assert_eq!(native, format!("{key}_{}_k", base.digest()));
        assert_eq!(base.digest().len(), 16);
    }

    #[test]
    fn mla_ranks_share_native_keys_and_ranges_are_checked() {
        let rank = |tp_rank| StorageNamespace {
            tp_rank,
            tp_size: 8,
            ..StorageNamespace::single_rank("m", KvGeometry::deepseek_v3(), HostLayout::PageFirst, 64)
        };
        assert_eq!(rank(0).digest(), rank(5).digest());
        assert!(rank(8).validated().unwrap_err().to_string().starts_with("tp_rank: 8 is not below tp_size 8"));
        assert!(StorageNamespace { pp_size: 1, pp_rank: 1, ..rank(0) }.validated().is_err());
    }

    /// An entry's objects must add up to it, with names fit for keys, and never change the digest (the bytes stored
    /// are the same however SGLang names them).
    #[test]
    fn entry_objects_add_up_to_the_entry_and_keep_the_digest() {
        let mamba = llama(HostLayout::PageFirst).sidecar("mamba", 3000).unwrap();
        let object = |name: &str, bytes| EntryObject { name: name.into(), bytes, per_rank: true };
        let cut = mamba.with_entry_objects(vec![object("temporal", 2000), object("conv_0", 1000)]).unwrap();
        assert_eq!(cut.digest(), mamba.digest());
        assert_eq!(cut.validated().unwrap().sidecar.unwrap().objects.len(), 2);
        let error = |objects| mamba.with_entry_objects(objects).unwrap_err().to_string();
        assert_eq!(
            error(vec![object("temporal", 2000), object("conv_0", 999)]),
            "objects: the objects of pool `mamba` add up to 2999 bytes, not one entry of 3000"
        );
        assert!(error(vec![object("Conv", 3000)]).starts_with("objects: \"Conv\" is not an object name"));
        assert!(error(vec![object("temporal", 3000), object("conv_0", 0)]).contains("`conv_0` has no bytes"));
        assert!(error(vec![object("a", usize::MAX), object("b", 2)]).contains("more than usize::MAX"));
        let kv = llama(HostLayout::PageFirst).with_entry_objects(vec![object("k", 1)]).unwrap_err();
        assert!(kv.to_string().starts_with("objects: only a sidecar pool's entries"));
    }

    /// A sidecar pool's host pool holds its entries in a geometry of its own (a DSA indexer's 132 bytes per token and
    /// layer): its namespace serves a pool whose pages are entries of its size, of the KV's page size, and no other.
    #[test]
    fn a_sidecar_namespace_serves_a_host_pool_of_its_entries() {
        let kv = llama(HostLayout::PageFirst);
        let indexer_geometry = KvGeometry::mla(32, 128, 4, KvDtype::Fp8E4m3).unwrap();
        let entry = indexer_geometry.bytes_per_page(64);
        let pool = |geometry, page_size| HostLayoutMap::new(geometry, HostLayout::LayerFirst, page_size, 4).unwrap();
        kv.sidecar("indexer", entry).unwrap().check_pages(&pool(indexer_geometry, 64)).unwrap();
        let error = kv.sidecar("indexer", entry + 1).unwrap().check_pages(&pool(indexer_geometry, 64)).unwrap_err();
        assert!(error.to_string().starts_with("entry_bytes: "), "{error}");
        assert!(error.to_string().contains(&format!("pages of {entry} bytes")), "{error}");
        let error = kv.sidecar("indexer", entry).unwrap().check_pages(&pool(indexer_geometry, 32)).unwrap_err();
        assert!(error.to_string().starts_with("page_size: "), "{error}");
        // the KV's own namespace still wants the KV's geometry
        let error = kv.check_pages(&pool(indexer_geometry, 64)).unwrap_err();
        assert!(error.to_string().starts_with("geometry: "), "{error}");
    }

    /// Without a host pool at hand, SGLang's cut is told by the pool's name and the attention where it can be: the
    /// objects its `_get_hybrid_page_component_keys` names, every byte of the entry in one of them.
    #[test]
    fn sglang_cuts_are_told_by_the_pool_and_the_attention_where_they_can_be() {
        let cut = |pool, mla, bytes| {
            sglang_mooncake_objects(pool, mla, bytes)
                .map(|objects| objects.into_iter().map(|object| (object.name, object.bytes, object.per_rank)).collect())
        };
        let named = |objects: &[(&str, usize, bool)]| -> Option<Vec<(String, usize, bool)>> {
            Some(objects.iter().map(|&(name, bytes, per_rank)| (name.to_owned(), bytes, per_rank)).collect())
        };
        assert_eq!(cut("indexer", true, 528), named(&[("indexer", 528, false)]));
        assert_eq!(cut("deepseek_v4_c4_rope", true, 64), named(&[("deepseek_v4_c4_rope", 64, false)]));
        assert_eq!(cut("swa", false, 96), named(&[("swa_k", 48, true), ("swa_v", 48, true)]));
        assert_eq!(cut("swa", true, 96), named(&[("swa", 96, false)]));
        assert_eq!(cut("draft", false, 64), named(&[("draft_k", 32, true), ("draft_v", 32, true)]));
        assert_eq!(cut("draft", true, 64), named(&[("draft_k", 64, false)]));
        assert_eq!(cut("draft_swa", false, 8), named(&[("draft_swa_k", 4, true), ("draft_swa_v", 4, true)]));
        // a Mamba state's buffers, a K/V pair of odd bytes and an unknown pool are for the host pool to tell
        assert_eq!(cut("mamba", false, 3000), None);
        assert_eq!(cut("swa", false, 97), None);
        assert_eq!(cut("auxiliary_swa", false, 96), None);
    }
}
