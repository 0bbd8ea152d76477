//! Shared by the CLI's tests of tiers: replays of several topologies (TP sizes, pipeline stages) over one store
//! under the unified key scheme.

/// The flags of a replay with page-unified host pools: four KV heads in groups of one, nine layers, every hit
/// fetched whole, a small workload.
pub(crate) const POOLS: [&str; 13] = [
    "--layout",
    "page-unified",
    "--kv-heads",
    "4",
    "--head-group",
    "1",
    "--layers",
    "9",
    "--clients",
    "4",
    "--rounds",
    "2",
    "--fetch-whole-hits",
];

/// [`POOLS`] stored as SGLang's unified-key chunks of two layers: five chunks of layers per page, the last of one
/// layer. Two pipeline stages hold layers 0..4 and 4..9, so each stage's chunks start on the grid.
pub(crate) fn unified() -> Vec<&'static str> {
    [&POOLS[..], &["--unified-keys", "--layer-partition", "2"]].concat()
}

/// Runs `replay(topology)` (a replay with [`unified`] and the topology's flags over one store, its JSON report)
/// at TP2, then at TP1, TP4 and two pipeline stages: each verifies, and each cold reader's first round hits L3, so
/// it read chunks the TP2 replay stored. Returns the readers' reports.
pub(crate) fn other_topologies_read_what_tp2_stored(
    replay: impl Fn(&[&str]) -> serde_json::Value,
) -> Vec<serde_json::Value> {
    let writer = replay(&["--tp-size", "2"]);
    assert_eq!(writer["verified"], true, "TP2: {writer}");
    let stored = writer["unified_chunks"]["stored"].as_u64().unwrap();
    // 2 ranks × 2 head groups × 5 layer chunks per page
    assert!(stored > 0 && stored.is_multiple_of(20), "{writer}");
    let readers: [&[&str]; 3] = [&["--tp-size", "1"], &["--tp-size", "4"], &["--pp-size", "2"]];
    readers
        .into_iter()
        .map(|topology| {
            let report = replay(topology);
            assert_eq!(report["verified"], true, "{topology:?}: {report}");
            let cold = report["rounds"][0]["tokens_from_l3"].as_u64().unwrap();
            assert!(cold > 0, "{topology:?}: cold, no L3 hit: {report}");
            assert!(report["unified_chunks"]["read"].as_u64().unwrap() > 0, "{topology:?}: {report}");
            report
        })
        .collect()
}
