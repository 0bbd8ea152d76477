//! Shared by the CLI's tests of tiers: replays of several TP sizes over one store under the unified key scheme.

/// The flags of a replay storing SGLang's unified-key chunks: four KV heads in chunks of one head, layers in chunks
/// of three (the default replay has eight layers: a short last chunk), every hit fetched whole, a small workload.
pub(crate) const UNIFIED: [&str; 14] = [
    "--layout",
    "page-unified",
    "--kv-heads",
    "4",
    "--head-group",
    "1",
    "--clients",
    "4",
    "--rounds",
    "2",
    "--unified-keys",
    "--layer-partition",
    "3",
    "--fetch-whole-hits",
];

/// Runs `replay(tp)` (a replay with [`UNIFIED`] at that TP size over one store, its JSON report) at TP2, then at
/// TP1 and TP4: each verifies, and each cold reader's first round hits L3, so it read chunks the TP2 replay stored.
/// Returns the readers' reports.
pub(crate) fn other_topologies_read_what_tp2_stored(
    replay: impl Fn(&str) -> serde_json::Value,
) -> Vec<serde_json::Value> {
    let writer = replay("2");
    assert_eq!(writer["verified"], true, "TP2: {writer}");
    let stored = writer["unified_chunks"]["stored"].as_u64().unwrap();
    // 2 ranks × 2 head groups × 3 layer chunks per page
    assert!(stored > 0 && stored.is_multiple_of(12), "{writer}");
    ["1", "4"]
        .into_iter()
        .map(|tp| {
            let report = replay(tp);
            assert_eq!(report["verified"], true, "TP{tp}: {report}");
            assert!(report["rounds"][0]["tokens_from_l3"].as_u64().unwrap() > 0, "TP{tp}: cold, no L3 hit: {report}");
            assert!(report["unified_chunks"]["read"].as_u64().unwrap() > 0, "TP{tp}: {report}");
            report
        })
        .collect()
}
