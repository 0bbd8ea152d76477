//! `hicache bench storage --backend 3fs`: besides the data path, the page metadata's batch operations per second —
//! the configured store (Redis) next to the in-process one, measured in the same run on the same batches.

use std::sync::Arc;
use std::time::Instant;

use hicache_storage_3fs::Hf3fsConfig;
use hicache_storage_3fs::metadata::{LocalMetadata, Located, PageMetadata, RedisMetadata, Reservation, Space};
use serde::Serialize;

/// Metadata rates of one store.
#[derive(Debug, Serialize)]
pub(super) struct MetadataRate {
    /// `in-process`, or the Redis URL.
    store: String,
    /// Batch operations per second (reserve, confirm, locate, exists: one each per batch).
    ops_per_s: f64,
    /// Keys handled per second.
    keys_per_s: f64,
    /// Requests sent to the store per batch operation.
    round_trips_per_op: f64,
}

/// The configured store next to the in-process one.
#[derive(Debug, Serialize)]
pub(super) struct MetadataFigure {
    batch: usize,
    batches: usize,
    rates: Vec<MetadataRate>,
    /// The configured store's operations per second over the in-process store's.
    ratio: f64,
}

fn measure(store: &dyn PageMetadata, batch: usize, batches: usize, rounds: usize) -> anyhow::Result<MetadataRate> {
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let space = Space {
        id: format!("hicache-bench-metadata-{}-{stamp}", std::process::id()),
        num_pages: (batch * batches) as u64,
        page_bytes: 4096,
    };
    let mut best = f64::INFINITY;
    let trips_before = store.round_trips();
    for round in 0..rounds {
        let keys: Vec<Vec<String>> =
            (0..batches).map(|index| (0..batch).map(|key| format!("bench/{round}-{index}-{key}")).collect()).collect();
        let started = Instant::now();
        for keys in &keys {
            let reserved = store.reserve(&space, keys)?;
            let written: Vec<(String, Located)> = keys
                .iter()
                .zip(reserved)
                .filter_map(|(key, reservation)| match reservation {
                    Reservation::Page(page) => Some((key.clone(), page)),
                    _ => None,
                })
                .collect();
            store.confirm(&space, &written, &[])?;
            store.locate(&space, keys)?;
            store.exists(&space, keys)?;
        }
        best = best.min(started.elapsed().as_secs_f64());
        store.clear(&space, "")?;
    }
    let ops = (4 * batches) as f64;
    let trips = (store.round_trips() - trips_before) as f64 / (ops * rounds as f64 + rounds as f64);
    Ok(MetadataRate {
        store: store.describe(),
        ops_per_s: ops / best,
        keys_per_s: ops * batch as f64 / best,
        round_trips_per_op: trips,
    })
}

/// Measures the metadata of `config` (when it names a Redis) and the in-process metadata.
pub(super) fn metadata_figure(config: &Hf3fsConfig, batch: usize, rounds: usize) -> anyhow::Result<MetadataFigure> {
    let batches = 64;
    let local: Arc<dyn PageMetadata> = Arc::new(LocalMetadata::new());
    let mut rates = vec![measure(local.as_ref(), batch, batches, rounds)?];
    if let Some(url) = &config.metadata_server_url {
        let redis = RedisMetadata::with_timeout(url, config.metadata_timeout)?;
        rates.push(measure(&redis, batch, batches, rounds)?);
    }
    let ratio = rates.last().map_or(1.0, |last| last.ops_per_s / rates[0].ops_per_s);
    Ok(MetadataFigure { batch, batches, rates, ratio })
}

/// One line per store.
pub(super) fn describe(figure: &MetadataFigure) -> String {
    let mut text = format!("page metadata, {} batches of {} keys:", figure.batches, figure.batch);
    for rate in &figure.rates {
        text.push_str(&format!(
            "\n  {}: {:.0} batch ops/s ({:.0} keys/s, {:.2} requests per op)",
            rate.store, rate.ops_per_s, rate.keys_per_s, rate.round_trips_per_op
        ));
    }
    if figure.rates.len() > 1 {
        text.push_str(&format!("\n  ratio to in-process: {:.3}", figure.ratio));
    } else {
        text.push_str("\n  (no metadata_server_url: only the in-process store)");
    }
    text
}
