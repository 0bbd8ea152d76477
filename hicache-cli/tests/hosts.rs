//! hicache across hosts, on one machine: network namespaces act as hosts on a private subnet (10.213.0.0/24), each
//! joined by a veth pair to a bridge in a namespace of its own, so a link is taken down by its port on the bridge.
//! Host 0 runs the services (a Mooncake master, a Redis for 3FS's page metadata); the other hosts run `hicache`.
//! Everything the harness makes is removed when it is dropped, also when a test fails; its services are stopped by
//! their PIDs. Traffic stays inside the namespaces.
//!
//! Creating namespaces needs root. Without it the tests say so and pass, except under `CI=true`, where they fail.
#![cfg(all(feature = "mooncake", feature = "3fs"))]

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hicache_core::testing::service::LoopbackService;
use hicache_storage_3fs::testing::{Mount, mock_library_dir, redis_program};
use hicache_storage_mooncake::testing::{master_program, python_path, store_library, unpack_dir};

/// Harnesses made by this process, for unique names.
static MADE: AtomicUsize = AtomicUsize::new(0);

/// Hosts as network namespaces on one bridge.
struct Hosts {
    /// What every name of this harness starts with (`hc{pid}x{n}`: interface names stay within 15 bytes).
    prefix: String,
    count: usize,
}

fn ip(args: &[&str]) {
    let output = Command::new("ip").args(args).output().expect("runs ip (iproute2)");
    assert!(output.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
}

impl Hosts {
    /// `count` hosts; `None` when namespaces cannot be made here (not root) outside CI.
    fn new(count: usize) -> Option<Self> {
        let prefix = format!("hc{}x{}", std::process::id() % 100_000, MADE.fetch_add(1, Ordering::Relaxed));
        let probe = Command::new("ip").args(["netns", "add", &format!("{prefix}sw")]).output();
        match probe {
            Ok(output) if output.status.success() => {}
            other => {
                let why = match other {
                    Ok(output) => String::from_utf8_lossy(&output.stderr).into_owned(),
                    Err(error) => error.to_string(),
                };
                assert!(std::env::var("CI").as_deref() != Ok("true"), "cannot make network namespaces: {why}");
                eprintln!("SKIPPED: cannot make network namespaces here ({}); run as root", why.trim());
                return None;
            }
        }
        let hosts = Self { prefix, count };
        let switch = hosts.switch();
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &switch, "link", "set", "br0", "up"]);
        for host in 0..count {
            let (name, port) = (hosts.name(host), hosts.port(host));
            ip(&["netns", "add", &name]);
            ip(&["link", "add", &name, "type", "veth", "peer", "name", &port]);
            ip(&["link", "set", &name, "netns", &name]);
            ip(&["link", "set", &port, "netns", &switch]);
            ip(&["-n", &switch, "link", "set", &port, "master", "br0"]);
            ip(&["-n", &switch, "link", "set", &port, "up"]);
            ip(&["-n", &name, "addr", "add", &format!("{}/24", hosts.address(host)), "dev", &name]);
            ip(&["-n", &name, "link", "set", &name, "up"]);
            ip(&["-n", &name, "link", "set", "lo", "up"]);
        }
        Some(hosts)
    }

    fn switch(&self) -> String {
        format!("{}sw", self.prefix)
    }

    /// Host `host`'s namespace (and its end of its link).
    fn name(&self, host: usize) -> String {
        format!("{}h{host}", self.prefix)
    }

    /// Host `host`'s port on the bridge.
    fn port(&self, host: usize) -> String {
        format!("{}p{host}", self.prefix)
    }

    fn address(&self, host: usize) -> String {
        format!("10.213.0.{}", host + 1)
    }

    /// `program` to be run on host `host`.
    fn command(&self, host: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name(host)]).arg(program);
        command
    }

    /// Takes host `host`'s link down or up.
    fn link(&self, host: usize, up: bool) {
        ip(&["-n", &self.switch(), "link", "set", &self.port(host), if up { "up" } else { "down" }]);
    }

    /// Whether something listens on TCP `port` on host `host`.
    fn listens(&self, host: usize, port: u16) -> bool {
        let output = self.command(host, "ss").args(["-Hltn", &format!("sport = :{port}")]).output();
        output.is_ok_and(|output| output.status.success() && !output.stdout.is_empty())
    }

    /// Starts `command` on host `host` as a service listening on `port` there.
    fn service(&self, host: usize, command: Command, port: u16) -> LoopbackService {
        let answers = || self.listens(host, port);
        LoopbackService::start(command, Duration::from_secs(30), answers)
            .expect("starts the service")
            .unwrap_or_else(|| panic!("the service on host {host} did not listen on port {port}"))
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // a namespace's end of a veth pair goes with it, and the pair with either end
        for name in (0..self.count).map(|host| self.name(host)).chain([self.switch()]) {
            let _ = Command::new("ip").args(["netns", "del", &name]).output();
        }
    }
}

/// `hicache` on host `host`, with the test libraries (and on a machine without the CUDA driver the no-device
/// stand-in on the loader's path).
fn hicache(hosts: &Hosts, host: usize, args: &[&str]) -> Output {
    hicache_command(hosts, host, args).output().expect("runs hicache")
}

/// [`hicache`], not started yet. Mooncake's official client is on its Python path (the benchmark's reference).
fn hicache_command(hosts: &Hosts, host: usize, args: &[&str]) -> Command {
    let mut command = hosts.command(host, env!("CARGO_BIN_EXE_hicache"));
    command.args(args).env("MOONCAKE_STORE_LIBRARY", store_library()).env("HF3FS_LIB_DIR", mock_library_dir());
    command.env_remove("MOONCAKE_MASTER").env_remove("SGLANG_HICACHE_HF3FS_CONFIG_PATH");
    command.env("PYTHONPATH", python_path());
    let shim = unpack_dir().join("no-device-cuda-shim");
    if shim.is_dir() {
        command.env("LD_LIBRARY_PATH", shim);
    }
    command
}

/// The JSON report of a successful `hicache` run on host `host`.
fn json(hosts: &Hosts, host: usize, args: &[&str]) -> serde_json::Value {
    let output = hicache(hosts, host, args);
    assert!(output.status.success(), "{args:?} on host {host}: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap()
}

/// The tokens a replay's cold first round took from L3.
fn cold(report: &serde_json::Value) -> u64 {
    report["rounds"][0]["tokens_from_l3"].as_u64().unwrap()
}

/// Random pages for `hashes` (24 KiB each: the store flags of [`PAGE`]) in a file of `dir`.
fn random_pages(dir: &Path, name: &str, pages: usize) -> (std::path::PathBuf, Vec<u8>) {
    let bytes: Vec<u8> = (0..pages * 24_576).map(|_| rand::random::<u8>()).collect();
    let path = dir.join(name);
    std::fs::write(&path, &bytes).unwrap();
    (path, bytes)
}

/// The store flags of a 24 KiB page: three layers, two KV heads of 64, 16 tokens of bf16, page-first.
const PAGE: [&str; 12] = [
    "--layers",
    "3",
    "--kv-heads",
    "2",
    "--head-dim",
    "64",
    "--page-size",
    "16",
    "--layout",
    "page-first",
    "--model",
    "m",
];

fn random_hashes(count: usize) -> Vec<String> {
    (0..count).map(|_| (0..4).map(|_| format!("{:016x}", rand::random::<u64>())).collect()).collect()
}

fn keyed<'a>(mut args: Vec<&'a str>, hashes: &'a [String]) -> Vec<&'a str> {
    for hash in hashes {
        args.extend(["--key", hash.as_str()]);
    }
    args
}

/// Pages `hicache store put` wrote on host 1 and host 2 read back (with the store flags `writer` and `reader`):
/// asserts they are the same bytes, and keeps what is needed to read them again.
struct SharedPages {
    /// `store get` of the pages, into `got`.
    get: Vec<String>,
    got: std::path::PathBuf,
    bytes: Vec<u8>,
}

impl SharedPages {
    fn write_on_1_read_on_2(hosts: &Hosts, (writer, reader): (&[&str], &[&str]), work: &Path) -> Self {
        let hashes = random_hashes(4);
        let (input, bytes) = random_pages(work, "in.bin", hashes.len());
        let put = keyed([&["store", "put"][..], writer, &["--in", input.to_str().unwrap()]].concat(), &hashes);
        let output = hicache(hosts, 1, &put);
        assert!(output.status.success(), "put on host 1: {}", String::from_utf8_lossy(&output.stderr));
        let got = work.join("got.bin");
        let get = keyed([&["store", "get"][..], reader, &["--out", got.to_str().unwrap()]].concat(), &hashes);
        let pages = Self { get: get.into_iter().map(str::to_owned).collect(), got, bytes };
        let output = pages.read(hosts);
        assert!(output.status.success(), "get on host 2: {}", String::from_utf8_lossy(&output.stderr));
        assert!(std::fs::read(&pages.got).unwrap() == pages.bytes, "host 2 read other bytes than host 1 wrote");
        pages
    }

    /// Reads them on host 2 again (the file of the last read removed first).
    fn read(&self, hosts: &Hosts) -> Output {
        let _ = std::fs::remove_file(&self.got);
        hicache(hosts, 2, &self.get.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// Whether the last read wrote the pages host 1 wrote.
    fn read_whole(&self) -> bool {
        std::fs::read(&self.got).is_ok_and(|bytes| bytes == self.bytes)
    }

    /// Reads them on host 2 with its link down: the read fails, within a minute; returns how long it took.
    fn read_with_link_down(&self, hosts: &Hosts) -> Duration {
        hosts.link(2, false);
        let started = Instant::now();
        let output = self.read(hosts);
        let took = started.elapsed();
        hosts.link(2, true);
        assert!(!output.status.success() && !self.got.exists(), "pages read across a link that is down");
        assert!(took < Duration::from_secs(60), "a read across a link that is down took {took:?}");
        took
    }
}

/// A Mooncake client lending a segment on host `host` (Mooncake's official Python client), alive until dropped.
struct Keeper(Child);

impl Keeper {
    fn start(hosts: &Hosts, host: usize, master: &str) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/mooncake_keeper.py");
        let mut command = hosts.command(host, "python3");
        command.arg(script).args([master, "268435456", &hosts.address(host)]).env("PYTHONPATH", python_path());
        let shim = unpack_dir().join("no-device-cuda-shim");
        if shim.is_dir() {
            command.env("LD_LIBRARY_PATH", shim);
        }
        let mut child = command.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("python3 runs");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "the keeper on host {host} did not mount its segment");
        Self(child)
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Two replays of one workload, on host 1 (with `first`), then on host 2 (with `second`): each verifies, and the
/// second's cold first round takes pages the first wrote. Prints the figures.
fn replays_share(hosts: &Hosts, tier: &str, (first, second): (&[&str], &[&str])) {
    let replay = ["replay", "--clients", "8", "--rounds", "2", "--sync-storage", "--fetch-whole-hits", "--json"];
    let first = json(hosts, 1, &[&replay[..], first].concat());
    let second = json(hosts, 2, &[&replay[..], second].concat());
    assert_eq!((first["verified"].as_bool(), second["verified"].as_bool()), (Some(true), Some(true)));
    assert_eq!(cold(&first), 0, "{first}");
    assert!(cold(&second) > 0, "host 2's first round found none of host 1's pages: {second}");
    assert!(second["hit_rate"].as_f64() > first["hit_rate"].as_f64(), "{first}\n{second}");
    eprintln!(
        "{tier}: host 2's cold round read {} tokens host 1 wrote; hit rate {:.3} on host 1, {:.3} on host 2",
        cold(&second),
        first["hit_rate"],
        second["hit_rate"]
    );
}

#[test]
fn pages_one_host_wrote_to_mooncake_are_read_on_another_over_tcp_and_a_dead_host_is_a_miss() {
    let Some(hosts) = Hosts::new(3) else { return };
    let port = 50051;
    let mut master = hosts.command(0, master_program());
    master.args([format!("--rpc_port={port}"), format!("--rpc_address={}", hosts.address(0))]);
    master.args(["--metrics_port=9003".to_owned(), format!("--metrics_host={}", hosts.address(0))]);
    let _master = hosts.service(0, master, port);
    let address = format!("{}:{port}", hosts.address(0));
    // host 1's segment holds the objects: the hicache processes lend nothing, so every put lands there
    let keeper = Keeper::start(&hosts, 1, &address);
    let extra = |host: usize| {
        serde_json::json!({
            "master_server_address": address, "local_hostname": hosts.address(host), "global_segment_size": 0,
            "protocol": "tcp",
        })
        .to_string()
    };
    let (extra1, extra2) = (extra(1), extra(2));
    let mooncake1 = ["--backend", "mooncake", "--extra-config", extra1.as_str()];
    let mooncake2 = ["--backend", "mooncake", "--extra-config", extra2.as_str()];
    // host 2 reads them from host 1's segment, across the bridge
    let work = tempfile::tempdir().unwrap();
    let sides = ([&mooncake1[..], &PAGE].concat(), [&mooncake2[..], &PAGE].concat());
    let pages = SharedPages::write_on_1_read_on_2(&hosts, (&sides.0, &sides.1), work.path());
    replays_share(&hosts, "Mooncake", (&mooncake1, &mooncake2));
    // reads across the link beside reads on the segment's own host, in one run
    let bench = ["bench", "storage", "--pages", "32", "--page-bytes", "1048576", "--batch", "8", "--rounds", "3"];
    let local = json(&hosts, 1, &[&bench[..], &mooncake1, &["--json"]].concat());
    let across = json(&hosts, 2, &[&bench[..], &mooncake2, &["--json"]].concat());
    let rate = |report: &serde_json::Value, field: &str| report[field].as_f64().unwrap();
    assert!(rate(&local, "get_gbps") > 0.0 && rate(&across, "get_gbps") > 0.0, "{local}\n{across}");
    eprintln!(
        "Mooncake get across the link {:.3} GB/s, on the segment's host {:.3} GB/s: ratio {:.3} (set {:.3}, {:.3}: \
         {:.3}); the official client's get across {:.3}, local {:.3}",
        rate(&across, "get_gbps"),
        rate(&local, "get_gbps"),
        rate(&across, "get_gbps") / rate(&local, "get_gbps"),
        rate(&across, "set_gbps"),
        rate(&local, "set_gbps"),
        rate(&across, "set_gbps") / rate(&local, "set_gbps"),
        rate(&across, "reference_get_gbps"),
        rate(&local, "reference_get_gbps"),
    );
    // host 2's link down: its read fails within the client's deadlines; back up, it reads again
    eprintln!("Mooncake: host 2's read with its link down failed in {:?}", pages.read_with_link_down(&hosts));
    let output = pages.read(&hosts);
    assert!(output.status.success(), "get after the link came back: {}", String::from_utf8_lossy(&output.stderr));
    assert!(pages.read_whole(), "host 2 read other bytes after the link came back");
    // host 1 dies (its segment's owner killed): host 2 gets no page, within its deadlines, never other bytes
    drop(keeper);
    let started = Instant::now();
    let output = pages.read(&hosts);
    let took = started.elapsed();
    assert!(!output.status.success() && !pages.got.exists(), "pages read from a dead host's segment");
    assert!(took < Duration::from_secs(60), "the read of a dead host's pages took {took:?}");
    eprintln!("Mooncake: host 2's read of dead host 1's pages failed in {took:?}");
}

#[test]
fn pages_one_host_wrote_to_3fs_are_read_on_another_and_replays_on_two_hosts_share_them() {
    let Some(hosts) = Hosts::new(3) else { return };
    let port = 6379;
    let mut redis = hosts.command(0, redis_program());
    redis.args(["--bind", &hosts.address(0), "--port", &port.to_string(), "--save", "", "--appendonly", "no"]);
    redis.args(["--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning"]);
    let _redis = hosts.service(0, redis, port);
    // the mock's data files are on a directory every host sees, as a 3FS mount is; the metadata across the bridge
    let mount = Mount::new();
    let dir = mount.path().to_str().unwrap();
    // each kind of page in a data file of its own
    let extra = |file: &str| {
        serde_json::json!({
            "metadata_server_url": format!("redis://{}:{port}", hosts.address(0)), "file_size": "256MiB",
            "file_path_prefix": format!("{dir}/{file}"),
        })
        .to_string()
    };
    let (stored_pages, replays, killed) = (extra("pages"), extra("replays"), extra("killed"));
    let target: Vec<&str> = [&["--backend", "3fs", "--extra-config", &stored_pages][..], &PAGE].concat();
    let work = tempfile::tempdir().unwrap();
    let pages = SharedPages::write_on_1_read_on_2(&hosts, (&target, &target), work.path());
    let replay = ["--backend", "3fs", "--extra-config", &replays];
    replays_share(&hosts, "3FS", (&replay, &replay));
    // host 2's link down: its calls to the metadata service fail, within their deadlines; back up, it serves again
    eprintln!("3FS: host 2's read with its link down failed in {:?}", pages.read_with_link_down(&hosts));
    let output = pages.read(&hosts);
    assert!(output.status.success(), "get after the link came back: {}", String::from_utf8_lossy(&output.stderr));
    assert!(pages.read_whole(), "host 2 read other bytes after the link came back");
    // host 1 killed while its replay writes: host 2's replay of the same workload verifies every byte it loads
    let stored = || -> u64 {
        // the pages every namespace holds, asked of Redis on its host
        let script = "local n = 0 for _, k in ipairs(redis.call('KEYS', 'hicache:3fs:*:keys')) do \
                      n = n + redis.call('HLEN', k) end return n";
        let output = hosts
            .command(0, "redis-cli")
            .args(["-h", &hosts.address(0), "-p", &port.to_string(), "--raw", "EVAL", script, "0"])
            .output()
            .expect("runs redis-cli");
        String::from_utf8_lossy(&output.stdout).trim().parse().expect("a page count")
    };
    let before = stored();
    let workload = ["replay", "--backend", "3fs", "--extra-config", &killed, "--clients", "48", "--rounds", "4"];
    let mut writer = hicache_command(&hosts, 1, &workload).stdout(Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    // (a writer that ended on its own after storing them is killed as a no-op: host 2's check is the same)
    while stored() < before + 64 {
        assert!(writer.try_wait().unwrap().is_none(), "host 1's replay ended before it stored 64 pages");
        assert!(Instant::now() < deadline, "host 1's replay stored no 64 pages in 2 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    writer.kill().unwrap();
    writer.wait().unwrap();
    let after = json(&hosts, 2, &[&workload[..], &["--json", "--fetch-whole-hits"]].concat());
    assert_eq!(after["verified"], true, "{after}");
    eprintln!(
        "3FS: host 1 killed after {} pages stored; host 2's replay verified {} bytes, {} tokens of its cold round from \
         host 1's pages",
        stored() - before,
        after["verified_bytes"],
        cold(&after)
    );
}
