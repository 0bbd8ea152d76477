//! The CLI on Mooncake Store, against a real `mooncake_master`: pages SGLang wrote (through Mooncake's official
//! Python client, under SGLang's key scheme and page-first values, both releases, MHA and MLA) read back with
//! `hicache store get --key-scheme sglang`; and a replay that verifies.
#![cfg(feature = "mooncake")]

mod common;

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};

use hicache_storage_mooncake::testing::{Master, python_path, store_library, unpack_dir};

/// The environment a `hicache` process needs for the test library: the library, and on a machine without the CUDA
/// driver the no-device stand-in first on the loader's path.
fn hicache(args: &[&str]) -> Output {
    hicache_command(args).output().expect("runs hicache")
}

fn hicache_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_hicache"));
    command.args(args).env("MOONCAKE_STORE_LIBRARY", store_library()).env_remove("MOONCAKE_MASTER");
    let shim = unpack_dir().join("no-device-cuda-shim");
    if shim.is_dir() {
        let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        command.env("LD_LIBRARY_PATH", format!("{}:{path}", shim.display()));
    }
    command
}

fn extra_config(master: &Master) -> String {
    serde_json::json!({
        "master_server_address": master.address(),
        "local_hostname": "127.0.0.1",
        "global_segment_size": 0,
    })
    .to_string()
}

/// Starts a Python script of `tests/data` with the official client and waits for its `ready`; returns it (alive,
/// with its segment, until its stdin closes).
fn spawn_ready(script: &str, args: &[&str]) -> std::process::Child {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(script);
    let mut child = Command::new("python3")
        .arg(&path)
        .args(args)
        .env("PYTHONPATH", python_path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 runs");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready", "{script} failed ({args:?})");
    child
}

/// Starts the official client writing like SGLang; returns it (alive while its objects are needed) and the pages.
fn write_like_sglang(spec: &serde_json::Value, out: &Path) -> std::process::Child {
    let child = spawn_ready("write_like_sglang_mooncake.py", &[&spec.to_string()]);
    assert!(out.is_file());
    child
}

#[test]
fn pages_sglang_wrote_are_read_back_byte_for_byte() {
    let master = Master::start();
    let work = tempfile::tempdir().unwrap();
    let extra = extra_config(&master);
    for release in ["0.5.2", "0.5.23"] {
        for mla in [false, true] {
            let hashes: Vec<String> =
                (0..3).map(|_| (0..4).map(|_| format!("{:016x}", rand::random::<u64>())).collect()).collect();
            let model = "org/Model-7B";
            // 2 layers, page of 16 tokens, bf16: MHA 2 heads x 64 (8 KiB per part), MLA 64 + 32 (6 KiB)
            let part_bytes = if mla { 16 * 2 * (64 + 32) * 2 } else { 16 * 2 * 2 * 64 * 2 };
            let expected = work.path().join(format!("expected-{release}-{mla}.bin"));
            let spec = serde_json::json!({
                "master": master.address(), "release": release, "model": model, "tag": null, "tp_rank": 1,
                "mla": mla, "part_bytes": part_bytes, "hashes": hashes, "out": expected,
            });
            let mut writer = write_like_sglang(&spec, &expected);
            let got = work.path().join(format!("got-{release}-{mla}.bin"));
            let mut args = vec![
                "store",
                "get",
                "--backend",
                "mooncake",
                "--extra-config",
                &extra,
                "--key-scheme",
                "sglang",
                "--sglang-release",
                release,
                "--model",
                model,
                "--tp-rank",
                "1",
                "--tp-size",
                "2",
                "--layout",
                "page-first",
                "--layers",
                "2",
                "--page-size",
                "16",
                "--dtype",
                "bf16",
                "--out",
                got.to_str().unwrap(),
            ];
            if mla {
                args.extend(["--mla", "--kv-lora-rank", "64", "--rope-dim", "32"]);
            } else {
                args.extend(["--kv-heads", "2", "--head-dim", "64"]);
            }
            for hash in &hashes {
                args.extend(["--key", hash]);
            }
            let output = hicache(&args);
            assert!(output.status.success(), "{release} mla={mla}: {}", String::from_utf8_lossy(&output.stderr));
            assert!(
                std::fs::read(&got).unwrap() == std::fs::read(&expected).unwrap(),
                "{release} mla={mla}: the pages read differ from what SGLang's scheme wrote"
            );
            // the native scheme does not see SGLang's objects
            let native: Vec<&str> = args
                .iter()
                .copied()
                .filter(|arg| !["--key-scheme", "sglang", "--sglang-release", release].contains(arg))
                .collect();
            let output = hicache(&native);
            assert!(!output.status.success(), "{release} mla={mla}: native keys found SGLang's pages");
            // the namespace is shown, though Mooncake cannot count its pages
            let out = args.iter().position(|arg| *arg == "--out").unwrap();
            let mut stat: Vec<&str> = args
                .iter()
                .copied()
                .enumerate()
                .filter(|&(index, _)| index != out && index != out + 1)
                .map(|(_, arg)| arg)
                .collect();
            stat.retain(|arg| arg.len() != 64);
            stat.retain(|arg| *arg != "--key");
            stat[1] = "stat";
            let output = hicache(&stat);
            let text = String::from_utf8_lossy(&output.stdout);
            assert!(output.status.success() && text.contains("pages: not countable"), "{text}");
            drop(writer.stdin.take());
            writer.wait().unwrap();
        }
    }
}

#[test]
fn a_replay_verifies_against_the_master() {
    let master = Master::start();
    let extra = extra_config(&master);
    // the replay's own client lends the memory: objects live in its segment
    let extra = extra.replace("\"global_segment_size\":0", "\"global_segment_size\":268435456");
    // every hit fetched whole: what comes back is what this test checks, not whether the plan would read it
    let output = hicache(&[
        "replay",
        "--backend",
        "mooncake",
        "--extra-config",
        &extra,
        "--clients",
        "40",
        "--json",
        "--fetch-whole-hits",
    ]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["verified"], true, "{report}");
    assert!(report["tokens_from_l3"].as_u64().unwrap() > 0, "nothing came back from Mooncake: {report}");
    assert_eq!(report["staging_bytes"], 0, "page-first parts move in place: {report}");
    // hybrid models under SGLang's keys, two TP ranks: a DSA indexer (every page needs it) and a sliding window
    // (only the window at a prefix's end): each pool's ranks store its entries as SGLang's own store names them,
    // and a page comes back only with what its group needs
    let mut sglang: serde_json::Value = serde_json::from_str(&extra).unwrap();
    sglang["key_scheme"] = "sglang".into();
    let kinds =
        [("dsa", "indexer", "all_pages"), ("swa", "swa", "trailing_pages"), ("mamba", "mamba", "trailing_pages")];
    for (kind, pool, policy) in kinds {
        let output = hicache(&[
            "replay",
            "--backend",
            "mooncake",
            "--extra-config",
            &sglang.to_string(),
            "--hybrid",
            kind,
            "--tp-size",
            "2",
            "--clients",
            "24",
            "--json",
            "--fetch-whole-hits",
            // each batch's backups done before the next batch: what storage holds is not a matter of timing
            "--sync-storage",
        ]);
        assert!(output.status.success(), "{kind}: {}", String::from_utf8_lossy(&output.stderr));
        let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        let verdict = (report["verified"].as_bool(), report["lockstep"].as_bool());
        assert_eq!(verdict, (Some(true), Some(true)), "{kind}: {report}");
        assert!(report["tokens_from_l3"].as_u64().unwrap() > 0, "{kind}: nothing came back from Mooncake: {report}");
        let pools = &report["l3_layout"]["hicache_object_layout"]["pools"];
        let found = pools.as_array().unwrap().iter().find(|entry| entry["pool"] == pool);
        let found = found.unwrap_or_else(|| panic!("{kind}: no {pool} pool in the layout: {report}"));
        assert_eq!(found["hit_policy"], policy, "{report}");
        // SGLang's names: the indexer one object of the stage; a window's K and V per TP rank, 4 pages of 32 tokens;
        // a state's recurrent and convolution parts per TP rank, at 1 page
        let suffixes = match kind {
            "dsa" => serde_json::json!(["__indexer"]),
            "swa" => {
                assert_eq!(found["trailing_pages"], 4, "{report}");
                serde_json::json!(["_0_swa_k", "_0_swa_v", "_1_swa_k", "_1_swa_v"])
            }
            _ => {
                assert_eq!(found["trailing_pages"], 1, "{report}");
                serde_json::json!(["_0_temporal", "_0_conv_0", "_1_temporal", "_1_conv_0"])
            }
        };
        assert_eq!(found["suffixes"], suffixes, "{report}");
    }
}

#[test]
fn a_replay_ends_soon_after_its_master_dies_or_stops_and_verifies_what_it_served() {
    // before, every call waited for Mooncake's own deadline (8 s for a master gone, 30 s for one stopped) and the
    // queued backups one after another; closing waited ~40 s more to unmount: minutes in all
    const BOUND: std::time::Duration = std::time::Duration::from_secs(90);
    for signal in ["KILL", "STOP"] {
        let master = Master::start();
        let extra = extra_config(&master).replace("\"global_segment_size\":0", "\"global_segment_size\":268435456");
        let mut replay = hicache_command(&[
            "replay",
            "--backend",
            "mooncake",
            "--extra-config",
            &extra,
            "--clients",
            "200",
            "--rounds",
            "8",
            "--json",
        ])
        .env("RUST_LOG", "hicache_storage_mooncake=warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
        // read as it comes (Mooncake logs much once the master is gone), so the replay never waits on a full pipe
        let mut stderr = replay.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut stderr, &mut text).unwrap();
            text
        });
        // the replay is writing pages to the master
        let deadline = std::time::Instant::now() + BOUND;
        while master.metric("master_batch_put_start_requests_total").unwrap_or(0.0) < 4.0 {
            assert!(std::time::Instant::now() < deadline, "the replay wrote nothing to the master");
            if let Some(status) = replay.try_wait().unwrap() {
                let text = stderr.join().unwrap();
                let tail: String =
                    text.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
                panic!("the replay ended ({status}) before it wrote:\n{tail}");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        master.signal(signal);
        let signalled = std::time::Instant::now();
        assert!(replay.try_wait().unwrap().is_none(), "the replay ended before the master went away");
        let output = replay.wait_with_output().unwrap();
        let took = signalled.elapsed();
        assert!(took < BOUND, "after SIG{signal} to the master the replay took {took:?} to end");
        assert!(output.status.success(), "after SIG{signal}: {:?}", output.status);
        let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(report["verified"], true, "after SIG{signal}: {report}");
        // the outage was met (and from then on calls failed at once)
        let stderr = stderr.join().unwrap();
        assert!(stderr.contains("stopped answering"), "after SIG{signal} no call met the outage: {stderr}");
        drop(master);
    }
}

#[test]
fn a_master_that_does_not_answer_is_a_usage_error_naming_it() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let extra = format!("{{\"master_server_address\": \"127.0.0.1:{port}\"}}");
    let output = hicache(&["replay", "--backend", "mooncake", "--extra-config", &extra]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&format!("127.0.0.1:{port}")) && stderr.contains("does not answer"), "{stderr}");
    let output = hicache(&["replay", "--backend", "mooncake"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("MOONCAKE_MASTER"));
}

#[test]
fn the_benchmark_measures_hicache_next_to_the_official_client() {
    let master = Master::start();
    let extra = extra_config(&master).replace("\"global_segment_size\":0", "\"global_segment_size\":67108864");
    let mut command = Command::new(env!("CARGO_BIN_EXE_hicache"));
    command
        .args(["bench", "storage", "--backend", "mooncake", "--extra-config", &extra])
        .args(["--pages", "16", "--page-bytes", "131072", "--batch", "8", "--rounds", "2", "--json"])
        .env("MOONCAKE_STORE_LIBRARY", store_library());
    let output = with_official_client(&mut command).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let figure: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    for field in [
        "set_gbps",
        "get_gbps",
        "reference_set_gbps",
        "reference_get_gbps",
        "reference_exists_then_put_gbps",
        "reference_same_placement_set_gbps",
        "reference_same_placement_get_gbps",
    ] {
        assert!(figure[field].as_f64().unwrap() > 0.0, "{field}: {figure}");
    }
    assert_eq!(figure["prefer_local_segment"], true, "the default: {figure}");
    assert!(figure["preferred_segment"].as_str().is_some_and(|name| name.starts_with("127.0.0.1")), "{figure}");
    assert_eq!(figure["round_rates"].as_array().unwrap().len(), 2, "{figure}");
    // without the official client the reference fails with instructions
    let output = Command::new(env!("CARGO_BIN_EXE_hicache"))
        .args([
            "bench",
            "storage",
            "--backend",
            "mooncake",
            "--extra-config",
            &extra,
            "--pages",
            "2",
            "--page-bytes",
            "1024",
        ])
        .env("MOONCAKE_STORE_LIBRARY", store_library())
        .env("PYTHONPATH", "/nonexistent")
        .env("LD_LIBRARY_PATH", unpack_dir().join("no-device-cuda-shim"))
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("official Python client") && stderr.contains("pip install"), "{stderr}");
}

#[test]
fn replays_of_other_topologies_read_the_unified_chunks_a_tp2_replay_stored() {
    let master = Master::start();
    // a store node that outlives the replays holds the objects; the replays lend nothing
    let address = master.address();
    let mut keeper = spawn_ready("mooncake_keeper.py", &[address.as_str(), "268435456"]);
    let extra = extra_config(&master);
    common::other_topologies_read_what_tp2_stored(|topology| {
        let mut args = vec!["replay", "--backend", "mooncake", "--extra-config", &extra, "--json"];
        args.extend(common::unified());
        args.extend(topology);
        args.push("--sync-storage");
        let output = hicache(&args);
        assert!(output.status.success(), "{topology:?}: {}", String::from_utf8_lossy(&output.stderr));
        serde_json::from_slice(&output.stdout).unwrap()
    });
    drop(keeper.stdin.take());
    keeper.wait().unwrap();
}

/// `command` with Mooncake's official Python client on its path, and on a machine without the CUDA driver the
/// no-device stand-in on its loader's path.
fn with_official_client(command: &mut Command) -> &mut Command {
    command.env("PYTHONPATH", python_path());
    let shim = unpack_dir().join("no-device-cuda-shim");
    if shim.is_dir() {
        command.env("LD_LIBRARY_PATH", shim);
    }
    command
}

/// Runs the router of `tests/data/route_by_layout.py` on `layout` for `hashes`: per page, objects present and in all.
fn route(master: &Master, layout: &str, hashes: &[String]) -> Vec<(u64, u64)> {
    let mut command = Command::new("python3");
    command
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/route_by_layout.py"))
        .args([master.address().as_str(), layout])
        .args(hashes);
    let output = with_official_client(&mut command).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn a_router_finds_the_stored_pages_from_the_layout_alone() {
    let master = Master::start();
    // a store node that outlives the store commands holds the objects
    let address = master.address();
    let mut keeper = spawn_ready("mooncake_keeper.py", &[address.as_str(), "268435456"]);
    let work = tempfile::tempdir().unwrap();
    let extra = |more: serde_json::Value| {
        let mut extra: serde_json::Value = serde_json::from_str(&extra_config(&master)).unwrap();
        extra.as_object_mut().unwrap().extend(more.as_object().unwrap().clone());
        extra.to_string()
    };
    // three layers, two KV heads of 64 per rank, 16-token pages of bf16: 24 KiB (MLA 64 + 32: 9 KiB)
    let mha = ["--layers", "3", "--kv-heads", "2", "--head-dim", "64", "--page-size", "16", "--tp-size", "2"];
    let mla = ["--layers", "3", "--mla", "--kv-lora-rank", "64", "--rope-dim", "32", "--page-size", "16"];
    // a hybrid model's indexer entries beside the KV (every page needs them): 4000 bytes per page and rank
    let indexer = ["--pool", "indexer", "--entry-bytes", "4000"];
    let cases: [(&str, String, Vec<&str>, usize); 5] = [
        ("native keys, TP2", extra(serde_json::json!({})), [&mha[..], &["--layout", "page-first"]].concat(), 24576),
        (
            "native keys, TP2, an indexer pool beside the KV",
            extra(serde_json::json!({})),
            [&mha[..], &["--layout", "page-first"]].concat(),
            24576,
        ),
        (
            "SGLang 0.5.23 keys, MLA, the second of two stages",
            extra(serde_json::json!({"key_scheme": "sglang", "extra_backend_tag": "blue"})),
            [&mla[..], &["--layout", "page-first", "--pp-size", "2", "--pp-rank", "1", "--tp-size", "2"]].concat(),
            9216,
        ),
        (
            // the indexer's entry is one object of the stage, as SGLang's own store names it (`__indexer`)
            "SGLang 0.5.23 keys, MLA, TP2, an indexer pool beside the KV",
            extra(serde_json::json!({"key_scheme": "sglang"})),
            [&mla[..], &["--layout", "page-first", "--tp-size", "2"]].concat(),
            9216,
        ),
        (
            "unified keys, TP2, chunks of one head by two layers",
            extra(serde_json::json!({"key_scheme": "unified", "head_group": 1, "layer_partition": 2})),
            [&mha[..], &["--layout", "page-unified"]].concat(),
            24576,
        ),
    ];
    for (case, extra, flags, page_bytes) in cases {
        let target =
            [&["--backend", "mooncake", "--extra-config", &extra, "--model", "org/Model-7B"][..], &flags].concat();
        let hashes: Vec<String> =
            (0..4).map(|_| (0..4).map(|_| format!("{:016x}", rand::random::<u64>())).collect()).collect();
        // pages 0 and 1 stored by both ranks, page 2 by rank 0 only, page 3 never
        let pools: &[(&[&str], usize)] =
            if case.contains("indexer") { &[(&[], page_bytes), (&indexer, 4000)] } else { &[(&[], page_bytes)] };
        for (rank, pages) in [("0", &hashes[..3]), ("1", &hashes[..2])] {
            for &(pool, entry_bytes) in pools {
                let input = work.path().join(format!("pages-{rank}.bin"));
                let bytes: Vec<u8> = (0..pages.len() * entry_bytes).map(|_| rand::random::<u8>()).collect();
                std::fs::write(&input, bytes).unwrap();
                let mut put =
                    [&["store", "put"][..], &target, pool, &["--tp-rank", rank, "--in", input.to_str().unwrap()]]
                        .concat();
                for hash in pages {
                    put.extend(["--key", hash.as_str()]);
                }
                let output = hicache(&put);
                assert!(output.status.success(), "{case}: {}", String::from_utf8_lossy(&output.stderr));
            }
        }
        let pool: &[&str] = if case.contains("indexer") { &indexer } else { &[] };
        let output = hicache(&[&["store", "layout", "--json"][..], &target, pool].concat());
        assert!(output.status.success(), "{case}: {}", String::from_utf8_lossy(&output.stderr));
        let layout = String::from_utf8(output.stdout).unwrap();
        if case.contains("indexer") {
            let parsed: serde_json::Value = serde_json::from_str(&layout).unwrap();
            let pools = &parsed["hicache_object_layout"]["pools"];
            assert_eq!(
                (pools[1]["pool"].as_str(), pools[1]["hit_policy"].as_str()),
                (Some("indexer"), Some("all_pages"))
            );
            let suffixes: Vec<&str> =
                pools[1]["suffixes"].as_array().unwrap().iter().map(|suffix| suffix.as_str().unwrap()).collect();
            if case.contains("SGLang") {
                assert_eq!(suffixes, ["__indexer"], "{layout}");
            } else {
                // each rank's entry and its checksum
                assert_eq!(suffixes.len(), 4, "{layout}");
            }
        }
        let found = route(&master, &layout, &hashes);
        let objects = found[0].1;
        assert!(objects > 0 && found.iter().all(|&(_, all)| all == objects), "{case}: {found:?}\n{layout}");
        assert_eq!(found[0], (objects, objects), "{case}: {layout}");
        assert_eq!(found[1], (objects, objects), "{case}: {layout}");
        assert_eq!(found[3].0, 0, "{case}: a page never stored has objects: {layout}");
        if case.contains("MLA") {
            // one object per page and pool, the same on every rank: rank 0's alone is the whole page
            let per_page = if case.contains("indexer") { 2 } else { 1 };
            assert_eq!((objects, found[2].0), (per_page, per_page), "{case}: {layout}");
        } else {
            // rank 1's objects are missing: the router sees the page as absent
            assert!(found[2].0 > 0 && found[2].0 < objects, "{case}: {found:?}\n{layout}");
        }
    }
    drop(keeper.stdin.take());
    keeper.wait().unwrap();
}
