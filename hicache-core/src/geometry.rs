//! KV geometry: how many bytes one token of one layer takes, for MHA and MLA models (docs/sglang.md#sizes).
//!
//! An *item* is one token × one layer × K or V (MHA) or one token × one layer of latent (MLA): the unit the transfer
//! kernels move (SGLang's `token_stride_size`). Everything here is for the layers and KV heads held by this rank.

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Element type of the KV cache as stored (FP8 caches are stored as one byte per element).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    /// bfloat16
    Bf16,
    /// IEEE half
    F16,
    /// IEEE single
    F32,
    /// FP8 E4M3
    Fp8E4m3,
    /// FP8 E5M2
    Fp8E5m2,
}

impl KvDtype {
    /// Bytes per element.
    pub const fn bytes(self) -> usize {
        match self {
            Self::Bf16 | Self::F16 => 2,
            Self::F32 => 4,
            Self::Fp8E4m3 | Self::Fp8E5m2 => 1,
        }
    }

    /// The name used in configs and namespaces.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::F32 => "f32",
            Self::Fp8E4m3 => "fp8_e4m3",
            Self::Fp8E5m2 => "fp8_e5m2",
        }
    }
}

/// Attention kind and its per-layer, per-token shape on this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Attention {
    /// Multi-head (or grouped-query) attention: separate K and V of `kv_heads × head_dim` each.
    Mha {
        /// KV heads on this rank.
        kv_heads: usize,
        /// Elements per head.
        head_dim: usize,
    },
    /// Multi-head latent attention: one latent vector of `kv_lora_rank + rope_dim`, identical on every TP rank.
    Mla {
        /// Compressed KV width.
        kv_lora_rank: usize,
        /// Rotary part width (`qk_rope_head_dim`).
        rope_dim: usize,
    },
}

/// Which tensor of a layer an item belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvPart {
    /// MHA keys.
    K,
    /// MHA values.
    V,
    /// MLA latent.
    Latent,
}

impl KvPart {
    /// Index of the part in the buffers' leading K/V dimension (0 for K and latent, 1 for V).
    pub const fn index(self) -> usize {
        match self {
            Self::K | Self::Latent => 0,
            Self::V => 1,
        }
    }
}

/// The KV shape of a model on one rank: layers, attention shape and dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvGeometry {
    /// Layers held by this rank (the local pipeline stage's layers).
    pub layers: usize,
    /// Attention shape.
    pub attention: Attention,
    /// Stored element type.
    pub dtype: KvDtype,
}

impl KvGeometry {
    /// An MHA geometry, validated.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the first zero dimension.
    pub fn mha(layers: usize, kv_heads: usize, head_dim: usize, dtype: KvDtype) -> Result<Self, Error> {
        Self { layers, attention: Attention::Mha { kv_heads, head_dim }, dtype }.validated()
    }

    /// An MLA geometry, validated.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the first zero dimension.
    pub fn mla(layers: usize, kv_lora_rank: usize, rope_dim: usize, dtype: KvDtype) -> Result<Self, Error> {
        Self { layers, attention: Attention::Mla { kv_lora_rank, rope_dim }, dtype }.validated()
    }

    /// Llama-3.1-8B at TP 1 in bf16: 32 layers, 8 KV heads, head dim 128 (item 2 KiB, 128 KiB per token).
    pub const fn llama31_8b() -> Self {
        Self { layers: 32, attention: Attention::Mha { kv_heads: 8, head_dim: 128 }, dtype: KvDtype::Bf16 }
    }

    /// DeepSeek-V3 MLA in bf16: 61 layers, 512 + 64 (item 1,152 B).
    pub const fn deepseek_v3() -> Self {
        Self { layers: 61, attention: Attention::Mla { kv_lora_rank: 512, rope_dim: 64 }, dtype: KvDtype::Bf16 }
    }

    /// Checks that no dimension is zero and that the sizes fit in memory arithmetic.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the offending field.
    pub fn validated(self) -> Result<Self, Error> {
        let zero = |field: &'static str| Error::InvalidArgument { field, reason: "must be at least 1".into() };
        if self.layers == 0 {
            return Err(zero("layers"));
        }
        match self.attention {
            Attention::Mha { kv_heads: 0, .. } => return Err(zero("kv_heads")),
            Attention::Mha { head_dim: 0, .. } => return Err(zero("head_dim")),
            Attention::Mla { kv_lora_rank: 0, .. } => return Err(zero("kv_lora_rank")),
            _ => {}
        }
        let elements = match self.attention {
            Attention::Mha { kv_heads, head_dim } => kv_heads.checked_mul(head_dim),
            Attention::Mla { kv_lora_rank, rope_dim } => kv_lora_rank.checked_add(rope_dim),
        };
        elements
            .and_then(|elements| elements.checked_mul(self.dtype.bytes()))
            .and_then(|item| item.checked_mul(self.layers))
            .and_then(|layer_bytes| layer_bytes.checked_mul(self.parts().len()))
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .ok_or(Error::InvalidArgument {
                field: "geometry",
                reason: "bytes per token overflow (layers × heads × head_dim × dtype bytes is too large)".into(),
            })?;
        Ok(self)
    }

    /// Bytes of one page of `page_size` tokens, or `None` when that does not fit in memory arithmetic (more than
    /// `isize::MAX` bytes).
    pub const fn checked_bytes_per_page(&self, page_size: usize) -> Option<usize> {
        match self.bytes_per_token().checked_mul(page_size) {
            Some(bytes) if bytes <= isize::MAX as usize => Some(bytes),
            _ => None,
        }
    }

    /// Whether this is an MLA geometry.
    pub const fn is_mla(&self) -> bool {
        matches!(self.attention, Attention::Mla { .. })
    }

    /// The parts of a layer: `[K, V]` for MHA, `[Latent]` for MLA.
    pub const fn parts(&self) -> &'static [KvPart] {
        match self.attention {
            Attention::Mha { .. } => &[KvPart::K, KvPart::V],
            Attention::Mla { .. } => &[KvPart::Latent],
        }
    }

    /// Bytes of one item (one token, one layer, K or V or latent): SGLang's `token_stride_size`.
    pub const fn item_bytes(&self) -> usize {
        let elements = match self.attention {
            Attention::Mha { kv_heads, head_dim } => kv_heads * head_dim,
            Attention::Mla { kv_lora_rank, rope_dim } => kv_lora_rank + rope_dim,
        };
        elements * self.dtype.bytes()
    }

    /// Bytes of one token over all layers and parts: SGLang's `size_per_token`.
    pub const fn bytes_per_token(&self) -> usize {
        self.item_bytes() * self.layers * self.parts().len()
    }

    /// Bytes of one part of one token over all layers: SGLang's `ksize_per_token` (the whole token for MLA).
    pub const fn part_bytes_per_token(&self) -> usize {
        self.item_bytes() * self.layers
    }

    /// Bytes of one page of `page_size` tokens.
    pub const fn bytes_per_page(&self, page_size: usize) -> usize {
        self.bytes_per_token() * page_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worked_examples_of_the_spec() {
        let llama = KvGeometry::llama31_8b();
        assert_eq!(llama.item_bytes(), 2048);
        assert_eq!(llama.bytes_per_token(), 131_072);
        assert_eq!(llama.bytes_per_page(64), 8 << 20);
        assert_eq!(llama.part_bytes_per_token() * 64, 4 << 20);
        let deepseek = KvGeometry::deepseek_v3();
        assert_eq!(deepseek.item_bytes(), 1152);
        assert_eq!(deepseek.bytes_per_token(), 70_272);
        assert_eq!(deepseek.bytes_per_page(64), 4_497_408);
        let fp8 = KvGeometry { dtype: KvDtype::Fp8E4m3, ..deepseek };
        assert_eq!((fp8.item_bytes(), fp8.bytes_per_token()), (576, 35_136));
    }

    #[test]
    fn zero_dimensions_are_named() {
        let error = KvGeometry::mha(32, 0, 128, KvDtype::Bf16).unwrap_err().to_string();
        assert!(error.starts_with("kv_heads: must be at least 1"), "{error}");
        assert!(KvGeometry::mla(0, 512, 64, KvDtype::Bf16).unwrap_err().to_string().starts_with("layers"));
        assert!(KvGeometry::mha(usize::MAX / 2, 1 << 20, 1 << 20, KvDtype::F32).is_err());
    }

    #[test]
    fn sizes_that_overflow_are_refused_not_wrapped() {
        // 2^63 layers of one-byte items: layers × 2 parts wraps to 0 in unchecked arithmetic
        let error = KvGeometry::mha(1 << 63, 1, 1, KvDtype::Fp8E4m3).unwrap_err().to_string();
        assert!(error.starts_with("geometry: bytes per token overflow"), "{error}");
        assert!(KvGeometry::mla(1 << 62, 1, 0, KvDtype::Bf16).is_err(), "2^62 layers × 2 bytes passes isize::MAX");
        let llama = KvGeometry::llama31_8b();
        assert_eq!(llama.checked_bytes_per_page(64), Some(8 << 20));
        assert_eq!(llama.checked_bytes_per_page(1 << 47), None, "2^17 bytes × 2^47 tokens");
        assert_eq!(llama.checked_bytes_per_page((isize::MAX as usize) / 131_072 + 1), None, "past isize::MAX");
    }
}
