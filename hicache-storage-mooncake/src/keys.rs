//! Object keys: a page is one object per part (K and V for MHA, the latent for MLA), each part the contiguous half
//! (or the whole) of the flat page, so page-first host pools move each object straight from and into the pool.
//!
//! Two schemes:
//!
//! * **native** (default): `{hash}_{digest}_k` and `_v` (MHA), `{hash}_{digest}` (MLA), where the digest names the
//!   whole namespace (model, geometry, dtype, layout, page size, ranks), so deployments that differ in any of them
//!   never read each other's bytes;
//! * **sglang**: the keys SGLang's own Mooncake backend writes, so an SGLang deployment and hicache share one store.
//!   They changed between releases, so the release is named:
//!   * `0.5.2`: MHA `{hash}_{tp_rank}_k` / `_v`, MLA `{hash}_k` (no model, no pipeline stage);
//!   * `0.5.23`: a prefix of the optional backend tag and the model name (`/` → `-`) joined by `_`, then `_{hash}`;
//!     MHA `{prefix}_{hash}_{tp_rank}_k` / `_v` (`_{tp_rank}_{pp_rank}_k` with pipeline stages), MLA
//!     `{prefix}_{hash}__k` (an empty rank between the underscores; `_{pp_rank}_k` with stages). Without a tag and a
//!     model there is no prefix.

use hicache_core::Error;
use hicache_core::hash::PageKey;
use hicache_core::namespace::{ObjectPart, StorageNamespace, native_key_with_digest};
use hicache_core::storage::tiers::PageObjects;

/// The SGLang release whose Mooncake keys are used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SglangRelease {
    /// 0.5.2 (and the releases before the model-name prefix).
    V0_5_2,
    /// 0.5.23 (model-name prefix, backend tag, pipeline-stage suffixes).
    V0_5_23,
}

impl SglangRelease {
    /// The release as written in configs.
    pub const fn name(self) -> &'static str {
        match self {
            Self::V0_5_2 => "0.5.2",
            Self::V0_5_23 => "0.5.23",
        }
    }

    /// Parses a release name.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `sglang_release` and the releases known.
    pub fn parse(text: &str) -> Result<Self, Error> {
        match text {
            "0.5.2" => Ok(Self::V0_5_2),
            "0.5.23" => Ok(Self::V0_5_23),
            other => Err(Error::InvalidArgument {
                field: "sglang_release",
                reason: format!("{other:?} is not a known SGLang key scheme; known: 0.5.2, 0.5.23"),
            }),
        }
    }
}

/// How object keys are written.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum KeyScheme {
    /// hicache's namespaced keys.
    #[default]
    Native,
    /// SGLang's keys, as its given release writes them.
    Sglang {
        /// The release.
        release: SglangRelease,
        /// SGLang's `extra_backend_tag` (0.5.23 prefixes it to every key).
        tag: Option<String>,
    },
}

/// The keys of one namespace under one scheme.
#[derive(Clone, Debug)]
pub(crate) struct KeyRenderer {
    /// Text before the hash (with its separator), e.g. `model_`.
    before: String,
    /// One suffix per object of a page's bytes, e.g. `_{digest}_k`.
    suffixes: Vec<String>,
    /// Per object of a page's bytes, where its bytes lie in the flat page.
    parts: Vec<std::ops::Range<usize>>,
    /// Native keys: the suffix of a page's checksum object (`_{digest}_sum`), put beside its bytes' objects.
    checksum: Option<String>,
    /// The regular expression that matches exactly this namespace's keys (for `clear`).
    pattern: String,
}

impl KeyRenderer {
    /// The renderer for `namespace` under `scheme`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the scheme cannot name this namespace's pages apart from another's
    /// (SGLang 0.5.2's keys have no pipeline stage).
    pub(crate) fn new(scheme: &KeyScheme, namespace: &StorageNamespace) -> Result<Self, Error> {
        let mla = namespace.geometry.is_mla();
        let page_bytes = namespace.page_bytes();
        let sglang_objects = match (&namespace.sidecar, scheme) {
            (Some(sidecar), KeyScheme::Sglang { release: SglangRelease::V0_5_2, .. }) => {
                return Err(Error::InvalidArgument {
                    field: "sglang_release",
                    reason: format!(
                        "SGLang 0.5.2 keeps no sidecar pools of hybrid models (pool `{}`); use the 0.5.23 scheme or \
                         the native one",
                        sidecar.pool
                    ),
                });
            }
            (Some(sidecar), KeyScheme::Sglang { .. }) if sidecar.objects.is_empty() => {
                return Err(Error::InvalidArgument {
                    field: "key_scheme",
                    reason: format!(
                        "SGLang's Mooncake keys cut an entry of pool `{}` into one object per buffer of its host \
                         pool, and it was opened without them (the Python package reads them from the pool; the \
                         CLI takes --entry-objects); or use the native key scheme",
                        sidecar.pool
                    ),
                });
            }
            (Some(sidecar), KeyScheme::Sglang { .. }) => Some(sidecar.objects.clone()),
            _ => None,
        };
        let (before, suffixes, checksum) = match scheme {
            KeyScheme::Native => {
                let digest = namespace.digest();
                // a sidecar pool's entry is one object, as the latent of an MLA page is
                let whole = mla || namespace.sidecar.is_some();
                let parts: &[ObjectPart] = if whole { &[ObjectPart::Page] } else { &[ObjectPart::K, ObjectPart::V] };
                // the suffix is what follows the hash in the native key
                let hash_len = PageKey::from_bytes([0; 32]).to_string().len();
                let suffix =
                    |part| native_key_with_digest(&PageKey::from_bytes([0; 32]), &digest, part)[hash_len..].to_owned();
                let suffixes = parts.iter().map(|&part| suffix(part)).collect();
                (String::new(), suffixes, Some(format!("{}_sum", suffix(ObjectPart::Page))))
            }
            KeyScheme::Sglang { release: SglangRelease::V0_5_2, .. } => {
                if namespace.pp_size > 1 {
                    return Err(Error::InvalidArgument {
                        field: "sglang_release",
                        reason: format!(
                            "SGLang 0.5.2's Mooncake keys have no pipeline stage, so the {} stages would overwrite \
                             each other's pages; use the 0.5.23 scheme or the native one",
                            namespace.pp_size
                        ),
                    });
                }
                let suffixes = if mla {
                    vec!["_k".into()]
                } else {
                    vec![format!("_{}_k", namespace.tp_rank), format!("_{}_v", namespace.tp_rank)]
                };
                (String::new(), suffixes, None)
            }
            KeyScheme::Sglang { release: SglangRelease::V0_5_23, tag } => {
                let model = namespace.sglang_model();
                let prefix: Vec<&str> =
                    tag.iter().map(String::as_str).chain((!model.is_empty()).then_some(model.as_str())).collect();
                let before = if prefix.is_empty() { String::new() } else { format!("{}_", prefix.join("_")) };
                let staged = namespace.pp_size > 1;
                // SGLang's `mha_suffix` (the TP rank, and the stage with stages) and `mla_suffix` (the stage only)
                let per_rank = if staged {
                    format!("{}_{}", namespace.tp_rank, namespace.pp_rank)
                } else {
                    namespace.tp_rank.to_string()
                };
                let shared = if staged { namespace.pp_rank.to_string() } else { String::new() };
                let suffixes = if let Some(objects) = &sglang_objects {
                    objects
                        .iter()
                        .map(|object| {
                            let rank = if object.per_rank { &per_rank } else { &shared };
                            format!("_{rank}_{}", object.name)
                        })
                        .collect()
                } else if mla {
                    vec![format!("_{shared}_k")]
                } else {
                    vec![format!("_{per_rank}_k"), format!("_{per_rank}_v")]
                };
                (before, suffixes, None)
            }
        };
        let alternatives: Vec<String> = suffixes.iter().chain(&checksum).map(|suffix| escape_regex(suffix)).collect();
        let pattern = format!("^{}[0-9a-f]{{64}}({})$", escape_regex(&before), alternatives.join("|"));
        // a part's place in the page: SGLang's objects of a sidecar entry one after another, else equal cuts
        let parts = match &sglang_objects {
            Some(objects) => objects.iter().map(|object| object.bytes).collect(),
            None => vec![page_bytes / suffixes.len(); suffixes.len()],
        };
        let parts = parts
            .iter()
            .scan(0, |offset, &bytes| {
                *offset += bytes;
                Some(*offset - bytes..*offset)
            })
            .collect();
        Ok(Self { before, suffixes, parts, checksum, pattern })
    }

    /// How a page's objects are named, for a router: the prefix before `_` and the hash, and the suffixes.
    pub(crate) fn page_objects(&self) -> PageObjects {
        PageObjects {
            key_prefix: self.before.strip_suffix('_').map(str::to_owned),
            suffixes: self.suffixes.iter().chain(&self.checksum).cloned().collect(),
        }
    }

    /// Objects of a page's bytes.
    pub(crate) fn parts(&self) -> usize {
        self.suffixes.len()
    }

    /// Where part `part`'s bytes lie in the flat page.
    pub(crate) fn part(&self, part: usize) -> std::ops::Range<usize> {
        self.parts[part].clone()
    }

    /// Whether each page has a checksum object (after its parts).
    pub(crate) fn checksummed(&self) -> bool {
        self.checksum.is_some()
    }

    /// Objects per page: its parts, then its checksum's.
    pub(crate) fn objects(&self) -> usize {
        self.parts() + usize::from(self.checksummed())
    }

    /// The key of object `object` of page `key`: a part, or (at [`parts`](Self::parts)) the checksum.
    pub(crate) fn object_key(&self, key: &PageKey, object: usize) -> String {
        let suffix = self.suffixes.get(object).or(self.checksum.as_ref()).expect("an object of the page");
        format!("{}{key}{suffix}", self.before)
    }

    /// A regular expression (ECMAScript, as Mooncake's `remove_by_regex` takes) matching exactly this namespace's
    /// object keys.
    pub(crate) fn pattern(&self) -> &str {
        &self.pattern
    }
}

/// `text` with every ECMAScript regular-expression metacharacter escaped.
fn escape_regex(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for character in text.chars() {
        if "\\^$.|?*+()[]{}".contains(character) {
            escaped.push('\\');
        }
        escaped.push(character);
    }
    escaped
}

#[cfg(test)]
mod tests {
    use hicache_core::geometry::{KvDtype, KvGeometry};
    use hicache_core::hash::page_key;
    use hicache_core::layout::HostLayout;
    use hicache_core::namespace::EntryObject;

    use super::*;

    fn namespace(mla: bool, tp_rank: usize, pp: (usize, usize)) -> StorageNamespace {
        let geometry = if mla {
            KvGeometry::mla(2, 16, 8, KvDtype::Bf16).unwrap()
        } else {
            KvGeometry::mha(2, 2, 8, KvDtype::Bf16).unwrap()
        };
        StorageNamespace {
            tp_rank,
            tp_size: 4,
            pp_rank: pp.0,
            pp_size: pp.1,
            ..StorageNamespace::single_rank("org/Model-7B", geometry, HostLayout::PageFirst, 16)
        }
    }

    fn keys(scheme: &KeyScheme, namespace: &StorageNamespace, key: &PageKey) -> Vec<String> {
        let renderer = KeyRenderer::new(scheme, namespace).unwrap();
        (0..renderer.objects()).map(|object| renderer.object_key(key, object)).collect()
    }

    #[test]
    fn sglang_keys_by_release() {
        let key = page_key(None, &[1, 2, 3]);
        let hash = key.to_string();
        let old = KeyScheme::Sglang { release: SglangRelease::V0_5_2, tag: None };
        assert_eq!(keys(&old, &namespace(false, 3, (0, 1)), &key), [format!("{hash}_3_k"), format!("{hash}_3_v")]);
        assert_eq!(keys(&old, &namespace(true, 3, (0, 1)), &key), [format!("{hash}_k")]);
        let new = KeyScheme::Sglang { release: SglangRelease::V0_5_23, tag: None };
        assert_eq!(
            keys(&new, &namespace(false, 3, (0, 1)), &key),
            [format!("org-Model-7B_{hash}_3_k"), format!("org-Model-7B_{hash}_3_v")]
        );
        assert_eq!(keys(&new, &namespace(true, 3, (0, 1)), &key), [format!("org-Model-7B_{hash}__k")]);
        assert_eq!(
            keys(&new, &namespace(false, 3, (1, 2)), &key),
            [format!("org-Model-7B_{hash}_3_1_k"), format!("org-Model-7B_{hash}_3_1_v")]
        );
        assert_eq!(keys(&new, &namespace(true, 3, (1, 2)), &key), [format!("org-Model-7B_{hash}_1_k")]);
        let tagged = KeyScheme::Sglang { release: SglangRelease::V0_5_23, tag: Some("blue".into()) };
        assert_eq!(keys(&tagged, &namespace(true, 0, (0, 1)), &key), [format!("blue_org-Model-7B_{hash}__k")]);
        let mut anonymous = namespace(false, 0, (0, 1));
        anonymous.model.clear();
        assert_eq!(keys(&new, &anonymous, &key), [format!("{hash}_0_k"), format!("{hash}_0_v")]);
    }

    #[test]
    fn native_keys_are_the_cores() {
        let key = page_key(None, &[9]);
        for mla in [false, true] {
            let ns = namespace(mla, 1, (0, 1));
            let mut expected: Vec<String> = if mla {
                vec![ns.native_key(&key, ObjectPart::Page)]
            } else {
                vec![ns.native_key(&key, ObjectPart::K), ns.native_key(&key, ObjectPart::V)]
            };
            // and the page's checksum, beside its bytes
            expected.push(format!("{}_sum", ns.native_key(&key, ObjectPart::Page)));
            assert_eq!(keys(&KeyScheme::Native, &ns, &key), expected);
        }
    }

    #[test]
    fn a_router_rebuilds_every_object_key_from_the_page_objects() {
        let key = page_key(None, &[4, 5]);
        let schemes = [
            KeyScheme::Native,
            KeyScheme::Sglang { release: SglangRelease::V0_5_2, tag: None },
            KeyScheme::Sglang { release: SglangRelease::V0_5_23, tag: None },
            KeyScheme::Sglang { release: SglangRelease::V0_5_23, tag: Some("blue".into()) },
        ];
        for scheme in &schemes {
            for (mla, rank, pp) in [(false, 2, (0, 1)), (true, 1, (0, 1)), (false, 3, (1, 2)), (true, 0, (1, 2))] {
                let Ok(renderer) = KeyRenderer::new(scheme, &namespace(mla, rank, pp)) else { continue };
                let objects = renderer.page_objects();
                let rebuilt: Vec<String> = objects
                    .suffixes
                    .iter()
                    .map(|suffix| match &objects.key_prefix {
                        Some(prefix) => format!("{prefix}_{key}{suffix}"),
                        None => format!("{key}{suffix}"),
                    })
                    .collect();
                assert_eq!(rebuilt, keys(scheme, &namespace(mla, rank, pp), &key), "{scheme:?} mla={mla}");
            }
        }
    }

    #[test]
    fn sglang_0_5_2_refuses_pipeline_stages() {
        let old = KeyScheme::Sglang { release: SglangRelease::V0_5_2, tag: None };
        let error = KeyRenderer::new(&old, &namespace(false, 0, (1, 2))).unwrap_err();
        assert!(error.to_string().contains("sglang_release"), "{error}");
    }

    /// A sidecar pool's entry is one object of its own namespace under the native scheme (never one of the KV's
    /// objects, whatever the attention). SGLang's 0.5.23 keys need the entry's objects (refused naming the key
    /// scheme without them); 0.5.2 kept no sidecar pools.
    #[test]
    fn a_sidecar_entry_is_one_native_object_and_sglang_schemes_need_its_objects() {
        let key = page_key(None, &[1, 2, 3]);
        for mla in [false, true] {
            let kv = namespace(mla, 1, (0, 1));
            let mamba = kv.sidecar("mamba", 4096).unwrap();
            let renderer = KeyRenderer::new(&KeyScheme::Native, &mamba).unwrap();
            assert_eq!(renderer.parts(), 1);
            assert_eq!(renderer.part(0), 0..4096);
            assert_eq!(renderer.object_key(&key, 0), format!("{key}_{}", mamba.digest()));
            let kv_keys = KeyRenderer::new(&KeyScheme::Native, &kv).unwrap();
            assert!((0..kv_keys.parts()).all(|part| kv_keys.object_key(&key, part) != renderer.object_key(&key, 0)));
            let error =
                |release| KeyRenderer::new(&KeyScheme::Sglang { release, tag: None }, &mamba).unwrap_err().to_string();
            let without = error(SglangRelease::V0_5_23);
            assert!(without.starts_with("key_scheme:") && without.contains("mamba"), "{without}");
            let old = error(SglangRelease::V0_5_2);
            assert!(old.starts_with("sglang_release:") && old.contains("mamba"), "{old}");
        }
    }

    /// Under SGLang 0.5.23's keys a sidecar entry is the objects its host pool's buffers make, each named after
    /// the rank as SGLang's `_get_hybrid_page_component_keys` names it (`mha_suffix` for pools every rank holds
    /// its own shard of, `mla_suffix` else), each part at its place in the flat entry.
    #[test]
    fn sglang_names_a_sidecar_entrys_objects_after_the_rank() {
        let key = page_key(None, &[4, 5, 6]);
        let object = |name: &str, bytes, per_rank| EntryObject { name: name.into(), bytes, per_rank };
        let scheme = KeyScheme::Sglang { release: SglangRelease::V0_5_23, tag: Some("blue".into()) };
        let mamba = vec![object("temporal", 3000, true), object("conv_0", 1000, true), object("conv_1", 96, true)];
        let indexer = vec![object("indexer", 528, false)];
        let swa = vec![object("swa_k", 256, true), object("swa_v", 256, true)];
        let cases = [
            // (MLA, rank, stages, pool, objects, suffixes)
            (false, 1, (0, 1), "mamba", mamba.clone(), vec!["_1_temporal", "_1_conv_0", "_1_conv_1"]),
            (true, 3, (1, 2), "mamba", mamba, vec!["_3_1_temporal", "_3_1_conv_0", "_3_1_conv_1"]),
            (true, 3, (0, 1), "indexer", indexer.clone(), vec!["__indexer"]),
            (true, 3, (1, 2), "indexer", indexer, vec!["_1_indexer"]),
            (false, 2, (0, 1), "swa", swa, vec!["_2_swa_k", "_2_swa_v"]),
        ];
        for (mla, rank, stages, pool, objects, suffixes) in cases {
            let bytes = objects.iter().map(|object| object.bytes).sum();
            let sidecar =
                namespace(mla, rank, stages).sidecar(pool, bytes).unwrap().with_entry_objects(objects.clone()).unwrap();
            let renderer = KeyRenderer::new(&scheme, &sidecar).unwrap();
            let want: Vec<String> = suffixes.iter().map(|suffix| format!("blue_org-Model-7B_{key}{suffix}")).collect();
            assert_eq!(keys(&scheme, &sidecar, &key), want, "{pool}");
            assert!(!renderer.checksummed());
            let mut at = 0;
            for (part, object) in objects.iter().enumerate() {
                assert_eq!(renderer.part(part), at..at + object.bytes);
                at += object.bytes;
            }
        }
    }

    #[test]
    fn patterns_escape_the_prefix() {
        let scheme = KeyScheme::Sglang { release: SglangRelease::V0_5_23, tag: Some("a.b".into()) };
        let renderer = KeyRenderer::new(&scheme, &namespace(false, 2, (0, 1))).unwrap();
        assert_eq!(renderer.pattern(), r"^a\.b_org-Model-7B_[0-9a-f]{64}(_2_k|_2_v)$");
    }
}
