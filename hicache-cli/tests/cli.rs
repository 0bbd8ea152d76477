//! The built `hicache` binary, run as a user runs it: outputs, exit codes and error messages.

mod common;

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

const GOLDEN: &str = include_str!("../../hicache-core/tests/data/sglang_0_5_2_page_keys.json");

fn hicache(args: &[&str], stdin: &str) -> Output {
    hicache_bytes(args, stdin.as_bytes())
}

fn hicache_bytes(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hicache"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    // a command that fails before reading its input closes the pipe early: that is not the test's failure
    match child.stdin.take().expect("stdin").write_all(stdin) {
        Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => panic!("writing stdin: {error}"),
        _ => {}
    }
    child.wait_with_output().expect("the binary finishes")
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("utf-8 stdout")
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).expect("utf-8 stderr")
}

/// Asserts a usage failure: exit code 2 and one line of error naming `needle`, no panic or backtrace.
fn assert_usage_error(output: &Output, needle: &str) {
    let message = stderr(output);
    assert_eq!(output.status.code(), Some(2), "stderr: {message}");
    assert!(message.contains(needle), "expected {needle:?} in {message:?}");
    assert!(!message.contains("panicked") && !message.contains("backtrace"), "{message}");
    assert_eq!(message.trim_end().lines().count(), 1, "one line: {message:?}");
}

fn golden_cases() -> Vec<Value> {
    let golden: Value = serde_json::from_str(GOLDEN).expect("golden parses");
    golden["cases"].as_array().expect("cases").clone()
}

fn tokens_text(case: &Value) -> String {
    case["tokens"].as_array().expect("tokens").iter().map(|token| token.to_string()).collect::<Vec<_>>().join(" ")
}

fn expected_keys(case: &Value) -> Vec<String> {
    case["keys"].as_array().expect("keys").iter().map(|key| key.as_str().expect("hex").to_owned()).collect()
}

#[test]
fn hash_prints_sglang_keys_for_every_golden_case() {
    for case in golden_cases() {
        let page_size = case["page_size"].to_string();
        let mut args = vec!["hash", "--page-size", &page_size, "--partial", "hash"];
        let prior = case["prior"].as_str().map(str::to_owned);
        if let Some(prior) = &prior {
            args.extend(["--prior", prior]);
        }
        let output = hicache(&args, &tokens_text(&case));
        if case["tokens"].as_array().is_some_and(Vec::is_empty) {
            // no keys, as the library says, but the command says why it prints nothing
            assert!(expected_keys(&case).is_empty());
            assert_usage_error(&output, "no tokens in standard input");
            continue;
        }
        assert!(output.status.success(), "{}: {}", case["name"], stderr(&output));
        let keys: Vec<String> = stdout(&output).lines().map(str::to_owned).collect();
        assert_eq!(keys, expected_keys(&case), "{}", case["name"]);
    }
}

#[test]
fn hash_reads_json_and_files_and_continues_chains() {
    let case = golden_cases()
        .into_iter()
        .find(|case| case["name"].as_str().unwrap().starts_with("long conversation"))
        .unwrap();
    let expected = expected_keys(&case);
    let tokens: Vec<u64> = case["tokens"].as_array().unwrap().iter().map(|token| token.as_u64().unwrap()).collect();
    // the whole sequence from a JSON file, printed as JSON
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.json");
    std::fs::write(&file, serde_json::to_string(&tokens).unwrap()).unwrap();
    let output = hicache(&["hash", "--page-size", "64", "--json", file.to_str().unwrap()], "");
    assert!(output.status.success(), "{}", stderr(&output));
    let printed: Vec<String> = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(printed, expected);
    // the second half alone, chained from the first half's last key, comma-separated on stdin
    let half = tokens.len() / 2;
    let text = tokens[half..].iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let prior = &expected[half / 64 - 1];
    let output = hicache(&["hash", "--page-size", "64", "--prior", prior], &text);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(stdout(&output).lines().collect::<Vec<_>>(), expected[half / 64..]);
}

#[test]
fn partial_pages_are_refused_unless_asked_for() {
    let output = hicache(&["hash", "--page-size", "4"], "1 2 3 4 5 6");
    assert_usage_error(&output, "6 tokens are not a whole number of pages of 4 tokens (2 left over)");
    let output = hicache(&["hash", "--page-size", "4", "--partial", "drop"], "1 2 3 4 5 6");
    assert_eq!(stdout(&output).lines().count(), 1);
    let output = hicache(&["hash", "--page-size", "4", "--partial", "hash"], "1 2 3 4 5 6");
    assert_eq!(stdout(&output).lines().count(), 2);
}

#[test]
fn bad_inputs_fail_with_exit_code_2_and_a_clear_line() {
    assert_usage_error(
        &hicache(&["hash", "--page-size", "2"], "1 2 18446744073709551616 4"),
        "token 3 (\"18446744073709551616\"): token ids must be in [0, 18446744073709551615]",
    );
    // a chain continued from a prior key is past its seed: clap refuses the pair (its own usage lines follow)
    let output = hicache(&["hash", "--page-size", "2", "--prior", &"ab".repeat(32), "--extra-key", "x"], "1 2");
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).contains("'--prior <HEX>' cannot be used with '--extra-key <TEXT>'"),
        "{}",
        stderr(&output)
    );
    assert_usage_error(&hicache(&["hash", "--page-size", "2"], "1 -2"), "token 2 (\"-2\")");
    assert_usage_error(&hicache(&["hash", "--page-size", "2"], "1 two"), "not an integer");
    assert_usage_error(&hicache(&["hash", "--page-size", "2"], "[1, 2"), "not a JSON array");
    assert_usage_error(
        &hicache(&["hash", "--page-size", "2", "--prior", "abc"], "1 2"),
        "--prior: invalid page key \"abc\"",
    );
    assert_usage_error(&hicache(&["hash", "--page-size", "0"], "1 2"), "--page-size must be at least 1");
    assert_usage_error(
        &hicache(&["hash", "--page-size", "2", "/no/such/tokens.txt"], ""),
        "cannot read token file /no/such/tokens.txt",
    );
    let output = hicache(&["hash"], "");
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("--page-size"), "{}", stderr(&output));
    let output = hicache(&["bench", "hash", "--seconds", "0"], "");
    assert_usage_error(&output, "--seconds must be positive");
}

#[test]
fn hash_follows_sglangs_newer_key_rules() {
    // golden vectors of SGLang 0.5.23's own seed function and C++ hasher (hicache-core/tests/data)
    let golden: Value =
        serde_json::from_str(include_str!("../../hicache-core/tests/data/sglang_0_5_23_page_keys.json"))
            .expect("golden parses");
    let zero_to_63: String = (0..64).map(|token| token.to_string()).collect::<Vec<_>>().join(" ");
    let output = hicache(&["hash", "--extra-key", "lora-A", "--page-size", "64"], &zero_to_63);
    assert!(output.status.success(), "{}", stderr(&output));
    let case = &golden["cases"][0];
    assert_eq!(case["name"], "tokens 0..63 with extra key lora-A, page 64");
    assert_eq!(stdout(&output).trim(), case["keys"][0].as_str().unwrap());
    for case in golden["cases"].as_array().unwrap() {
        let page_size = case["page_size"].to_string();
        let mut args = vec!["hash", "--page-size", &page_size, "--partial", "hash"];
        for (flag, field) in [("--extra-key", "extra_key"), ("--cache-salt", "cache_salt"), ("--prior", "prior")] {
            if let Some(value) = case[field].as_str() {
                args.extend([flag, value]);
            }
        }
        let output = hicache(&args, &tokens_text(case));
        assert!(output.status.success(), "{}: {}", case["name"], stderr(&output));
        let keys: Vec<String> = stdout(&output).lines().map(str::to_owned).collect();
        assert_eq!(keys, expected_keys(case), "{}", case["name"]);
    }
}

#[test]
fn bench_hash_reports_both_page_sizes_as_json() {
    let output = hicache(&["bench", "hash", "--json", "--seconds", "0.01", "--tokens", "4096"], "");
    assert!(output.status.success(), "{}", stderr(&output));
    let figures: Vec<Value> = serde_json::from_str(&stdout(&output)).expect("a JSON list");
    let sizes: Vec<u64> = figures.iter().map(|figure| figure["page_size"].as_u64().unwrap()).collect();
    assert_eq!(sizes, [1, 64]);
    for figure in &figures {
        for field in ["mtok_per_s", "raw_sha256_mtok_per_s", "ratio"] {
            assert!(figure[field].as_f64().is_some_and(|value| value > 0.0), "{field} in {figure}");
        }
    }
}

#[test]
fn bench_controller_reports_ops_and_time_per_op() {
    let output = hicache(&["bench", "controller", "--json", "--ops", "2000"], "");
    assert!(output.status.success(), "{}", stderr(&output));
    let figure: Value = serde_json::from_str(&stdout(&output)).expect("a JSON object");
    assert!(figure["ops"].as_u64().is_some_and(|ops| ops >= 2000), "{figure}");
    assert!(figure["us_per_op"].as_f64().is_some_and(|us| us > 0.0), "{figure}");
    // how many pages storage served depends on how far the backup thread got (a busy machine starves it)
    assert!(figure["prefetched_pages"].is_u64() && figure["requests"].as_u64().is_some_and(|n| n > 0), "{figure}");
    assert_usage_error(&hicache(&["bench", "controller", "--ops", "0"], ""), "--ops and --page-size");
}

fn replay_json(args: &[&str]) -> Value {
    let mut all = vec!["replay", "--json"];
    all.extend_from_slice(args);
    let output = hicache(&all, "");
    assert!(output.status.success(), "replay {args:?}: {}", stderr(&output));
    serde_json::from_str(&stdout(&output)).expect("a JSON object")
}

fn tokens(report: &Value, tier: &str) -> u64 {
    report[format!("tokens_from_{tier}")].as_u64().unwrap()
}

/// The replay's own compute is simulated at a fixed rate while storage runs at this machine's real speed: on a
/// loaded machine the cost plan may rightly compute what a starved file tier would bring. Tests of what the tiers
/// serve fetch every hit whole (`--fetch-whole-hits`); the plan has tests of its own.
const WHOLE: &str = "--fetch-whole-hits";

#[test]
fn replay_by_default_serves_hits_from_every_tier_and_verifies_every_byte() {
    let report = replay_json(&[WHOLE]);
    assert_eq!(report["verified"], true, "{report}");
    assert!(report["verified_bytes"].as_u64().unwrap() > 0);
    for tier in ["l1", "l2", "l3"] {
        assert!(tokens(&report, tier) > 0, "no hits from {tier}: {report}");
    }
    let rounds = report["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 4);
    assert_eq!(rounds[0]["hit_rate"], 0.0, "the first round is cold");
    let requests: u64 = rounds.iter().map(|round| round["requests"].as_u64().unwrap()).sum();
    assert_eq!(requests, report["requests"].as_u64().unwrap());
    // the SGLang metric: cached over prompt tokens
    let cached = tokens(&report, "l1") + tokens(&report, "l2") + tokens(&report, "l3");
    let rate = cached as f64 / report["prompt_tokens"].as_f64().unwrap();
    assert!((report["hit_rate"].as_f64().unwrap() - rate).abs() < 1e-9);
    for field in ["page_ops_per_s", "ttft_p50_ms", "ttft_p90_ms"] {
        assert!(report[field].as_f64().is_some_and(|value| value > 0.0), "{field}: {report}");
    }
    assert!(report["ttft_p90_ms"].as_f64() >= report["ttft_p50_ms"].as_f64());
}

#[test]
fn a_page_unified_replay_cut_into_head_groups_verifies_through_every_tier() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path().to_str().unwrap();
    // four KV heads over two ranks, one head per group: two groups per page on each rank
    for backend in [vec!["--backend", "memory"], vec!["--backend", "file", "--dir", dir]] {
        let mut args =
            vec![WHOLE, "--tp-size", "2", "--kv-heads", "4", "--layout", "page-unified", "--head-group", "1"];
        args.extend(&backend);
        let report = replay_json(&args);
        assert_eq!(report["verified"], true, "{backend:?}: {report}");
        for tier in ["l1", "l2", "l3"] {
            assert!(tokens(&report, tier) > 0, "{backend:?}: no hits from {tier}: {report}");
        }
    }
    let refused = hicache(&["replay", "--layout", "page-unified", "--head-group", "3"], "");
    assert_usage_error(&refused, "head_group");
    assert_usage_error(&hicache(&["replay", "--layout", "page-first", "--head-group", "1"], ""), "page-unified");
}

#[test]
fn replays_of_any_topology_read_the_chunks_a_tp2_replay_stored() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path().to_str().unwrap();
    let file = ["--backend", "file", "--dir", dir];
    let readers = common::other_topologies_read_what_tp2_stored(|topology| {
        // the readers read-only: every chunk they read is one the TP2 replay wrote
        let writer = topology == ["--tp-size", "2"];
        let read_only: &[&str] = if writer { &[] } else { &["--extra-config", r#"{"read_only": true}"#] };
        replay_json(&[&file[..], read_only, &common::unified(), topology, &["--sync-storage"]].concat())
    });
    assert!(readers.iter().all(|report| report["unified_chunks"]["stored"] == 0));
    // a replay keyed per rank (no --unified-keys) finds none of them
    let ranked = replay_json(&[&file[..], &common::POOLS[..], &["--tp-size", "4"]].concat());
    assert_eq!(ranked["rounds"][0]["tokens_from_l3"], 0, "{ranked}");
    let refused = hicache(&["replay", "--backend", "memory", "--layout", "page-first", "--unified-keys"], "");
    assert_usage_error(&refused, "page-unified");
}

#[test]
fn replay_moves_storage_pages_in_place_under_every_write_policy() {
    for policy in ["write-through", "write-through-selective", "write-back"] {
        // a small host pool: pages go to the file tier and come back from it
        let report = replay_json(&[
            "--clients",
            "24",
            "--host-tokens",
            "20480",
            "--sync-storage",
            "--write-policy",
            policy,
            WHOLE,
        ]);
        assert_eq!(report["verified"], true, "{policy}: {report}");
        // the result records what it was run with
        let parameters = &report["parameters"];
        assert_eq!((parameters["clients"].as_u64(), parameters["host_tokens"].as_u64()), (Some(24), Some(20480)));
        assert_eq!((parameters["write_policy"].as_str(), parameters["backend"].as_str()), (Some(policy), Some("file")));
        assert_eq!(parameters["page_bytes"].as_u64(), Some(32 * 8 * 2 * 2 * 64 * 2), "page 32, 8 layers, K+V, 2 heads");
        let storage = &report["storage"];
        assert!(storage["bytes_written"].as_u64().unwrap() > 0, "{policy}: nothing reached storage: {report}");
        // (the selective policy backs up only nodes hit often enough, too few here for a later prefetch to find)
        if policy != "write-through-selective" {
            assert!(storage["bytes_read"].as_u64().unwrap() > 0, "{policy}: nothing came back from storage: {report}");
        }
        assert_eq!(report["staging_bytes"], 0, "{policy}: {report}");
        assert_eq!(storage["staging_bytes"], 0, "{policy}: {report}");
        // every page that reached storage was copied device → host first (under write-back, at device eviction)
        let bytes = &report["bytes"];
        assert!(
            bytes["device_to_host"].as_u64().unwrap() >= bytes["host_to_storage"].as_u64().unwrap(),
            "{policy}: device → host copies not all counted: {report}"
        );
    }
}

/// A hybrid model's sidecar pool moves with its KV on every path: its ranks hold pools of its own geometry and make
/// every decision the KV's ranks make (the lockstep digest), and every byte of every pool that comes back is checked,
/// under every write policy, with and without storage faults that each rank draws for itself.
#[test]
fn hybrid_replays_verify_every_pool_under_every_write_policy_with_and_without_faults() {
    // each pool's entry on one rank at TP 1: page 32, 8 layers (the draft model: 1; the sliding layers: 4), 2 heads
    // of 64 bf16 values; a sliding window of 128 tokens is 4 pages; a state, of each of the 6 linear layers, per head
    // a 64 × 64 fp32 matrix and 3 inputs of 3 × 64 bf16 channels, kept at the last page of what a request computed
    let kinds = [
        ("dsa", "indexer", 8 * 32 * (128 + 4), None),
        ("eagle", "draft", 2 * 2 * 64 * 2 * 32, None),
        ("mtp", "draft", 576 * 2 * 32, None),
        ("swa", "swa", 4 * 2 * 2 * 64 * 2 * 32, Some(4)),
        ("mamba", "mamba", 6 * 2 * (64 * 64 * 4 + 3 * 3 * 64 * 2), Some(1)),
    ];
    for (kind, pool, entry_bytes, window) in kinds {
        for policy in ["write-through", "write-through-selective", "write-back"] {
            for faults in [false, true] {
                let mut args = vec!["--hybrid", kind, "--clients", "24", "--rounds", "3", "--host-tokens", "20480"];
                args.extend(["--sync-storage", "--write-policy", policy, WHOLE]);
                if faults {
                    args.extend(["--tp-size", "2", "--fault-fail-rate", "0.05", "--fault-corrupt-rate", "0.05"]);
                }
                // a prefix every client shares, at whose end no request's compute ends (not under write-back: the
                // prefix stays on the device, never backed up, and as in SGLang no prefetch starts below a node that
                // is not, so nothing would come back from storage)
                let shared = kind == "mamba" && policy != "write-back";
                if shared {
                    args.extend(["--system-prompt", "256"]);
                }
                let report = replay_json(&args);
                let case = format!("{kind}, {policy}, faults {faults}");
                if kind == "mamba" {
                    // a state is kept only where a request's compute ended (its pages before hold none: a prefill
                    // writes zeros there, which no check takes for a state); the first prompts share only the
                    // system prompt, so none restores anything, and the later ones restore their conversation
                    let rounds = report["rounds"].as_array().unwrap();
                    if shared {
                        assert_eq!(rounds[0]["hit_rate"], 0.0, "{case}: a prefix restored without its state: {report}");
                    }
                    assert!(rounds[2]["hit_rate"].as_f64().unwrap() > 0.3, "{case}: {report}");
                    // each state is one request's end, held once per tier
                    let states = &report["states_peak"];
                    assert_eq!(states["state_bytes"].as_u64(), Some(entry_bytes as u64 / if faults { 2 } else { 1 }));
                    for tier in ["device", "host"] {
                        let held = states[tier].as_u64().unwrap();
                        assert!(held > 0 && held <= 24 * 3, "{case}: {held} states on the {tier}: {report}");
                    }
                } else {
                    assert!(report.get("states_peak").is_none(), "{case}: {report}");
                }
                assert_eq!(
                    (report["verified"].as_bool(), report["lockstep"].as_bool()),
                    (Some(true), Some(true)),
                    "{case}: {report}"
                );
                let parameters = &report["parameters"];
                assert_eq!(parameters["hybrid"], kind, "{case}");
                // (the faulty runs have two TP ranks: heads are split between them, a latent is not)
                let split = faults && matches!(kind, "eagle" | "swa" | "mamba");
                let entry_bytes = if split { entry_bytes / 2 } else { entry_bytes };
                let expected = match window {
                    Some(window) => serde_json::json!([{ "pool": pool, "entry_bytes": entry_bytes,
                        "hit_policy": "trailing_pages", "window_pages": window }]),
                    None => {
                        serde_json::json!([{ "pool": pool, "entry_bytes": entry_bytes, "hit_policy": "all_pages" }])
                    }
                };
                assert_eq!(parameters["sidecars"], expected, "{case}");
                if faults {
                    let injected = &report["faults_injected"];
                    assert!(injected["failed_pages"].as_u64().unwrap() > 0, "{case}: {report}");
                } else if policy != "write-through-selective" {
                    assert!(tokens(&report, "l3") > 0, "{case}: nothing came back from storage: {report}");
                }
                if window.is_some() && !faults && policy == "write-through" {
                    // every node is backed up whole: the KV's pages whole, the window pool's only at nodes' ends
                    let bytes = &report["bytes"];
                    let (written, stored) =
                        (bytes["device_to_host"].as_u64().unwrap(), bytes["host_to_storage"].as_u64().unwrap());
                    assert!(stored * 4 < written * 3, "{case}: {stored} bytes stored of {written} written: {report}");
                }
            }
        }
    }
    assert_usage_error(&hicache(&["replay", "--hybrid", "dsa", "--pp-size", "2"], ""), "one pipeline stage");
    assert_usage_error(&hicache(&["replay", "--hybrid", "swa", "--layers", "1"], ""), "--layers of 2 or more");
    assert_usage_error(&hicache(&["replay", "--hybrid", "mamba", "--layers", "3"], ""), "--layers of 4 or more");
    assert_usage_error(&hicache(&["replay", "--hybrid", "mamba", "--page-size", "128"], ""), "--page-size, --head-dim");
    let refused = hicache(
        &["replay", "--hybrid", "eagle", "--backend", "memory", "--layout", "page-unified", "--unified-keys"],
        "",
    );
    assert_usage_error(&refused, "keeps no sidecar pools");
}

/// A page group is restored whole or not at all: with a draft model's entries gone from storage, the KV pages
/// stored beside them (which a replay of the model alone reads back) restore no prefix of the hybrid model.
#[test]
fn a_hybrid_replay_restores_no_kv_page_whose_sidecar_entry_is_gone() {
    let (hybrid, alone) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let run = |dir: &std::path::Path, hybrid: bool| {
        let mut args = vec!["--clients", "12", "--rounds", "2", "--sync-storage", WHOLE];
        args.extend(["--dir", dir.to_str().unwrap()]);
        if hybrid {
            args.extend(["--hybrid", "eagle"]);
        }
        let report = replay_json(&args);
        assert_eq!((report["verified"].as_bool(), report["lockstep"].as_bool()), (Some(true), Some(true)), "{report}");
        // the first round's prompts are new to this run: what they hit in storage, an earlier run left
        report["rounds"][0]["tokens_from_l3"].as_u64().unwrap()
    };
    let namespaces = |dir: &std::path::Path| -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir.join("hicache-v1")).unwrap().flatten().map(|entry| entry.path()).collect()
    };
    assert_eq!(run(hybrid.path(), true), 0, "a fresh directory");
    assert_eq!(run(hybrid.path(), true), 12 * 512 / 32 * 32, "every first prompt's pages come back from storage");
    // the model alone keeps only the KV's namespace: the other one in the hybrid's directory is the draft's
    run(alone.path(), false);
    let kv_name = namespaces(alone.path())[0].file_name().unwrap().to_owned();
    let stored = namespaces(hybrid.path());
    assert_eq!(stored.len(), 2, "{stored:?}");
    let draft = stored.iter().find(|path| path.file_name().unwrap() != kv_name).unwrap();
    std::fs::remove_dir_all(draft).unwrap();
    assert_eq!(run(hybrid.path(), true), 0, "no KV page came back without its draft entry");
    assert!(run(hybrid.path(), false) > 0, "the KV pages were there");
}

#[test]
fn replay_runs_with_the_host_pool_in_shared_memory() {
    let shm = tempfile::tempdir().unwrap();
    let path = shm.path().to_str().unwrap();
    let report = replay_json(&["--clients", "8", "--rounds", "3", "--tp-size", "2", "--host-shm", path]);
    assert_eq!(report["verified"], true, "{report}");
    assert_eq!(report["lockstep"], true, "{report}");
    assert_eq!(report["staging_bytes"], 0, "{report}");
    assert!(walk(shm.path()).is_empty(), "the pools' files are removed at the end");
    assert_usage_error(&hicache(&["replay", "--host-shm", "/does/not/exist"], ""), "--host-shm: host_allocation");
}

#[test]
fn with_a_small_host_pool_storage_serves_what_the_host_evicted() {
    // --sync-storage: backups finish before the next batch, so the comparison does not depend on thread timing
    let small = ["--clients", "24", "--host-tokens", "20480", "--sync-storage", WHOLE, "--backend"];
    let without = replay_json(&[&small[..], &["none"]].concat());
    let with = replay_json(&[&small[..], &["memory"]].concat());
    assert_eq!(tokens(&without, "l3"), 0);
    assert!(tokens(&with, "l3") > 0, "{with}");
    assert_eq!((with["verified"].as_bool(), without["verified"].as_bool()), (Some(true), Some(true)));
    assert!(with["prefetch_stop_reasons"]["complete"].as_u64().unwrap() > 0);
    // the hit rates are not compared: prefetches finish on I/O threads while other requests run, so when they land
    // (and the host pages they take from the LRU) depends on timing, and on a loaded machine the L1/L2 share of a
    // run with L3 can fall below that of a run without it (seen in CI: 0.19 against 0.24)
}

#[test]
fn four_tp_ranks_replay_in_lockstep() {
    let report = replay_json(&["--tp-size", "4", "--clients", "12", "--rounds", "3", "--backend", "memory"]);
    assert_eq!(report["tp_size"], 4);
    assert_eq!(report["lockstep"], true, "{report}");
    assert_eq!(report["verified"], true);
}

#[test]
fn pipeline_stages_of_tp_ranks_replay_in_lockstep_over_keys_of_each_rank() {
    // seven layers over two stages: layers 0..3 and 3..7, as SGLang splits them; each rank's bytes are the model's
    // heads and layers, so a stage that loaded another stage's (or another rank's) page would fail verification
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--tp-size", "2", "--pp-size", "2", "--layers", "7", "--backend", "file"];
    let report = replay_json(&[&flags[..], &["--dir", dir.path().to_str().unwrap(), WHOLE]].concat());
    assert_eq!((report["tp_size"].as_u64(), report["pp_size"].as_u64()), (Some(2), Some(2)), "{report}");
    assert_eq!((report["lockstep"].as_bool(), report["verified"].as_bool()), (Some(true), Some(true)), "{report}");
    // rank 0's pages: its stage's three layers, K and V, one of two heads of 64 bf16 values, 32 tokens
    assert_eq!(report["parameters"]["page_bytes"], 3 * 2 * 64 * 2 * 32, "{report}");
    assert!(report["tokens_from_l3"].as_u64().unwrap() > 0, "{report}");
    // the four ranks' pages are stored apart: each stage keeps its layers under its own namespace (small pages: in
    // segment files of its own)
    let namespaces: Vec<std::path::PathBuf> = std::fs::read_dir(dir.path().join("hicache-v1"))
        .unwrap()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.is_dir())
        .collect();
    assert_eq!(namespaces.len(), 4, "{namespaces:?}");
    for namespace in &namespaces {
        let segments = walk(&namespace.join("segments"));
        assert!(
            segments.iter().any(|path| path.extension().is_some_and(|extension| extension == "seg")),
            "{namespace:?}"
        );
    }
}

#[test]
fn tp_ranks_as_processes_replay_in_lockstep_and_a_failing_rank_stops_the_run() {
    let report = replay_json(&["--tp-size", "2", "--processes", WHOLE]);
    assert_eq!((report["tp_size"].as_u64(), report["processes"].as_bool()), (Some(2), Some(true)), "{report}");
    assert_eq!(report["lockstep"], true, "{report}");
    assert_eq!(report["verified"], true);
    assert!(report["tokens_from_l3"].as_u64().unwrap() > 0, "the ranks share the launcher's storage: {report}");
    let cost = &report["collectives"];
    assert!(cost["per_tick"].as_f64().unwrap() >= 1.0 && cost["ticks"].as_u64().unwrap() > 0, "{report}");
    assert!(cost["us_per_tick"].as_f64().unwrap() <= cost["tick_us"].as_f64().unwrap(), "{report}");
    // every rank fails (its data files are refused): the launcher says which rank failed
    let output = hicache(&["replay", "--tp-size", "2", "--processes", "--dir", "/proc/hicache-cannot-be-here"], "");
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(stderr(&output).contains("(a process of its own) failed"), "{}", stderr(&output));
    assert_usage_error(&hicache(&["replay", "--processes", "--backend", "memory"], ""), "--processes needs a storage");
    assert_usage_error(&hicache(&["replay", "--process-rank", "1"], ""), "set by --processes");
}

#[test]
fn replay_refuses_bad_settings_with_exit_code_2() {
    if cfg!(feature = "cuda") {
        // compiled in: on a machine without a GPU, a runtime error that says so (the GPU run is in docs/gpu.md)
        let output = hicache(&["replay", "--engine", "cuda", "--clients", "1"], "");
        if !std::path::Path::new("/dev/nvidiactl").exists() {
            assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
            assert!(stderr(&output).contains("CUDA driver"), "{}", stderr(&output));
        }
    } else {
        assert_usage_error(&hicache(&["replay", "--engine", "cuda"], ""), "--features cuda");
    }
    assert_usage_error(&hicache(&["replay", "--host-tokens", "1024", "--device-tokens", "2048"], ""), "--host-tokens");
    assert_usage_error(&hicache(&["replay", "--device-tokens", "64"], ""), "cannot hold one conversation");
    assert_usage_error(&hicache(&["replay", "--clients", "0"], ""), "--clients must be at least 1");
    let output = hicache(&["replay", "--backend", "tape"], "");
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).contains("'tape'")
            && stderr(&output).contains("[possible values: none, ")
            && stderr(&output).contains("file, memory"),
        "{}",
        stderr(&output)
    );
}

/// Sends `GET /metrics` to `addr` and returns the body.
fn scrape(addr: &str) -> String {
    scrape_accepting(addr, None).1
}

/// Sends `GET /metrics` to `addr` with an `Accept` header or none; returns the content type and the body.
fn scrape_accepting(addr: &str, accept: Option<&str>) -> (String, String) {
    use std::io::Read as _;
    let mut stream = std::net::TcpStream::connect(addr).expect("the metrics endpoint accepts");
    let accept = accept.map_or_else(String::new, |accept| format!("Accept: {accept}\r\n"));
    stream.write_all(format!("GET /metrics HTTP/1.0\r\nHost: hicache\r\n{accept}\r\n").as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.0 200") || response.starts_with("HTTP/1.1 200"), "{response}");
    let (head, body) = response.split_once("\r\n\r\n").expect("a body");
    let content_type =
        head.lines().find_map(|line| line.strip_prefix("Content-Type: ")).expect("a content type").to_owned();
    (content_type, body.to_owned())
}

fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find_map(|line| line.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .map(|value| value.parse().unwrap_or_else(|_| panic!("{name} has value {value:?}")))
}

#[test]
fn metrics_are_served_while_a_replay_runs() {
    use std::io::BufRead as _;
    let mut child = Command::new(env!("CARGO_BIN_EXE_hicache"))
        .args(["replay", "--backend", "memory", "--clients", "200", "--rounds", "5", "--metrics-addr", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let first = lines.next().expect("a line on stderr").unwrap();
    let addr = first.split("http://").nth(1).and_then(|rest| rest.strip_suffix("/metrics")).expect(&first).to_owned();
    // every metric shows up once its first event happened: poll until all have (writes are acked a tick after the
    // request that made them), all while the replay still runs
    let counters = [
        "hicache_requests_total",
        "hicache_prompt_tokens_total",
        "hicache_transfer_bytes_total{path=\"device_to_host\"}",
    ];
    let families =
        ["hicache_hit_tokens_total", "hicache_prefetch_stops_total", "hicache_prefetch_gbps", "hicache_load_gbps"];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let body = scrape(&addr);
        let counted = counters.iter().all(|name| metric(&body, name).is_some_and(|value| value > 0.0));
        if counted && families.iter().all(|name| body.contains(name)) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "metrics missing after 60 s: {body}");
        assert!(child.try_wait().unwrap().is_none(), "the replay ended before every metric showed: {body}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(child.try_wait().unwrap().is_none(), "scraped during the run, not after");
    // each format under its own content type: OpenMetrics for a scraper that asks for it (as Prometheus does), the
    // 0.0.4 text format otherwise
    let prometheus = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    let (content_type, body) = scrape_accepting(&addr, Some(prometheus));
    assert!(content_type.starts_with("application/openmetrics-text; version=1.0.0"), "{content_type}");
    assert!(body.ends_with("# EOF\n"), "{body}");
    let (content_type, body) = scrape_accepting(&addr, None);
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "{content_type}");
    assert!(!body.contains("# EOF") && body.contains("# TYPE hicache_requests_total counter"), "{body}");
    // connections that never send cost no thread each: past the few the endpoint serves and queues, they are closed
    let threads = || {
        let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
        status.lines().find_map(|line| line.strip_prefix("Threads:")).unwrap().trim().parse::<usize>().unwrap()
    };
    let before = threads();
    let silent: Vec<std::net::TcpStream> = (0..600).map(|_| std::net::TcpStream::connect(&addr).unwrap()).collect();
    // the last was accepted after all the others, beyond the queue: the endpoint closes it (wait for that, bounded)
    let last = silent.last().unwrap();
    last.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    assert_eq!(std::io::Read::read(&mut &*last, &mut [0; 16]).expect("closed, not timed out"), 0, "closed unanswered");
    assert!(threads() <= before + 1, "{} threads with 600 idle connections, {before} before", threads());
    drop(silent);
    // served again once they are gone: a scrape that arrives while the endpoint still drains the silent connections
    // it accepted (its queue full) is closed unanswered, so scrapes are tried until one is answered, within a deadline
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        use std::io::Read as _;
        let mut stream = std::net::TcpStream::connect(&addr).expect("the metrics endpoint accepts");
        // (one closed unanswered may refuse the request too)
        let _ = stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: hicache\r\n\r\n");
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        if response.starts_with("HTTP/1.1 200") && response.contains("hicache_requests_total") {
            break;
        }
        assert!(response.is_empty(), "neither answered nor closed unanswered: {response}");
        assert!(std::time::Instant::now() < deadline, "not served again within 30 s of the silent connections' end");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // the rest of the run is not needed
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn rust_log_turns_on_tracing_events_and_is_silent_without() {
    let run = |filter: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_hicache"));
        command.args(["replay", "--clients", "4", "--rounds", "2", "--backend", "memory"]).env_remove("RUST_LOG");
        if let Some(filter) = filter {
            command.env("RUST_LOG", filter);
        }
        let output = command.output().unwrap();
        assert!(output.status.success());
        String::from_utf8(output.stderr).unwrap()
    };
    assert_eq!(run(None), "");
    let events = run(Some("hicache_core=debug"));
    assert!(events.contains("prefetch finished") && events.contains("stop=Revoked"), "{events}");
    assert!(!events.contains('\u{1b}'), "no colour codes when stderr is not a terminal");
}

#[test]
fn bench_transfer_reports_every_layout_and_direction_next_to_bulk() {
    let args = ["bench", "transfer", "--json", "--tokens", "64", "--page-size", "16", "--rounds", "1"];
    let output = hicache(&[&args[..], &["--geometry", "llama31-8b"]].concat(), "");
    assert!(output.status.success(), "{}", stderr(&output));
    let figures: Vec<Value> = serde_json::from_str(&stdout(&output)).expect("a JSON list");
    let mut seen: Vec<(String, String)> = figures
        .iter()
        .map(|figure| (figure["layout"].as_str().unwrap().to_owned(), figure["direction"].as_str().unwrap().to_owned()))
        .collect();
    seen.sort();
    let mut expected: Vec<(String, String)> = ["layer_first", "page_first", "page_first_direct", "page_unified"]
        .iter()
        .flat_map(|layout| ["write", "load"].map(|direction| (layout.to_string(), direction.to_owned())))
        .collect();
    expected.sort();
    assert_eq!(seen, expected);
    for figure in &figures {
        assert_eq!((figure["geometry"].as_str(), figure["page_size"].as_u64()), (Some("llama-3.1-8b"), Some(16)));
        assert_eq!(figure["item_bytes"], 2048, "8 heads × 128 × bf16");
        let (gbps, bulk) = (figure["gbps"].as_f64().unwrap(), figure["bulk_gbps"].as_f64().unwrap());
        assert!(gbps > 0.0 && bulk > 0.0);
        assert!((figure["ratio"].as_f64().unwrap() - gbps / bulk).abs() < 1e-9);
        assert_eq!(figure["first_layer_us"].is_number(), figure["direction"] == "load");
    }
    let cuda = hicache(&["bench", "transfer", "--engine", "cuda"], "");
    if cfg!(feature = "cuda") {
        // built with the GPU engine, run where there is no GPU (CI): a runtime error naming what is missing
        assert_eq!(cuda.status.code(), Some(1), "{}", stderr(&cuda));
        assert!(stderr(&cuda).contains("CUDA driver"), "{}", stderr(&cuda));
    } else {
        assert_usage_error(&cuda, "--features cuda");
    }
    assert_usage_error(&hicache(&["bench", "transfer", "--tokens", "100", "--page-size", "64"], ""), "divide --tokens");
    // page-unified pages cut into head groups: the figure says how many
    let grouped = [&args[..], &["--geometry", "llama31-8b", "--layout", "page-unified", "--head-group", "2"]].concat();
    let output = hicache(&grouped, "");
    assert!(output.status.success(), "{}", stderr(&output));
    let figures: Vec<Value> = serde_json::from_str(&stdout(&output)).expect("a JSON list");
    assert!(figures.len() == 2 && figures.iter().all(|figure| figure["head_groups"] == 4), "{figures:?}");
    let uneven = [&args[..], &["--layout", "page-unified", "--head-group", "3"]].concat();
    assert_usage_error(&hicache(&uneven, ""), "--head-group 3");
}

/// Every option and argument of every subcommand has a description in its `--help`.
#[test]
fn every_subcommand_describes_every_option() {
    let commands: &[&[&str]] = &[
        &["hash"],
        &["bench", "hash"],
        &["bench", "storage"],
        &["bench", "transfer"],
        &["bench", "controller"],
        &["replay"],
        &["config", "check"],
        &["store", "put"],
        &["store", "get"],
        &["store", "exists"],
        &["store", "ls"],
        &["store", "rm"],
        &["store", "clear"],
        &["store", "stat"],
    ];
    for command in commands {
        let output = hicache(&[*command, &["--help"][..]].concat(), "");
        assert!(output.status.success(), "{command:?}");
        let help = stdout(&output);
        let lines: Vec<&str> = help.lines().collect();
        let mut options = 0;
        for (index, line) in lines.iter().enumerate() {
            let trimmed = line.trim_start();
            let is_entry = line.starts_with("  ") && (trimmed.starts_with('-') || trimmed.starts_with('<'));
            if !is_entry || line.starts_with("          ") {
                continue;
            }
            options += 1;
            // "  --flag <V>  Description", or the description on the next line (long help)
            let (name, rest) = trimmed.split_once("  ").unwrap_or((trimmed, ""));
            let below =
                lines.get(index + 1).is_some_and(|next| next.starts_with("          ") && !next.trim().is_empty());
            assert!(!rest.trim().is_empty() || below, "{command:?}: {name} has no description:\n{help}");
        }
        assert!(options >= 2, "{command:?}: no options found in\n{help}");
    }
}

#[test]
fn help_describes_every_option() {
    let output = hicache(&["hash", "--help"], "");
    let help = stdout(&output);
    for option in ["--page-size", "--prior", "--partial", "--json", "[FILE]", "reject", "drop"] {
        assert!(help.contains(option), "hash --help lacks {option}: {help}");
    }
    let help = stdout(&hicache(&["bench", "hash", "--help"], ""));
    for option in ["--json", "--seconds", "--tokens"] {
        assert!(help.contains(option), "bench hash --help lacks {option}: {help}");
    }
    let help = stdout(&hicache(&["--help"], ""));
    assert!(help.contains("hash") && help.contains("bench"), "{help}");
}

#[test]
fn bench_storage_via_the_controller_moves_pool_pages_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap();
    let args = ["--pages", "12", "--page-bytes", "65536", "--batch", "5", "--rounds", "2", "--json"];
    let output = hicache(&[&["bench", "storage", "--via", "controller", "--dir", path][..], &args].concat(), "");
    assert!(output.status.success(), "{}", stderr(&output));
    let figure: Value = serde_json::from_str(&stdout(&output)).expect("one JSON object");
    assert_eq!((figure["backend"].as_str(), figure["via"].as_str()), (Some("file"), Some("controller")));
    assert_eq!((figure["pages"].as_u64(), figure["page_bytes"].as_u64()), (Some(12), Some(65536)));
    for field in ["set_gbps", "direct_set_gbps", "get_gbps", "direct_get_gbps"] {
        assert!(figure[field].as_f64().is_some_and(|value| value > 0.0), "{field} in {figure}");
    }
    // two rounds, alternating which path goes first; the ratio is the median (here the mean) of the paired ratios
    let rounds = figure["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 2);
    assert_ne!(rounds[0]["controller_first"], rounds[1]["controller_first"]);
    let paired = |round: &Value, path: &str| {
        round[format!("{path}_gbps")].as_f64().unwrap() / round[format!("direct_{path}_gbps")].as_f64().unwrap()
    };
    for path in ["set", "get"] {
        let median = (paired(&rounds[0], path) + paired(&rounds[1], path)) / 2.0;
        assert!((figure[format!("{path}_ratio")].as_f64().unwrap() - median).abs() < 1e-9, "{path}: {figure}");
        let best = rounds.iter().map(|round| round[format!("{path}_gbps")].as_f64().unwrap()).fold(0.0, f64::max);
        assert_eq!(figure[format!("{path}_gbps")].as_f64().unwrap(), best, "{path}: {figure}");
    }
    assert_eq!(figure["staging_bytes"], 0, "{figure}");
    let leftovers = everything(dir.path());
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
}

#[test]
fn bench_storage_reports_backend_and_raw_figures_as_json() {
    let dir = tempfile::tempdir().unwrap();
    for format in ["native", "sglang"] {
        let output = hicache(
            &["bench", "storage", "--backend", "file", "--format", format, "--dir", dir.path().to_str().unwrap()]
                .into_iter()
                .chain(["--pages", "16", "--page-bytes", "65536", "--batch", "5", "--rounds", "1", "--json"])
                .collect::<Vec<_>>(),
            "",
        );
        assert!(output.status.success(), "{}", stderr(&output));
        let figure: Value = serde_json::from_str(&stdout(&output)).expect("one JSON object");
        assert_eq!(figure["backend"], "file");
        assert_eq!((figure["format"].as_str(), figure["direct"].as_bool()), (Some(format), Some(false)));
        assert_eq!((figure["batch"].as_u64(), figure["round_count"].as_u64()), (Some(5), Some(1)));
        assert_eq!(figure["dir"].as_str(), dir.path().to_str());
        assert_eq!((figure["pages"].as_u64(), figure["page_bytes"].as_u64()), (Some(16), Some(65536)));
        for field in ["set_gbps", "get_gbps", "raw_write_gbps", "raw_read_gbps"] {
            assert!(figure[field].as_f64().is_some_and(|value| value > 0.0), "{field} in {figure}");
        }
    }
    // the benchmark cleans up after itself: no pages, no raw file, no empty folders
    let leftovers = everything(dir.path());
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
    let output = hicache(
        &[
            "bench",
            "storage",
            "--backend",
            "memory",
            "--pages",
            "4",
            "--page-bytes",
            "1024",
            "--rounds",
            "1",
            "--dir",
            dir.path().to_str().unwrap(),
        ],
        "",
    );
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stdout(&output).contains("set") && stdout(&output).contains("raw sequential read"), "{}", stdout(&output));
}

/// The folder of the NIXL library: `$HICACHE_NIXL_LIB_DIR` (set by `cargo xtask ci`), else where `cargo xtask nixl`
/// unpacks it.
fn nixl_lib_dir() -> std::path::PathBuf {
    std::env::var_os("HICACHE_NIXL_LIB_DIR").filter(|dir| !dir.is_empty()).map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/nixl/lib/.nixl_cu12.mesonpy.libs"),
        std::path::PathBuf::from,
    )
}

#[test]
fn bench_storage_and_store_run_on_nixl_when_compiled_in() {
    if !cfg!(feature = "nixl") {
        return;
    }
    let lib_dir = nixl_lib_dir();
    assert!(
        lib_dir.join("libnixl_capi.so").is_file(),
        "run `cargo xtask nixl` first: no library in {}",
        lib_dir.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_hicache"))
            .args(args)
            .env("HICACHE_NIXL_LIB_DIR", &lib_dir)
            .output()
            .expect("the binary runs")
    };
    let dir_arg = dir.path().to_str().unwrap();
    let output = run(&[
        "bench",
        "storage",
        "--backend",
        "nixl",
        "--nixl-plugin",
        "POSIX",
        "--dir",
        dir_arg,
        "--pages",
        "16",
        "--page-bytes",
        "65536",
        "--batch",
        "5",
        "--rounds",
        "1",
        "--json",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let figure: Value = serde_json::from_str(&stdout(&output)).expect("one JSON object");
    assert_eq!(figure["backend"], "nixl");
    for field in ["set_gbps", "get_gbps", "raw_write_gbps", "raw_read_gbps", "set_ratio", "get_ratio"] {
        assert!(figure[field].as_f64().is_some_and(|value| value > 0.0), "{field} in {figure}");
    }
    assert!(walk(dir.path()).is_empty(), "the benchmark cleans up: {:?}", walk(dir.path()));
    // the replay on the NIXL tier: pages the host evicted come back from it, every byte checked
    let output = run(&[
        "replay",
        "--json",
        "--backend",
        "nixl",
        "--dir",
        dir_arg,
        "--clients",
        "24",
        "--host-tokens",
        "20480",
        "--sync-storage",
        WHOLE,
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let report: Value = serde_json::from_str(&stdout(&output)).expect("a JSON object");
    assert_eq!(report["verified"], true, "{report}");
    assert!(tokens(&report, "l3") > 0, "{report}");
    for page in walk(dir.path()) {
        std::fs::remove_file(page).unwrap();
    }
    // a page in and out by hand, under SGLang's NIXL name
    let page: Vec<u8> = (0..128u32).map(|index| (index * 7 + 3) as u8).collect();
    let input = dir.path().join("page.in");
    std::fs::write(&input, &page).unwrap();
    let key = "ab".repeat(32);
    let geometry = ["--layers", "2", "--kv-heads", "1", "--head-dim", "4", "--page-size", "4", "--model", "m"];
    let store = |action: &str, extra: &[&str]| {
        let args: Vec<&str> = ["store", action, "--backend", "nixl", "--dir", dir_arg]
            .iter()
            .copied()
            .chain(geometry)
            .chain(extra.iter().copied())
            .collect();
        run(&args)
    };
    let output = store("put", &["--key", &key, "--in", input.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(std::fs::read(dir.path().join(format!("{key}_m_0_1"))).unwrap(), page);
    let out = dir.path().join("page.out");
    let output = store("get", &["--key", &key, "--out", out.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(std::fs::read(&out).unwrap(), page);
    // without the library: a clear error, not an abort
    let output = Command::new(env!("CARGO_BIN_EXE_hicache"))
        .args(["store", "ls", "--backend", "nixl", "--dir", dir_arg])
        .args(geometry)
        .env("HICACHE_NIXL_LIB_DIR", "/nonexistent")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(stderr(&output).contains("/nonexistent/libnixl_capi.so does not exist"), "{}", stderr(&output));
}

/// Every file and folder below `dir`.
fn everything(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        found.push(entry.path());
        if entry.path().is_dir() {
            found.extend(everything(&entry.path()));
        }
    }
    found
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if entry.path().is_dir() {
            files.extend(walk(&entry.path()));
        } else {
            files.push(entry.path());
        }
    }
    files
}

#[test]
fn backends_not_compiled_in_say_how_to_rebuild() {
    // clap refuses the value, in its usual form (exit 2), with the feature to rebuild with
    let assert_refused = |output: &Output, needle: &str| {
        assert_eq!(output.status.code(), Some(2), "{}", stderr(output));
        assert!(stderr(output).contains(needle), "expected {needle:?} in {}", stderr(output));
    };
    if !cfg!(feature = "3fs") {
        let output = hicache(&["bench", "storage", "--backend", "3fs", "--pages", "1", "--page-bytes", "64"], "");
        assert_refused(&output, "--features 3fs");
        assert_refused(&hicache(&["replay", "--backend", "hf3fs"], ""), "--features 3fs");
    }
    if !cfg!(feature = "mooncake") {
        let output = hicache(&["bench", "storage", "--backend", "mooncake", "--pages", "1", "--page-bytes", "64"], "");
        assert_refused(&output, "rebuild with `cargo build --release -p hicache-cli --features mooncake`");
    }
    if !cfg!(feature = "nixl") {
        let output = hicache(&["bench", "storage", "--backend", "nixl", "--pages", "1", "--page-bytes", "64"], "");
        assert_refused(&output, "the nixl backend is not compiled into this hicache; rebuild with");
    }
    let output = hicache(&["bench", "storage", "--backend", "floppy"], "");
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("floppy"), "{}", stderr(&output));
    assert_usage_error(&hicache(&["bench", "storage", "--page-bytes", "3"], ""), "--page-bytes even");
}

#[test]
fn config_check_prints_resolved_values_and_names_bad_fields() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.json");
    std::fs::write(&good, r#"{"page_size": 64, "write_policy": "write_back", "storage_backend": "file"}"#).unwrap();
    let output = hicache(&["config", "check", "--json", good.to_str().unwrap()], "");
    assert!(output.status.success(), "{}", stderr(&output));
    let resolved: Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(resolved["page_size"], 64);
    assert_eq!(resolved["write_policy"], "write_back");
    assert_eq!(resolved["prefetch_threshold"], 256, "defaults are filled in");
    let text = stdout(&hicache(&["config", "check", good.to_str().unwrap()], ""));
    assert!(text.contains("valid") && text.contains("storage_batch_pages = 128"), "{text}");

    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"page_size": 64, "prefetch_policy": "eventually"}"#).unwrap();
    let output = hicache(&["config", "check", bad.to_str().unwrap()], "");
    assert_usage_error(&output, "config field `prefetch_policy`: unknown variant `eventually`");
    assert!(stderr(&output).contains("wait_complete"), "the allowed values are listed: {}", stderr(&output));
    // the tier's extra config is read as the Python package reads it
    std::fs::write(&bad, r#"{"storage_backend": "file", "storage_backend_extra_config": {"dir": 1}}"#).unwrap();
    let output = hicache(&["config", "check", bad.to_str().unwrap()], "");
    assert_usage_error(&output, "config field `storage_backend_extra_config.dir`: invalid type: integer `1`");
    assert_usage_error(
        &hicache(&["config", "check", "/no/such/config.json"], ""),
        "cannot read config file /no/such/config.json",
    );
}

#[test]
fn bad_input_exits_2_with_one_line_naming_it() {
    for addr in ["notanaddr", "999.1.1.1:1"] {
        let output = hicache(&["replay", "--clients", "1", "--rounds", "1", "--metrics-addr", addr], "");
        assert_usage_error(&output, &format!("--metrics-addr {addr}: not an address to listen on"));
    }
    // binary and text garbage alike
    assert_usage_error(&hicache_bytes(&["hash", "--page-size", "4"], &[0xff, 0xfe, 0x00, 0x80]), "not text");
    assert_usage_error(&hicache(&["hash", "--page-size", "4"], "1 2 three 4"), "three");
    let output = hicache(&["hash", "--page-size", "4"], "\n");
    assert_usage_error(&output, "no tokens in standard input");
    assert!(output.stdout.is_empty());
}

#[test]
fn config_example_lists_every_field_at_its_default_and_checks_clean() {
    let output = hicache(&["config", "example"], "");
    assert!(output.status.success(), "{}", stderr(&output));
    let example: Value = serde_json::from_str(&stdout(&output)).expect("JSON");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("example.json");
    std::fs::write(&path, stdout(&output)).unwrap();
    let checked = hicache(&["config", "check", "--json", path.to_str().unwrap()], "");
    assert!(checked.status.success(), "{}", stderr(&checked));
    let resolved: Value = serde_json::from_str(&stdout(&checked)).expect("JSON");
    // every field the checker resolves is in the example, with the same (default) value
    assert_eq!(example, resolved);
    assert_eq!(example["page_size"], 1, "SGLang's default page size");
    assert!(example.as_object().unwrap().len() >= 15, "{example}");
}

#[test]
fn hostile_sizes_are_refused_naming_the_flags_before_anything_is_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap();
    let key = "ab".repeat(32);
    let out = dir.path().join("out.bin");
    let out = out.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["store", "put", "--page-size", "140737488355328", "--key", &key, "--in", "/dev/zero", "--dir", path],
            "page_size",
        ),
        (
            vec![
                "store",
                "put",
                "--layers",
                "9223372036854775808",
                "--dtype",
                "fp8-e4m3",
                "--key",
                &key,
                "--in",
                "/dev/zero",
                "--dir",
                path,
            ],
            "bytes per token overflow",
        ),
        (
            vec!["bench", "storage", "--page-bytes", "9223372036854775808", "--dir", path],
            "--pages, --page-bytes: the sizes overflow",
        ),
        (
            vec!["bench", "storage", "--pages", "4611686018427387904", "--page-bytes", "8", "--dir", path],
            "--pages, --page-bytes",
        ),
        (vec!["bench", "storage", "--pages", "1000000", "--dir", path], "--pages, --page-bytes: this needs about"),
        (
            vec!["store", "get", "--page-size", "1073741824", "--key", &key, "--out", out, "--dir", path],
            "this needs about",
        ),
        (vec!["replay", "--clients", "4294967296", "--rounds", "1"], "--clients"),
        (vec!["replay", "--layers", "100000000"], "--layers"),
        (vec!["replay", "--request-length", "1000000000"], "--request-length"),
        (vec!["replay", "--tp-size", "1000", "--kv-heads", "1000"], "--tp-size"),
    ];
    for (args, needle) in cases {
        assert_usage_error(&hicache(&args, ""), needle);
    }
    // an input that never ends is read only up to one byte past the pages it should hold
    let output = hicache(
        &["store", "put", "--layers", "1", "--kv-heads", "1", "--head-dim", "64", "--page-size", "4", "--key", &key]
            .into_iter()
            .chain(["--in", "/dev/zero", "--dir", path])
            .collect::<Vec<_>>(),
        "",
    );
    assert_usage_error(&output, "has more than 1024 bytes; 1 page of 1024 bytes are 1024");
    assert!(everything(dir.path()).is_empty(), "nothing was written: {:?}", everything(dir.path()));
}

#[test]
fn replay_verifies_every_byte_under_injected_storage_faults_and_counts_them() {
    let report = replay_json(&[
        "--tp-size",
        "2",
        "--host-tokens",
        "20480",
        "--sync-storage",
        "--fault-fail-rate",
        "0.05",
        "--fault-corrupt-rate",
        "0.05",
        "--fault-latency-us",
        "50",
        WHOLE,
    ]);
    assert_eq!(report["verified"], true, "{report}");
    assert_eq!(report["lockstep"], true, "the ranks saw different faults and still decided the same: {report}");
    let faults = &report["faults_injected"];
    assert!(faults["failed_pages"].as_u64().unwrap() > 0 && faults["corrupt_pages"].as_u64().unwrap() > 0, "{report}");
    let failures = &report["storage_failures"];
    assert!(failures["backup_pages_failed"].as_u64().unwrap() > 0, "{report}");
    assert!(failures["prefetch_errors"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["parameters"]["fault_fail_rate"], 0.05);
    // without faults, nothing is injected and the report has no such field
    let clean = replay_json(&["--clients", "8", "--rounds", "2"]);
    assert!(clean.get("faults_injected").is_none(), "{clean}");
    assert_eq!(clean["storage_failures"]["backup_pages_failed"], 0);
    assert_usage_error(
        &hicache(&["replay", "--fault-fail-rate", "1.5"], ""),
        "--fault-fail-rate 1.5 must be a probability",
    );
    // storage calls that hang a while and then time out: every policy carries on, and the bytes are still right
    for policy in ["timeout", "best-effort"] {
        let hung = replay_json(&[
            "--clients",
            "16",
            "--rounds",
            "3",
            "--prefetch-policy",
            policy,
            "--fault-hang-rate",
            "0.3",
            "--fault-hang-ms",
            "5",
        ]);
        assert_eq!(hung["verified"], true, "{policy}: {hung}");
        assert!(hung["faults_injected"]["failed_calls"].as_u64().unwrap() > 0, "{policy}: {hung}");
    }
    // wait_complete would wait out every hang; calls that hang longer than the read deadline stop their prefetches
    let stalled = replay_json(&[
        "--clients",
        "16",
        "--rounds",
        "3",
        "--prefetch-policy",
        "wait-complete",
        "--fault-hang-rate",
        "0.3",
        "--fault-hang-ms",
        "400",
        "--storage-read-deadline",
        "0.05",
        WHOLE,
    ]);
    assert_eq!(stalled["verified"], true, "{stalled}");
    assert!(stalled["prefetch_stop_reasons"]["stalled"].as_u64().unwrap_or(0) > 0, "{stalled}");
    assert_usage_error(
        &hicache(&["replay", "--storage-read-deadline", "0"], ""),
        "--storage-read-deadline 0.0 must be a number of seconds in (0, 86400]",
    );
}

#[test]
fn replay_computes_what_a_slow_tier_would_bring_later() {
    // 20 MB/s: a page of 128 KiB reads in 6.5 ms at least and computes in 1.3 ms (25 000 tokens/s); once a read is
    // measured, every hit is computed instead (without splits)
    let slow = replay_json(&["--fault-read-mbps", "20", "--no-split"]);
    assert_eq!(slow["verified"], true, "{slow}");
    let plans = &slow["prefetch_plans"];
    assert!(plans["decisions"]["recompute_faster"].as_u64().unwrap_or(0) > 0, "{plans}");
    assert!(plans["decisions"].get("split").is_none(), "{plans}");
    assert!(plans["tokens_recomputed"].as_u64().unwrap() > 0, "{plans}");
    assert!(slow["prefetch_stop_reasons"]["recompute_faster"].as_u64().unwrap_or(0) > 0, "{slow}");
    let rates = &plans["agreed_rates"];
    assert!(rates["storage_read_gbps"].as_f64().is_some_and(|gbps| gbps > 0.0), "{rates}");
    assert!((rates["prefill_tokens_per_s"].as_f64().unwrap() / 25_000.0 - 1.0).abs() < 1e-6, "{rates}");
    assert_eq!(slow["parameters"]["fault_read_mbps"], 20);
    // SGLang's way, for comparison: no plan
    let whole = replay_json(&["--fault-read-mbps", "20", WHOLE]);
    assert_eq!(whole["prefetch_plans"]["decisions"], serde_json::json!({}), "{whole}");
    assert!(whole["prefetch_stop_reasons"].get("recompute_faster").is_none(), "{whole}");
}

#[test]
fn replay_splits_a_hit_between_computing_its_head_and_reading_its_tail() {
    // at 20 MB/s a page reads 5 times slower than it computes: computing the first 5/6 of a hit while the last 1/6
    // is read beats both computing all of it and reading all of it; every byte loaded is checked
    let split = replay_json(&["--fault-read-mbps", "20"]);
    assert_eq!(split["verified"], true, "{split}");
    let plans = &split["prefetch_plans"];
    assert!(plans["decisions"]["split"].as_u64().unwrap_or(0) > 0, "{plans}");
    assert!(plans["tokens_recomputed"].as_u64().unwrap() > 0, "{plans}");
    // a split is planned so that its tail lands as its head is done; whether it has (and so whether any tail comes
    // from storage here) depends on how busy the machine is: a tail running late is computed instead, rightly. The
    // tail hung below its head is checked with a clock the test moves (hicache-core's tree tests). What does not
    // depend on timing: no prefetch failed
    for failed in ["failed", "stalled", "timed_out"] {
        assert!(split["prefetch_stop_reasons"].get(failed).is_none(), "{failed}: {split}");
    }
    assert_eq!(split["storage_failures"]["prefetch_errors"], 0, "{split}");
    assert_eq!(
        (split["parameters"]["no_split"].clone(), split["parameters"]["no_meet"].clone()),
        (false.into(), false.into())
    );
    // the engine meets the reads from the end; without that, it computes the head and waits for the tail
    let head_only = replay_json(&["--fault-read-mbps", "20", "--no-meet"]);
    assert_eq!(head_only["verified"], true, "{head_only}");
    assert!(head_only["prefetch_stop_reasons"].get("met").is_none(), "{head_only}");
    // and in lockstep over two ranks, which plan and split the same
    let ranks = replay_json(&["--fault-read-mbps", "20", "--tp-size", "2", "--clients", "8"]);
    assert_eq!((ranks["verified"].clone(), ranks["lockstep"].clone()), (true.into(), true.into()), "{ranks}");
    // each request's storage hit is weighed against reading all of it and against the better of that and computing
    // all of it (how many come out slower depends on the machine's load; the second count holds the first)
    for report in [&split, &head_only, &ranks] {
        let plans = &report["prefetch_plans"];
        let count = |name: &str| plans[name].as_u64().unwrap_or_else(|| panic!("{name}: {plans}"));
        assert!(count("slower_than_best") >= count("slower_than_fetch_whole"), "{plans}");
    }
}

#[test]
fn options_that_do_nothing_with_the_backend_are_refused() {
    let cases: [(&[&str], &str); 11] = [
        (&["--backend", "file", "--extra-config", "{oops"], "--extra-config is not JSON"),
        // every tier reads the extra config, strictly, under its own keys
        (&["--backend", "file", "--extra-config", r#"{"dir": 1}"#], "--backend file setting `dir`: invalid type"),
        (
            &["--backend", "file", "--extra-config", r#"{"capacty": 1}"#],
            "--backend file setting `capacty`: unknown key for the file tier (it takes: dir,",
        ),
        (
            &["--backend", "memory", "--extra-config", r#"{"x": 1}"#],
            "--backend memory setting `x`: unknown key for the memory tier (it takes none)",
        ),
        (
            &["--backend", "file", "--dir", "/tmp", "--extra-config", r#"{"dir": "/tmp"}"#],
            "--backend file: `dir` is given twice, by a flag and by the extra config",
        ),
        (
            &["--backend", "file", "--extra-config", r#"{"backend": "memory"}"#],
            "--extra-config key `backend`: \"memory\" differs from --backend file",
        ),
        (
            &["--backend", "none", "--extra-config", r#"{"x": 1}"#],
            "--extra-config key `x` does nothing with --backend none",
        ),
        (&["--backend", "none", "--extra-config", "[1]"], "--extra-config must be a JSON object"),
        (&["--backend", "memory", "--format", "sglang"], "--format sglang does nothing with --backend memory"),
        (&["--backend", "file", "--key-scheme", "sglang"], "--key-scheme does nothing with --backend file"),
        (&["--backend", "none", "--sglang-release", "0.5.2"], "--sglang-release does nothing with --backend none"),
    ];
    for (flags, needle) in cases {
        assert_usage_error(&hicache(&[&["replay"], flags].concat(), ""), needle);
    }
    let empty = replay_json(&["--clients", "2", "--rounds", "1", "--backend", "file", "--extra-config", "{}"]);
    assert_eq!(empty["verified"], true, "an empty extra config is no setting at all");
    // the file tier's own keys, as the Python package takes them, place its pages
    let dir = tempfile::tempdir().unwrap();
    let extra = serde_json::json!({"dir": dir.path(), "capacity": "1gb", "io_threads": 2}).to_string();
    let placed = replay_json(&["--clients", "2", "--rounds", "2", "--extra-config", &extra]);
    assert_eq!(placed["verified"], true);
    assert!(dir.path().join("hicache-v1").is_dir(), "pages under the extra config's dir");
}

#[test]
fn a_tier_registered_in_its_own_crate_is_a_backend_of_every_command() {
    // `probe` is registered only by hicache-core's `testing` feature (which this test build links), never named by
    // the CLI: the table of tiers alone makes it a backend, with its own settings read strictly
    let help = stdout(&hicache(&["replay", "--help"], ""));
    assert!(help.contains("- probe:") && help.contains("memory pages under another name (tests only)"), "{help}");
    let run = replay_json(&[
        "--clients",
        "2",
        "--rounds",
        "2",
        "--backend",
        "probe-alias",
        "--extra-config",
        r#"{"label": "x"}"#,
    ]);
    assert_eq!((run["verified"].clone(), run["parameters"]["backend"].clone()), (true.into(), "probe".into()), "{run}");
    assert_usage_error(
        &hicache(&["replay", "--backend", "probe", "--extra-config", r#"{"label": 1}"#], ""),
        "--backend probe setting `label`: invalid type",
    );
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path().to_str().unwrap();
    let bench = ["bench", "storage", "--backend", "probe", "--dir", dir, "--pages", "4", "--page-bytes", "4096"];
    let bench = hicache(&bench, "");
    assert!(bench.status.success(), "{}", stderr(&bench));
}

#[test]
fn input_files_are_read_within_a_size_limit() {
    assert_usage_error(&hicache(&["config", "check", "/dev/zero"], ""), "/dev/zero is larger than 1 MiB");
    assert_usage_error(&hicache(&["hash", "--page-size", "4", "/dev/zero"], ""), "/dev/zero is larger than 256 MiB");
    assert_usage_error(
        &hicache(&["store", "ls", "--backend", "file", "--dir", "/tmp", "--config", "/dev/zero"], ""),
        "/dev/zero is larger than 1 MiB",
    );
}

#[test]
fn out_of_range_flags_are_refused_at_once_by_name() {
    // each would have panicked (a duration past `Duration::MAX`), run for ever, or waited a minute for ranks that
    // never come
    let cases: [(&[&str], &str); 10] = [
        (
            &["--storage-read-deadline", "1e300"],
            "--storage-read-deadline 1e300 must be a number of seconds in (0, 86400]",
        ),
        (
            &["--fault-latency-us", "18446744073709551615"],
            "--fault-latency-us 18446744073709551615 is not in [0, 60000000]",
        ),
        (&["--fault-hang-ms", "600001"], "--fault-hang-ms 600001 is not in [0, 600000]"),
        (&["--tp-size", "100000"], "--tp-size × --pp-size 100000 is not in [1, 256]"),
        (&["--tp-size", "16", "--pp-size", "32", "--layers", "64"], "--tp-size × --pp-size 512 is not in [1, 256]"),
        (&["--pp-size", "0"], "--pp-size must be at least 1"),
        (&["--pp-size", "9"], "--pp-size 9 has more stages than --layers 8"),
        (&["--max-parallel", "2000000"], "--max-parallel 2000000 is not in [1, 1048576]"),
        (
            &["--processes", "--process-rank", "5", "--process-dir", "/tmp", "--tp-size", "2"],
            "--process-rank 5 is not a rank of --tp-size 2 × --pp-size 1",
        ),
        (&["--processes", "--process-rank", "1", "--tp-size", "2"], "--process-rank and --process-dir come together"),
    ];
    for (flags, needle) in cases {
        let started = std::time::Instant::now();
        assert_usage_error(&hicache(&[&["replay"], flags].concat(), ""), needle);
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "{flags:?} took {:?}", started.elapsed());
    }
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), r#"{"storage_read_deadline_s": 1e308}"#).unwrap();
    let output = hicache(&["config", "check", config.path().to_str().unwrap()], "");
    assert_ne!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(stderr(&output).contains("storage_read_deadline_s"), "{}", stderr(&output));
}

/// Processes whose command line mentions `needle` (the ranks of one launcher, by its temporary folder).
fn processes_mentioning(needle: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline"))
            && String::from_utf8_lossy(&cmdline).contains(needle)
        {
            found.push(pid);
        }
    }
    found
}

#[test]
fn ranks_end_with_their_launcher_and_remove_its_folders() {
    for signal in [libc::SIGKILL, libc::SIGTERM] {
        let temp = tempfile::tempdir().unwrap();
        let needle = temp.path().to_str().unwrap().to_owned();
        let mut launcher = Command::new(env!("CARGO_BIN_EXE_hicache"))
            .args(["replay", "--processes", "--tp-size", "2", "--clients", "400", "--rounds", "6"])
            .env("TMPDIR", temp.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        // both ranks run and write pages into the launcher's storage folder
        // (the ranks' command lines name folders in TMPDIR; the launcher's does not)
        while processes_mentioning(&needle).len() < 2 || everything(temp.path()).len() < 6 {
            assert!(std::time::Instant::now() < deadline, "the ranks did not start");
            assert!(launcher.try_wait().unwrap().is_none(), "the replay ended before the signal");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // SAFETY: kill(2) on our own child's pid
        assert_eq!(unsafe { libc::kill(launcher.id() as i32, signal) }, 0);
        launcher.wait().unwrap();
        // the ranks get SIGTERM from the kernel and remove the folders: wait for that, bounded
        while !processes_mentioning(&needle).is_empty() || !everything(temp.path()).is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "after signal {signal}: ranks {:?} still run, left behind: {:?}",
                processes_mentioning(&needle),
                everything(temp.path())
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

#[test]
fn a_replay_stopped_by_a_signal_removes_its_temporary_directory() {
    let temp = tempfile::tempdir().unwrap();
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_hicache"))
            .args(["replay", "--clients", "400", "--rounds", "6"])
            .env("TMPDIR", temp.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        // the file tier's pages are being written into the replay's own folder
        while everything(temp.path()).len() < 3 {
            assert!(std::time::Instant::now() < deadline, "no temporary directory appeared");
            assert!(child.try_wait().unwrap().is_none(), "the replay ended before the signal");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // SAFETY: kill(2) on our own child's pid
        assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(128 + signal), "exit status as a shell reports the signal");
        assert!(everything(temp.path()).is_empty(), "left behind: {:?}", everything(temp.path()));
    }
}
