//! The `page_unified` host layout against SGLang 0.5.23's own `PageUnifiedLayout`: golden vectors made by running its
//! module (`tests/data/make_page_unified.py`). Per layout, the page's size, the byte order its `page_dims` state (a
//! C-contiguous array: every row's offset follows from the dims alone) and `chunk_span` of random chunks are SGLang's;
//! the layouts SGLang refuses for their shape are refused here, naming the field.

use hicache_core::geometry::{KvDtype, KvGeometry, KvPart};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use serde_json::Value;

const GOLDEN: &str = include_str!("data/sglang_0_5_23_page_unified.json");

fn golden() -> Value {
    serde_json::from_str(GOLDEN).expect("the golden file parses")
}

fn number(value: &Value, field: &str) -> usize {
    value[field].as_u64().unwrap_or_else(|| panic!("{field} in {value}")) as usize
}

/// hicache's map of three pages for SGLang's layout arguments.
fn map(args: &Value) -> Result<HostLayoutMap, hicache_core::Error> {
    let dtype = match number(args, "itemsize") {
        1 => KvDtype::Fp8E4m3,
        2 => KvDtype::Bf16,
        4 => KvDtype::F32,
        other => panic!("itemsize {other}"),
    };
    let (layers, heads, head_dim) = (number(args, "layer_num"), number(args, "head_num"), number(args, "head_dim"));
    let geometry = if args["is_mla"].as_bool() == Some(true) {
        // the latent's width is what counts: split it as DeepSeek does, rope last
        KvGeometry::mla(layers, head_dim - 64, 64, dtype)?
    } else {
        KvGeometry::mha(layers, heads, head_dim, dtype)?
    };
    HostLayoutMap::new(geometry, HostLayout::PageUnified, number(args, "page_size"), 3)?
        .with_head_groups(number(args, "head_group_num"))
}

/// The byte offset of an element at `index` of a C-contiguous array of `dims` with elements of `itemsize` bytes.
fn c_offset(dims: &[usize], index: &[usize], itemsize: usize) -> usize {
    dims.iter().zip(index).fold(0, |offset, (&dim, &at)| {
        assert!(at < dim, "{index:?} outside {dims:?}");
        offset * dim + at
    }) * itemsize
}

#[test]
fn page_sizes_byte_orders_and_chunk_spans_are_sglangs() {
    let golden = golden();
    let cases = golden["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 48);
    let (mut grouped, mut mla) = (0, 0);
    for case in cases {
        let args = &case["layout"];
        let map = map(args).unwrap_or_else(|error| panic!("{args}: {error}"));
        assert_eq!(map.page_bytes(), number(case, "bytes_per_page"), "{args}");
        let dims: Vec<usize> = serde_json::from_value(case["page_dims"].clone()).unwrap();
        let itemsize = number(args, "itemsize");
        let geometry = *map.geometry();
        let is_mla = geometry.is_mla();
        (grouped, mla) = (grouped + usize::from(map.head_groups() > 1), mla + usize::from(is_mla));
        // every row of every page where SGLang's dims put its first element
        for token in 0..map.tokens() {
            let (page, slot) = (token / map.page_size(), token % map.page_size());
            for layer in 0..geometry.layers {
                for (component, &part) in geometry.parts().iter().enumerate() {
                    for group in 0..map.head_groups() {
                        let index: Vec<usize> = if is_mla {
                            vec![page, layer, slot, 0]
                        } else {
                            vec![page, group, layer, component, slot, 0, 0]
                        };
                        let expected = c_offset(&dims, &index, itemsize);
                        assert_eq!(map.row_offset(token, layer, part, group), expected, "{args} {index:?}");
                    }
                }
            }
        }
        assert_eq!(dims.iter().product::<usize>() * itemsize, map.total_bytes(), "{args}");
        for span in case["spans"].as_array().expect("spans") {
            let layers: Vec<usize> = serde_json::from_value(span["layers"].clone()).unwrap();
            let expected: (usize, usize) = serde_json::from_value(span["span"].clone()).unwrap();
            assert_eq!(map.chunk_span(layers[0]..layers[1], number(span, "head_group")).unwrap(), expected, "{span}");
        }
    }
    assert!(grouped >= 10 && mla >= 5, "the cases cover head groups ({grouped}) and MLA ({mla})");
    // one part, the latent, for MLA: SGLang's MLA block has no component axis
    assert!(
        map(&cases.iter().find(|case| case["layout"]["is_mla"] == true).unwrap()["layout"])
            .unwrap()
            .geometry()
            .parts()
            .contains(&KvPart::Latent)
    );
}

#[test]
fn layouts_sglang_refuses_for_their_shape_are_refused_by_name() {
    let golden = golden();
    let refused = golden["refused"].as_array().expect("refused");
    assert_eq!(refused.len(), 5);
    for case in refused {
        let (args, error) = (&case["layout"], case["error"].as_str().unwrap());
        if error.contains("multiple of 16") {
            // a limit of SGLang's transfer kernels, not of the layout: hicache's copies move rows of any length
            let map = map(args).unwrap_or_else(|error| panic!("{args}: {error}"));
            assert_eq!(map.row_bytes() % 16, 8, "{args}");
            continue;
        }
        let ours = map(args).expect_err(&format!("SGLang refuses {args}: {error}")).to_string();
        let field = if args["page_size"] == 0 { "page_size" } else { "head_groups" };
        assert!(ours.contains(field), "{args}: {ours} (SGLang: {error})");
    }
}

#[test]
fn chunks_need_page_unified_and_a_range_inside_the_pool() {
    let geometry = KvGeometry::mha(4, 4, 8, KvDtype::Bf16).unwrap();
    let first = HostLayoutMap::new(geometry, HostLayout::PageFirst, 2, 1).unwrap();
    assert!(first.chunk_span(0..1, 0).unwrap_err().to_string().contains("mem_layout"));
    assert!(first.with_head_groups(2).unwrap_err().to_string().contains("page_unified"));
    let unified = HostLayoutMap::new(geometry, HostLayout::PageUnified, 2, 1).unwrap().with_head_groups(2).unwrap();
    assert!(unified.chunk_span(2..2, 0).unwrap_err().to_string().contains("layers"));
    assert!(unified.chunk_span(3..5, 0).unwrap_err().to_string().contains("layers"));
    assert!(unified.chunk_span(0..4, 2).unwrap_err().to_string().contains("head_group"));
    // the two groups split the page in halves, layer ranges within them in order
    assert_eq!(unified.chunk_span(0..4, 1).unwrap(), (unified.page_bytes() / 2, unified.page_bytes() / 2));
}
