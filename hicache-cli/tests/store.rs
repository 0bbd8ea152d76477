//! `hicache store`: pages by hand between local files and a backend, through the built binary — round trips
//! against an independent expectation (the bytes written, keys from `hicache hash`), and bad inputs with their exit
//! codes and messages.

use std::path::Path;
use std::process::{Command, Output};

use rand::RngExt as _;
use serde_json::Value;

/// A small geometry: 2 layers × 1 head × 4 dims of bf16, pages of 4 tokens: 4 × 2 × 2 × 8 = 128 bytes per page.
const GEOMETRY: [&str; 8] = ["--layers", "2", "--kv-heads", "1", "--head-dim", "4", "--page-size", "4"];
const PAGE_BYTES: usize = 128;

fn hicache(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_hicache"));
    command.args(args).env_remove("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("the binary runs")
}

fn store(action: &str, dir: &Path, extra: &[&str]) -> Output {
    store_as("m", action, dir, extra)
}

fn store_as(model: &str, action: &str, dir: &Path, extra: &[&str]) -> Output {
    let dir = dir.to_str().unwrap();
    let mut args = vec!["store", action, "--dir", dir, "--model", model];
    args.extend(GEOMETRY);
    args.extend(extra);
    hicache(&args, &[])
}

fn ok(output: Output) -> String {
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

fn failure(output: &Output, code: i32, needle: &str) {
    let message = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(code), "{message}");
    assert!(message.contains(needle), "expected {needle:?} in {message:?}");
    assert!(!message.contains("panicked"), "{message}");
}

/// Writes `pages` random pages and a token file of that many pages; returns (tokens file, bytes).
fn fixture(dir: &Path, pages: usize) -> (String, Vec<u8>) {
    let tokens: Vec<String> = (0..pages * 4).map(|_| rand::rng().random_range(0..100_000u32).to_string()).collect();
    let path = dir.join("tokens.txt");
    std::fs::write(&path, tokens.join(" ")).unwrap();
    let mut bytes = vec![0u8; pages * PAGE_BYTES];
    rand::rng().fill(&mut bytes[..]);
    std::fs::write(dir.join("pages.bin"), &bytes).unwrap();
    (path.to_str().unwrap().to_owned(), bytes)
}

#[test]
fn pages_round_trip_and_every_command_sees_them() {
    let work = tempfile::tempdir().unwrap();
    let storage = work.path().join("storage");
    let (tokens, bytes) = fixture(work.path(), 3);
    let input = work.path().join("pages.bin");
    let output = work.path().join("back.bin");
    // the keys, independently: `hicache hash` of the same tokens
    let expected: Vec<String> =
        ok(hicache(&["hash", "--page-size", "4", &tokens], &[])).lines().map(str::to_owned).collect();
    let put: Value = serde_json::from_str(&ok(store(
        "put",
        &storage,
        &["--tokens", &tokens, "--in", input.to_str().unwrap(), "--json"],
    )))
    .unwrap();
    let put_keys: Vec<&str> = put.as_array().unwrap().iter().map(|page| page["key"].as_str().unwrap()).collect();
    assert_eq!(put_keys, expected);
    assert!(put.as_array().unwrap().iter().all(|page| page["outcome"] == "stored"));
    // a second put finds them present
    assert!(ok(store("put", &storage, &["--tokens", &tokens, "--in", input.to_str().unwrap()])).contains("present"));
    ok(store("get", &storage, &["--tokens", &tokens, "--out", output.to_str().unwrap()]));
    assert_eq!(std::fs::read(&output).unwrap(), bytes);
    // one page by key
    ok(store("get", &storage, &["--key", &expected[1], "--out", output.to_str().unwrap()]));
    assert_eq!(std::fs::read(&output).unwrap(), &bytes[PAGE_BYTES..2 * PAGE_BYTES]);
    let listed: Value = serde_json::from_str(&ok(store("ls", &storage, &["--json"]))).unwrap();
    let mut listed_keys: Vec<&str> =
        listed.as_array().unwrap().iter().map(|page| page["key"].as_str().unwrap()).collect();
    listed_keys.sort_unstable();
    let mut sorted = expected.iter().map(String::as_str).collect::<Vec<_>>();
    sorted.sort_unstable();
    assert_eq!(listed_keys, sorted);
    let stat: Value = serde_json::from_str(&ok(store("stat", &storage, &["--json"]))).unwrap();
    assert_eq!((stat["pages"].as_u64(), stat["page_bytes"].as_u64()), (Some(3), Some(PAGE_BYTES as u64)));
    assert!(stat["namespace"].as_str().unwrap().contains("model=m"));
    // another namespace (rank) sees nothing
    let other: Value =
        serde_json::from_str(&ok(store("stat", &storage, &["--tp-rank", "1", "--tp-size", "2", "--json"]))).unwrap();
    assert_eq!(other["pages"], 0);
    let exists: Value = serde_json::from_str(&ok(store(
        "exists",
        &storage,
        &["--key", &expected[0], "--key", "00".repeat(32).as_str(), "--key", &expected[2], "--json"],
    )))
    .unwrap();
    assert_eq!(exists["leading"], 1);
    assert_eq!(exists["present"][2][1], true);
    let removed: Value = serde_json::from_str(&ok(store("rm", &storage, &["--key", &expected[0], "--json"]))).unwrap();
    assert_eq!(removed["removed"], 1);
    failure(&store("get", &storage, &["--tokens", &tokens, "--out", output.to_str().unwrap()]), 1, &expected[0]);
    let cleared: Value = serde_json::from_str(&ok(store("clear", &storage, &["--json"]))).unwrap();
    assert_eq!(cleared["removed"], 2);
    assert_eq!(ok(store("ls", &storage, &[])), "");
}

#[test]
fn the_directory_and_namespace_come_from_sglangs_variable_and_a_config() {
    let work = tempfile::tempdir().unwrap();
    let storage = work.path().join("from-env");
    let (tokens, bytes) = fixture(work.path(), 2);
    let config = work.path().join("hicache.json");
    std::fs::write(&config, r#"{"storage_backend": "file", "model_name": "cfg", "page_size": 4}"#).unwrap();
    let input = work.path().join("pages.bin");
    let mut args = vec!["store", "put", "--config", config.to_str().unwrap(), "--tokens", &tokens];
    args.extend(["--in", input.to_str().unwrap(), "--layers", "2", "--kv-heads", "1", "--head-dim", "4"]);
    ok(hicache(&args, &[("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", &storage)]));
    // the pages landed in the variable's directory, under the config's model
    let stat: Value = serde_json::from_str(&ok(store_as("cfg", "stat", &storage, &["--json"]))).unwrap();
    assert_eq!(stat["pages"], 2);
    let output = work.path().join("back.bin");
    ok(store_as("cfg", "get", &storage, &["--tokens", &tokens, "--out", output.to_str().unwrap()]));
    assert_eq!(std::fs::read(&output).unwrap(), bytes);
}

#[test]
fn a_config_with_sglangs_extra_config_places_the_pages_where_it_says() {
    let work = tempfile::tempdir().unwrap();
    let storage = work.path().join("from-extra-config");
    let (tokens, bytes) = fixture(work.path(), 2);
    let config = work.path().join("sglang.json");
    // SGLang's own keys of a dynamic backend and the shared `pool` key are read as the Python package reads them
    let extra = serde_json::json!({
        "backend_name": "hicache", "module_path": "hicache.sglang", "class_name": "HiCacheStorage",
        "interface_v1": 1, "dir": storage, "pool": {"page_size": 4},
    });
    let text = serde_json::json!({"storage_backend": "file", "model_name": "cfg", "page_size": 4,
        "storage_backend_extra_config": extra});
    std::fs::write(&config, text.to_string()).unwrap();
    let input = work.path().join("pages.bin");
    let mut args = vec!["store", "put", "--config", config.to_str().unwrap(), "--tokens", &tokens];
    args.extend(["--in", input.to_str().unwrap(), "--layers", "2", "--kv-heads", "1", "--head-dim", "4"]);
    ok(hicache(&args, &[]));
    let stat: Value = serde_json::from_str(&ok(store_as("cfg", "stat", &storage, &["--json"]))).unwrap();
    assert_eq!(stat["pages"], 2);
    let output = work.path().join("back.bin");
    ok(store_as("cfg", "get", &storage, &["--tokens", &tokens, "--out", output.to_str().unwrap()]));
    assert_eq!(std::fs::read(&output).unwrap(), bytes);
    // the directory given twice, by the config and by --dir, is refused naming it
    args.extend(["--dir", storage.to_str().unwrap()]);
    failure(&hicache(&args, &[]), 2, "`dir` is given twice");
}

#[test]
fn bad_inputs_name_what_is_wrong() {
    let work = tempfile::tempdir().unwrap();
    let storage = work.path().join("s");
    std::fs::create_dir(&storage).unwrap();
    let (tokens, _) = fixture(work.path(), 2);
    let input = work.path().join("pages.bin");
    let input = input.to_str().unwrap();
    failure(&store("exists", &storage, &["--key", "xyz"]), 2, "--key xyz");
    failure(&store("put", &storage, &["--tokens", &tokens, "--in", "/nonexistent/pages.bin"]), 2, "cannot read --in");
    failure(
        &store("put", &storage, &["--key", &"ab".repeat(32), "--in", input]),
        2,
        "256 bytes; 1 page of 128 bytes are 128",
    );
    failure(&store("put", &storage, &["--tokens", "/nonexistent/tokens", "--in", input]), 2, "cannot read token file");
    std::fs::write(work.path().join("bad.txt"), "1 2 3 4294967296").unwrap();
    let bad = work.path().join("bad.txt");
    failure(&store("exists", &storage, &["--tokens", bad.to_str().unwrap()]), 2, "4294967296");
    failure(&store("exists", &storage, &[]), 2, "no pages named");
    // a short page is never stored, whatever --partial says; nothing reaches the directory
    let short = work.path().join("short.txt");
    std::fs::write(&short, "1 2 3 4 5 6").unwrap();
    let short = short.to_str().unwrap();
    failure(&store("put", &storage, &["--tokens", short, "--partial", "hash", "--in", input]), 2, "whole pages only");
    assert_eq!(ok(store("ls", &storage, &[])), "");
    failure(&store("ls", &storage, &["--page-bytes", "100"]), 2, "--page-bytes 100 does not match");
    failure(&store("ls", &storage, &["--backend", "floppy"]), 2, "floppy");
    let config = work.path().join("bad.json");
    std::fs::write(&config, r#"{"page_size": 0}"#).unwrap();
    failure(&store("ls", &storage, &["--config", config.to_str().unwrap()]), 2, "page_size");
    failure(&store("ls", &storage, &["--config", "/nonexistent.json"]), 2, "cannot read config");
}

#[test]
fn commands_that_only_read_create_nothing_and_a_missing_directory_is_an_error() {
    let work = tempfile::tempdir().unwrap();
    let missing = work.path().join("does/not/exist");
    let key = "ab".repeat(32);
    let out = work.path().join("out.bin");
    for (action, extra) in [
        ("ls", vec![]),
        ("stat", vec![]),
        ("exists", vec!["--key", key.as_str()]),
        ("get", vec!["--key", key.as_str(), "--out", out.to_str().unwrap()]),
        ("rm", vec!["--key", key.as_str()]),
        ("clear", vec![]),
    ] {
        failure(&store(action, &missing, &extra), 2, "the storage directory");
        failure(&store(action, &missing, &extra), 2, missing.to_str().unwrap());
        assert!(!work.path().join("does").exists(), "{action} created the directory");
    }
    // an existing empty directory: answered, and left empty
    let empty = work.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert_eq!(ok(store("ls", &empty, &[])), "");
    let stat: Value = serde_json::from_str(&ok(store("stat", &empty, &["--json"]))).unwrap();
    assert_eq!(stat["pages"], 0);
    let exists: Value = serde_json::from_str(&ok(store("exists", &empty, &["--key", &key, "--json"]))).unwrap();
    assert_eq!(exists["leading"], 0);
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0, "a read-only command wrote into the directory");
}

#[test]
fn a_named_geometry_sets_the_page_size_in_bytes_and_the_model_only_names_the_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap();
    let stat = |extra: &[&str]| -> Value {
        let args = [&["store", "stat", "--dir", path, "--json"][..], extra].concat();
        serde_json::from_str(&ok(hicache(&args, &[]))).unwrap()
    };
    // SGLang's sizes: 61 layers × (512 + 64) × 2 bytes × 64 tokens; 32 layers × 2 × 8 heads × 128 × 2 bytes × 64
    assert_eq!(stat(&["--geometry", "deepseek-v3"])["page_bytes"], 4_497_408);
    assert_eq!(stat(&["--geometry", "llama31-8b"])["page_bytes"], 8 << 20);
    let named = stat(&["--geometry", "llama31-8b", "--model", "deepseek-ai/DeepSeek-V3"]);
    assert_eq!(named["page_bytes"], 8 << 20, "the model name does not pick a geometry");
    assert_ne!(named["digest"], stat(&["--geometry", "llama31-8b"])["digest"], "but it is part of the namespace");
    let output = hicache(&["store", "stat", "--dir", path, "--geometry", "llama31-8b", "--layers", "4"], &[]);
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn a_capacity_holds_across_store_processes_and_comes_from_the_flag_or_the_config() {
    let work = tempfile::tempdir().unwrap();
    let storage = work.path().join("storage");
    let (_, bytes) = fixture(work.path(), 3);
    let page = work.path().join("page.bin");
    // three processes, one page each, a capacity of two native page files (128 bytes and a 16-byte footer); a file
    // per page, whose least recently used one goes (segment files evict whole segments, oldest first)
    let keys: Vec<String> = (1..=3).map(|index| format!("{index:02x}").repeat(32)).collect();
    for (index, key) in keys.iter().enumerate() {
        std::fs::write(&page, &bytes[index * PAGE_BYTES..(index + 1) * PAGE_BYTES]).unwrap();
        let page = page.to_str().unwrap();
        let per_file = r#"{"segment_threshold": 0}"#;
        ok(store(
            "put",
            &storage,
            &["--key", key, "--in", page, "--capacity-bytes", "288", "--extra-config", per_file],
        ));
    }
    let listed = ok(store("ls", &storage, &[]));
    assert_eq!(listed.lines().count(), 2, "{listed}");
    assert!(!listed.contains(&keys[0]), "the least recently used page went: {listed}");
    // the same from a config file
    let config = work.path().join("hicache.json");
    std::fs::write(&config, r#"{"storage_capacity_bytes": 144}"#).unwrap();
    std::fs::write(&page, &bytes[..PAGE_BYTES]).unwrap();
    ok(store(
        "put",
        &storage,
        &["--key", &keys[0], "--in", page.to_str().unwrap(), "--config", config.to_str().unwrap()],
    ));
    assert_eq!(ok(store("ls", &storage, &[])).lines().count(), 1);
    failure(
        &store("put", &storage, &["--key", &keys[0], "--in", page.to_str().unwrap(), "--capacity-bytes", "10"]),
        2,
        "capacity_bytes",
    );
}

/// A sidecar pool's entries (`--pool`, `--entry-bytes`) round trip in a namespace of their own: the KV namespace of
/// the same keys sees none of them, the `sglang` format names them as SGLang's `HiCacheFile` does, and bad pool
/// flags are usage errors naming the flag.
#[test]
fn a_sidecar_pools_entries_round_trip_beside_the_kv_pages() {
    let work = tempfile::tempdir().unwrap();
    let (tokens, _) = fixture(work.path(), 3);
    let entries_path = work.path().join("entries.bin");
    let mut entries = vec![0u8; 3 * 96];
    rand::rng().fill(&mut entries[..]);
    std::fs::write(&entries_path, &entries).unwrap();
    let output = work.path().join("back.bin");
    let keys: Vec<String> =
        ok(hicache(&["hash", "--page-size", "4", &tokens], &[])).lines().map(str::to_owned).collect();
    for format in ["native", "sglang"] {
        let storage = work.path().join(format);
        let pool = ["--pool", "mamba", "--entry-bytes", "96", "--format", format];
        let input = ["--tokens", &tokens, "--in", entries_path.to_str().unwrap()];
        ok(store("put", &storage, &[&pool[..], &input[..]].concat()));
        ok(store("get", &storage, &[&pool[..], &["--tokens", &tokens, "--out", output.to_str().unwrap()]].concat()));
        assert_eq!(std::fs::read(&output).unwrap(), entries, "{format}");
        let stat: Value =
            serde_json::from_str(&ok(store("stat", &storage, &[&pool[..], &["--json"]].concat()))).unwrap();
        assert_eq!((stat["pages"].as_u64(), stat["page_bytes"].as_u64()), (Some(3), Some(96)), "{format}");
        // the KV pages of the same keys are another namespace: none stored
        let kv: Value = serde_json::from_str(&ok(store("stat", &storage, &["--format", format, "--json"]))).unwrap();
        assert_eq!(kv["pages"], 0, "{format}");
        if format == "sglang" {
            for key in &keys {
                assert!(storage.join(format!("{key}.mamba_m_0_1.bin")).is_file(), "{key}");
            }
        }
    }
    let storage = work.path().join("native");
    failure(&store("stat", &storage, &["--entry-bytes", "96"]), 2, "--pool");
    failure(&store("stat", &storage, &["--pool", "kv", "--entry-bytes", "96"]), 2, "--pool");
    let wrong = ["--pool", "mamba", "--entry-bytes", "96", "--page-bytes", "128"];
    failure(&store("stat", &storage, &wrong), 2, "--entry-bytes 96");
    // SGLang's Mooncake cut of an entry must add up to it and be NAME:BYTES[:stage]; the bytes stored are the same
    // whatever the cut, so the file tier's namespace does not change with it
    fn cut(objects: &str) -> Vec<&str> {
        vec!["--pool", "mamba", "--entry-bytes", "96", "--entry-objects", objects]
    }
    failure(&store("stat", &storage, &cut("temporal:64,conv_0:31")), 2, "add up to 95 bytes, not one entry of 96");
    failure(&store("stat", &storage, &cut("temporal:64:rank")), 2, "is not `stage`");
    failure(&store("stat", &storage, &cut("temporal")), 2, "NAME:BYTES");
    let stat: Value =
        serde_json::from_str(&ok(store("stat", &storage, &[&cut("temporal:64,conv_0:32")[..], &["--json"]].concat())))
            .unwrap();
    assert_eq!(stat["pages"].as_u64(), Some(3));
    // a sliding window's layout needs its width; --trailing-pages needs a pool
    failure(&store("layout", &storage, &["--pool", "swa", "--entry-bytes", "96"]), 2, "--trailing-pages");
    failure(&store("layout", &storage, &["--trailing-pages", "2"]), 2, "--pool");
    ok(store("layout", &storage, &["--pool", "swa", "--entry-bytes", "96", "--trailing-pages", "2"]));
}

#[test]
fn help_describes_every_store_option() {
    let help = ok(hicache(&["store", "put", "--help"], &[]));
    for option in [
        "--backend",
        "--config",
        "--dir",
        "--model",
        "--tp-rank",
        "--tp-size",
        "--mla",
        "--page-size",
        "--page-bytes",
        "--pool",
        "--entry-bytes",
        "--key",
        "--tokens",
        "--in",
        "--json",
    ] {
        assert!(help.contains(option), "store put --help lacks {option}");
    }
    let help = ok(hicache(&["store", "--help"], &[]));
    for command in ["put", "get", "exists", "ls", "rm", "clear", "stat", "layout", "watch"] {
        assert!(help.contains(command), "store --help lacks {command}");
    }
}

#[test]
fn an_unreadable_shard_folder_is_skipped_and_named_not_fatal() {
    use std::os::unix::fs::PermissionsExt as _;
    let work = tempfile::tempdir().unwrap();
    let storage = work.path().join("storage");
    let (tokens, bytes) = fixture(work.path(), 24);
    let input = work.path().join("pages.bin");
    std::fs::write(&input, &bytes).unwrap();
    // a file per page (small pages would go to segment files); the namespace keeps that layout afterwards
    let per_file = r#"{"segment_threshold": 0}"#;
    ok(store("put", &storage, &["--tokens", &tokens, "--in", input.to_str().unwrap(), "--extra-config", per_file]));
    let all = ok(store("ls", &storage, &[])).lines().count();
    assert_eq!(all, 24);
    // one shard folder (the pages whose keys start with its two hex digits) becomes unreadable
    // {dir}/hicache-v1/{digest}/{shard}/{page}
    let versioned = storage.join("hicache-v1");
    let namespace_dir = std::fs::read_dir(&versioned).unwrap().flatten().next().unwrap().path();
    let shard =
        std::fs::read_dir(&namespace_dir).unwrap().flatten().find(|entry| entry.path().is_dir()).unwrap().path();
    let hidden = std::fs::read_dir(&shard).unwrap().count();
    for dir in [work.path(), &storage] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(&shard, std::fs::Permissions::from_mode(0o000)).unwrap();
    // root reads any folder: look as another user then
    // SAFETY: geteuid has no preconditions and only reads the process credentials.
    let is_root = unsafe { libc::geteuid() } == 0;
    let dir = storage.to_str().unwrap();
    let mut args = vec!["store", "ls", "--dir", dir, "--model", "m"];
    args.extend(GEOMETRY);
    let output = if is_root {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", env!("CARGO_BIN_EXE_hicache")])
            .args(&args)
            .env_remove("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
            .output()
            .expect("setpriv runs (util-linux)")
    } else {
        hicache(&args, &[])
    };
    std::fs::set_permissions(&shard, std::fs::Permissions::from_mode(0o755)).unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let listed = ok(output).lines().count();
    assert_eq!(listed, all - hidden, "the other shards' pages are all listed");
    assert!(stderr.contains(&shard.display().to_string()) && stderr.contains("cannot be read"), "{stderr}");
}

#[test]
fn pages_put_by_two_tp2_ranks_under_the_unified_scheme_are_got_whole_by_a_tp1_rank() {
    let dir = tempfile::tempdir().unwrap();
    let unified = r#"{"key_scheme": "unified", "head_group": 1, "layer_partition": 1}"#;
    // 2 layers × 2 KV heads of 4 bf16 dims over 2 ranks, pages of 4 tokens, cut into chunks of one layer and head
    let run = |action: &str, heads: &str, rest: &[&str]| {
        let mut args = vec!["store", action, "--dir", dir.path().to_str().unwrap(), "--model", "m"];
        args.extend(["--layers", "2", "--kv-heads", heads, "--head-dim", "4", "--page-size", "4"]);
        args.extend(["--layout", "page-unified"]);
        args.extend(rest);
        hicache(&args, &[])
    };
    let key = "ab".repeat(32);
    let mut halves = Vec::new();
    for rank in ["0", "1"] {
        let half: Vec<u8> = (0..128).map(|_| rand::rng().random()).collect();
        let input = dir.path().join(format!("half-{rank}.bin"));
        std::fs::write(&input, &half).unwrap();
        let rest = ["--key", &key, "--in", input.to_str().unwrap(), "--extra-config", unified];
        ok(run("put", "1", &[&rest[..], &["--tp-rank", rank, "--tp-size", "2"]].concat()));
        halves.push(half);
    }
    let output = dir.path().join("whole.bin");
    ok(run("get", "2", &["--key", &key, "--out", output.to_str().unwrap(), "--extra-config", unified]));
    // the TP1 page: head group 0 (rank 0's block), then head group 1 (rank 1's)
    assert_eq!(std::fs::read(&output).unwrap(), halves.concat());
    // under the rank's own keys the page is not there
    assert!(!run("get", "2", &["--key", &key, "--out", output.to_str().unwrap()]).status.success());
}

/// `hicache args` (a `store watch --json`) running, with its standard input a pipe, and its lines as they come.
fn running_watch(args: &[&str]) -> (std::process::Child, impl Iterator<Item = Value>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hicache"))
        .args(args)
        .env_remove("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let watchdog = Watchdog::new(child.id());
    let lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()))
        .map(|line| serde_json::from_str::<Value>(&line.unwrap()).unwrap())
        .inspect(move |_| {
            let _held_while_lines_are_read = &watchdog;
        });
    (child, lines)
}

/// Kills a watch still running after [`WATCH_DEADLINE`], so that a test waiting for a line that never comes ends
/// (its lines end, and the test fails on what it missed) instead of hanging. Dropping it (with the watch's lines)
/// closes its channel: the thread sees that and lets the watch be.
struct Watchdog {
    _stop: std::sync::mpsc::Sender<()>,
}

const WATCH_DEADLINE: std::time::Duration = std::time::Duration::from_secs(120);

impl Watchdog {
    fn new(pid: u32) -> Self {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(WATCH_DEADLINE) {
                eprintln!("the watch (pid {pid}) ran past {WATCH_DEADLINE:?}: killed");
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        });
        Self { _stop: stop }
    }
}

/// The JSON lines of a `store watch` that ran to its end.
fn watch_lines(output: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&output.stdout).lines().map(|line| serde_json::from_str(line).unwrap()).collect()
}

#[test]
fn a_watch_reads_the_pages_each_round_and_says_when_they_are_missing_or_other_bytes() {
    let work = tempfile::tempdir().unwrap();
    let storage = work.path().join("storage");
    let (tokens, bytes) = fixture(work.path(), 3);
    let input = work.path().join("pages.bin");
    let input = input.to_str().unwrap();
    // --put writes them, then reads them each round
    let output = store("watch", &storage, &["--tokens", &tokens, "--put", input, "--rounds", "3", "--json"]);
    let lines = watch_lines(&output);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(lines.len(), 5, "{lines:?}");
    assert_eq!(lines[0]["event"], "ready");
    assert_eq!((lines[4]["event"].as_str(), lines[4]["message"].as_str()), (Some("end"), Some("rounds")));
    for (round, line) in lines[1..4].iter().enumerate() {
        assert_eq!((line["round"].as_u64(), line["outcome"].as_str()), (Some(round as u64 + 1), Some("whole")));
        assert_eq!((line["pages_whole"].as_u64(), line["pages"].as_u64()), (Some(3), Some(3)));
    }
    // other bytes expected: every page read whole is `wrong`, and the watch fails
    let mut other = bytes.clone();
    other[PAGE_BYTES + 5] ^= 1;
    let expected = work.path().join("other.bin");
    std::fs::write(&expected, &other).unwrap();
    let output = store(
        "watch",
        &storage,
        &["--tokens", &tokens, "--expect", expected.to_str().unwrap(), "--rounds", "1", "--json"],
    );
    failure(&output, 1, "other bytes than expected");
    let round = &watch_lines(&output)[1];
    assert_eq!((round["outcome"].as_str(), round["pages_wrong"].as_u64()), (Some("wrong"), Some(1)), "{round}");
    assert_eq!(round["pages_whole"], 2);
    // a page removed: `missing`, naming it, and the watch goes on until its standard input ends
    let keys = ok(hicache(&["hash", "--page-size", "4", &tokens], &[]));
    let second = keys.lines().nth(1).unwrap();
    ok(store("rm", &storage, &["--key", second]));
    let dir = storage.to_str().unwrap();
    let mut args = vec!["store", "watch", "--dir", dir, "--model", "m", "--tokens", &tokens, "--expect", input];
    args.extend(GEOMETRY);
    args.extend(["--json", "--interval-ms", "1"]);
    let (mut child, mut lines) = running_watch(&args);
    assert_eq!(lines.next().unwrap()["event"], "ready");
    let round = lines.next().unwrap();
    assert_eq!(round["outcome"], "missing", "{round}");
    assert!(round["message"].as_str().unwrap().contains(second), "{round}");
    assert_eq!(round["pages_whole"], 2);
    drop(child.stdin.take());
    let end = lines.last().unwrap();
    assert_eq!((end["event"].as_str(), end["message"].as_str()), (Some("end"), Some("the end of standard input")));
    assert!(child.wait().unwrap().success());
    // a canary (--put) that finds a page missing writes the pages again: a page removed while it runs comes back
    let flag = args.iter().position(|&arg| arg == "--expect").unwrap();
    args[flag] = "--put";
    let (mut child, mut lines) = running_watch(&args);
    assert_eq!(lines.next().unwrap()["event"], "ready");
    assert_eq!(lines.next().unwrap()["outcome"], "whole", "the first put restored the page");
    ok(store("rm", &storage, &["--key", second]));
    let missing = lines.by_ref().find(|line| line["outcome"] != "whole").expect("a round after the removal");
    assert_eq!(missing["outcome"], "missing", "{missing}");
    let put = lines.next().unwrap();
    assert_eq!((put["event"].as_str(), put["pages_whole"].as_u64()), (Some("put"), Some(1)), "{put}");
    assert_eq!(lines.next().unwrap()["outcome"], "whole");
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}
