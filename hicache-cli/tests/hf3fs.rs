//! The CLI on the 3FS tier through the USRBIO **mock** (plain files), with page metadata in a real Redis on loopback
//! (started per test, stopped by its PID).
#![cfg(feature = "3fs")]

mod common;

use std::process::{Command, Output};

use hicache_storage_3fs::testing::{Mount, RedisServer, mock_library_dir};

fn hicache(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hicache"))
        .args(args)
        .env("HF3FS_LIB_DIR", mock_library_dir())
        .env_remove("SGLANG_HICACHE_HF3FS_CONFIG_PATH")
        .output()
        .expect("runs hicache")
}

#[test]
fn a_replay_verifies_with_redis_metadata_and_moves_a_shared_memory_pool_in_place() {
    let (mount, redis) = (Mount::new(), RedisServer::start());
    let extra = serde_json::json!({"metadata_server_url": redis.url(), "file_size": "2GiB", "numjobs": 4}).to_string();
    let dir = mount.path().to_str().unwrap();
    let shm = tempfile::tempdir().unwrap();
    for (layout, host_shm) in [("layer-first", None), ("page-first", Some(shm.path().to_str().unwrap()))] {
        let mut args = vec!["replay", "--backend", "3fs", "--dir", dir, "--extra-config", &extra, "--json"];
        args.extend(["--tp-size", "2", "--layout", layout, "--fetch-whole-hits"]);
        if let Some(shm) = host_shm {
            args.extend(["--host-shm", shm]);
        }
        let output = hicache(&args);
        assert!(output.status.success(), "{layout}: {}", String::from_utf8_lossy(&output.stderr));
        let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(report["verified"], true, "{report}");
        assert!(report["tokens_from_l3"].as_u64().unwrap() > 0, "nothing came back from 3FS: {report}");
        let staged = report["staging_bytes"].as_u64().unwrap();
        if host_shm.is_some() {
            assert_eq!(staged, 0, "a pool in shared memory is wrapped as an iov: {report}");
        } else {
            assert!(staged > 0, "a private pool goes through bounce buffers: {report}");
        }
    }
    // one data file per rank, and no iov left published
    assert!(mount.path().join("hicache.0.bin").is_file() && mount.path().join("hicache.1.bin").is_file());
    assert_eq!(std::fs::read_dir(mount.path().join("3fs-virt/iovs")).unwrap().count(), 0);
}

#[test]
fn the_benchmark_prints_metadata_rates_next_to_in_process_ones() {
    let (mount, redis) = (Mount::new(), RedisServer::start());
    let extra = serde_json::json!({"metadata_server_url": redis.url(), "file_size": "64MiB"}).to_string();
    let output = hicache(&[
        "bench",
        "storage",
        "--backend",
        "3fs",
        "--dir",
        mount.path().to_str().unwrap(),
        "--extra-config",
        &extra,
        "--pages",
        "16",
        "--page-bytes",
        "131072",
        "--batch",
        "8",
        "--rounds",
        "2",
        "--json",
    ]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let figure: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert!(figure["set_gbps"].as_f64().unwrap() > 0.0 && figure["get_gbps"].as_f64().unwrap() > 0.0, "{figure}");
    let rates = figure["metadata"]["rates"].as_array().unwrap();
    assert_eq!(rates.len(), 2, "{figure}");
    assert_eq!(rates[0]["store"], "in-process");
    assert_eq!(rates[1]["store"], redis.url());
    assert!(rates.iter().all(|rate| rate["ops_per_s"].as_f64().unwrap() > 0.0), "{figure}");
    assert_eq!(rates[1]["round_trips_per_op"], 1.0, "one request per batch operation: {figure}");
}

#[test]
fn redis_that_does_not_answer_and_a_path_off_the_mount_are_one_line_errors() {
    let mount = Mount::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("redis://127.0.0.1:{port}");
    let extra = serde_json::json!({"metadata_server_url": url, "metadata_timeout_s": 1}).to_string();
    let output =
        hicache(&["replay", "--backend", "3fs", "--dir", mount.path().to_str().unwrap(), "--extra-config", &extra]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&url), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    let elsewhere = tempfile::tempdir().unwrap();
    let output = hicache(&["replay", "--backend", "3fs", "--dir", elsewhere.path().to_str().unwrap()]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("not on a 3FS mount"));
    let output =
        hicache(&["replay", "--backend", "3fs", "--extra-config", r#"{"file_path_prefix": "/x", "numjobs": 0}"#]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("numjobs"));
}

#[test]
fn replays_of_other_topologies_read_the_unified_chunks_a_tp2_replay_stored_in_3fs() {
    let (mount, redis) = (Mount::new(), RedisServer::start());
    let extra = serde_json::json!({"metadata_server_url": redis.url(), "file_size": "1GiB"}).to_string();
    let dir = mount.path().to_str().unwrap();
    common::other_topologies_read_what_tp2_stored(|topology| {
        let mut args = vec!["replay", "--backend", "3fs", "--dir", dir, "--extra-config", &extra, "--json"];
        args.extend(common::unified());
        args.extend(topology);
        args.push("--sync-storage");
        let output = hicache(&args);
        assert!(output.status.success(), "{topology:?}: {}", String::from_utf8_lossy(&output.stderr));
        serde_json::from_slice(&output.stdout).unwrap()
    });
    // one data file per chunk size (two layers, and the last chunk's one), whatever the topology
    let mut files: Vec<String> = std::fs::read_dir(mount.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains("-chunk-L"))
        .collect();
    files.sort();
    assert!(
        files.len() == 2 && files[0].ends_with("-chunk-L1.bin") && files[1].ends_with("-chunk-L2.bin"),
        "{files:?}"
    );
}
