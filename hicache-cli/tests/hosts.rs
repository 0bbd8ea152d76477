//! hicache across hosts, on one machine: network namespaces act as hosts on a private subnet (10.213.0.0/24), each
//! joined by a veth pair to a bridge in a namespace of its own, so a link is taken down by its port on the bridge.
//! Hardware addresses are fixed and every neighbour table is static, so a link down drops packets silently, the same
//! whenever it comes.
//! Host 0 runs the services (a Mooncake master, a Redis for 3FS's page metadata); the other hosts run `hicache`.
//! Everything the harness makes is removed when it is dropped, also when a test fails; its services are stopped by
//! their PIDs. Traffic stays inside the namespaces.
//!
//! Creating namespaces needs root, and impairing a link `tc` and `nft` (`cargo xtask ci` installs nftables). Without
//! root the tests say so and pass, except under `CI=true`, where they fail.
#![cfg(all(feature = "mooncake", feature = "3fs"))]

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hicache_core::testing::service::LoopbackService;
use hicache_storage_3fs::testing::{Mount, mock_library_dir, redis_program};
use hicache_storage_mooncake::CLOSE_DEADLINE;
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
            ip(&["link", "add", &name, "address", &hosts.mac(host), "type", "veth", "peer", "name", &port]);
            ip(&["link", "set", &name, "netns", &name]);
            ip(&["link", "set", &port, "netns", &switch]);
            ip(&["-n", &switch, "link", "set", &port, "master", "br0"]);
            ip(&["-n", &switch, "link", "set", &port, "up"]);
            ip(&["-n", &name, "addr", "add", &format!("{}/24", hosts.address(host)), "dev", &name]);
            ip(&["-n", &name, "link", "set", &name, "up"]);
            ip(&["-n", &name, "link", "set", "lo", "up"]);
        }
        // a static neighbour table: a cut link then drops packets silently, as a cut beyond the first hop does,
        // instead of failing them once address resolution gives up (after a randomised 15 to 45 s), which would make
        // a transfer's fate depend on when the cut came
        for (host, other) in (0..count).flat_map(|host| (0..count).map(move |other| (host, other))) {
            if host != other {
                let (name, address, mac) = (hosts.name(host), hosts.address(other), hosts.mac(other));
                ip(&["-n", &name, "neigh", "replace", &address, "lladdr", &mac, "dev", &name, "nud", "permanent"]);
            }
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

    /// Host `host`'s hardware address (locally administered), fixed so that every host's neighbour table is static.
    fn mac(&self, host: usize) -> String {
        format!("02:00:0a:d5:00:{:02x}", host + 1)
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

    /// Makes host `host`'s link poor: `percent` of the packets it receives are dropped (nftables; this kernel has no
    /// netem, so there is no fixed delay), and what reaches it is capped at `rate` by a token bucket whose queue
    /// delays packets up to 100 ms.
    fn impair(&self, host: usize, percent: u32, rate: &str) {
        let rules = format!(
            "table inet hicache_test {{\n chain input {{\n  type filter hook input priority 0;\n  numgen random mod \
             100 < {percent} drop\n }}\n}}\n"
        );
        let mut nft = self.command(host, "nft").args(["-f", "-"]).stdin(Stdio::piped()).spawn().expect("runs nft");
        std::io::Write::write_all(&mut nft.stdin.take().unwrap(), rules.as_bytes()).unwrap();
        assert!(
            nft.wait().unwrap().success(),
            "nft (nftables; `cargo xtask ci` installs it) refused the rules: {rules}"
        );
        let port = self.port(host);
        let tbf = ["qdisc", "add", "dev", &port, "root", "tbf", "rate", rate, "burst", "64kb", "latency", "100ms"];
        let output = Command::new("ip").args(["netns", "exec", &self.switch(), "tc"]).args(tbf).output().unwrap();
        assert!(output.status.success(), "tc {tbf:?}: {}", String::from_utf8_lossy(&output.stderr));
    }

    /// Undoes [`impair`](Self::impair).
    fn heal(&self, host: usize) {
        let nft = self.command(host, "nft").args(["delete", "table", "inet", "hicache_test"]).output().unwrap();
        assert!(nft.status.success(), "nft: {}", String::from_utf8_lossy(&nft.stderr));
        ip(&["netns", "exec", &self.switch(), "tc", "qdisc", "del", "dev", &self.port(host), "root"]);
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

/// Pages `hicache store put` wrote on host 1 (with the store flags `writer`) and `hicache store get` read back on
/// host 2 (with `reader`): asserts they are the same bytes; their keys and the file of their bytes.
fn write_on_1_read_on_2(hosts: &Hosts, (writer, reader): (&[&str], &[&str]), work: &Path) -> (Vec<String>, String) {
    let hashes = random_hashes(4);
    let (input, bytes) = random_pages(work, "in.bin", hashes.len());
    let input = input.to_str().unwrap().to_owned();
    let put = keyed([&["store", "put"][..], writer, &["--in", &input]].concat(), &hashes);
    let output = hicache(hosts, 1, &put);
    assert!(output.status.success(), "put on host 1: {}", String::from_utf8_lossy(&output.stderr));
    let got = work.join("got.bin");
    let get = keyed([&["store", "get"][..], reader, &["--out", got.to_str().unwrap()]].concat(), &hashes);
    let output = hicache(hosts, 2, &get);
    assert!(output.status.success(), "get on host 2: {}", String::from_utf8_lossy(&output.stderr));
    assert!(std::fs::read(&got).unwrap() == bytes, "host 2 read other bytes than host 1 wrote");
    (hashes, input)
}

/// `hicache store watch --json` running on a host: its lines, read on a thread of their own as they come;
/// stopped when dropped.
struct Watch {
    /// SIGKILL when dropped: a host that dies (a watch that is done goes the same way: nothing depends on its
    /// closing).
    _process: Running,
    lines: std::sync::mpsc::Receiver<serde_json::Value>,
    host: usize,
}

impl Watch {
    /// Starts it on `host` with `args` (after `store watch --json`), and waits for its `ready` line.
    fn start(hosts: &Hosts, host: usize, args: &[&str]) -> Self {
        let watch = [&["store", "watch", "--json", "--interval-ms", "100"][..], args].concat();
        let mut child = hicache_command(hosts, host, &watch)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("runs hicache");
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                let line: serde_json::Value = serde_json::from_str(&line)
                    .unwrap_or_else(|_| serde_json::json!({"event": "not JSON", "message": line}));
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        let mut watch = Self { _process: Running(child), lines, host };
        let ready = watch.next(Duration::from_secs(60)).expect("the watch is ready within a minute");
        assert_eq!(ready["event"], "ready", "{ready}");
        watch
    }

    /// Its next line within `wait`; `None` when it ended. A page read whole with other bytes fails the test.
    fn next(&mut self, wait: Duration) -> Option<serde_json::Value> {
        let line = match self.lines.recv_timeout(wait) {
            Ok(line) => line,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return None,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                panic!("the watch on host {} wrote no line in {wait:?}: a round outlived every deadline", self.host)
            }
        };
        assert_ne!(
            line["event"], "not JSON",
            "the watch on host {} printed a line that is not JSON: {line}",
            self.host
        );
        assert_ne!(line["outcome"], "wrong", "host {} read a page whole with other bytes: {line}", self.host);
        Some(line)
    }

    /// Round lines up to and with the first that `wanted` accepts, which must come within `deadline`.
    fn until(
        &mut self,
        what: &str,
        deadline: Duration,
        wanted: impl Fn(&serde_json::Value) -> bool,
    ) -> Vec<serde_json::Value> {
        let end = Instant::now() + deadline;
        let mut lines = Vec::new();
        loop {
            let left = end.saturating_duration_since(Instant::now());
            let line = self.next(left).unwrap_or_else(|| panic!("the watch on host {} ended", self.host));
            let found = wanted(&line);
            lines.push(line);
            if found {
                return lines;
            }
            assert!(Instant::now() < end, "host {} saw no {what} in {deadline:?}: {:?}", self.host, lines.last());
        }
    }
}

/// A process killed (and waited for) when dropped, also when a test fails.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn outcome(line: &serde_json::Value) -> &str {
    line["outcome"].as_str().unwrap_or_default()
}

fn whole(line: &serde_json::Value) -> bool {
    outcome(line) == "whole"
}

fn millis(line: &serde_json::Value) -> f64 {
    line["ms"].as_f64().unwrap_or_default()
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

/// What a round of a watch may take: Mooncake's transfer deadline (60 s), then closing the client after a transfer
/// that outlived it ([`CLOSE_DEADLINE`]), with a margin; Mooncake's RPC deadlines (8 s, 30 s) are shorter.
const ROUND_DEADLINE: Duration = Duration::from_secs(60 + CLOSE_DEADLINE.as_secs() + 30);

/// Host 2's link taken down mid-run under `watch` (on host 2): a round fails within its deadline; back up, the
/// same process reads whole again. Then a poor link: ten rounds, each within its deadline. Prints the figures.
fn link_faults(hosts: &Hosts, tier: &str, watch: &mut Watch) {
    watch.until("a whole read", ROUND_DEADLINE, |line| outcome(line) == "whole");
    hosts.link(2, false);
    let down = watch.until("a failed round", ROUND_DEADLINE, |line| outcome(line) != "whole");
    let failed = down.last().unwrap().clone();
    hosts.link(2, true);
    let back = watch.until("a whole read after the link came back", ROUND_DEADLINE, |line| outcome(line) == "whole");
    eprintln!(
        "{tier}: host 2's link down: a round failed in {:.0} ms ({}); back up: whole again after {} rounds",
        millis(&failed),
        failed["message"],
        back.len()
    );
    // a fifth of the packets dropped, 100 Mbit/s
    hosts.impair(2, 20, "100mbit");
    let poor: Vec<_> = (0..10).flat_map(|_| watch.until("a round", ROUND_DEADLINE, |_| true)).collect();
    hosts.heal(2);
    // (each round ended within its deadline: `until` fails the test otherwise)
    let whole = poor.iter().filter(|line| outcome(line) == "whole").count();
    let slowest = poor.iter().map(millis).fold(0.0, f64::max);
    assert!(whole > 0, "no round was whole on the poor link: {poor:?}");
    eprintln!("{tier}: on a poor link, {whole} of {} rounds whole, the slowest in {slowest:.0} ms", poor.len());
}

#[test]
fn pages_one_host_wrote_to_mooncake_are_read_on_another_over_tcp_through_link_faults_and_a_dead_host() {
    let Some(hosts) = Hosts::new(3) else { return };
    let port = 50051;
    let mut master = hosts.command(0, master_program());
    master.args([format!("--rpc_port={port}"), format!("--rpc_address={}", hosts.address(0))]);
    master.args(["--metrics_port=9003".to_owned(), format!("--metrics_host={}", hosts.address(0))]);
    let _master = hosts.service(0, master, port);
    let address = format!("{}:{port}", hosts.address(0));
    let extra = |host: usize, segment: u64| {
        serde_json::json!({
            "master_server_address": address, "local_hostname": hosts.address(host), "global_segment_size": segment,
            "protocol": "tcp",
        })
        .to_string()
    };
    // host 1 runs a hicache process that writes the pages and lends its own segment while it runs (puts ask for
    // the writer's own segment first, so they land there); the other processes lend none, so whatever they put
    // lands in host 1's segment too, and outlives them
    let (lender, extra1, extra2) = (extra(1, 256 << 20), extra(1, 0), extra(2, 0));
    let lending = ["--backend", "mooncake", "--extra-config", lender.as_str()];
    let mooncake1 = ["--backend", "mooncake", "--extra-config", extra1.as_str()];
    let mooncake2 = ["--backend", "mooncake", "--extra-config", extra2.as_str()];
    let work = tempfile::tempdir().unwrap();
    let hashes = random_hashes(4);
    let (input, _) = random_pages(work.path(), "in.bin", hashes.len());
    let input = input.to_str().unwrap();
    let keys: Vec<&str> = keyed(Vec::new(), &hashes);
    let owner = [&lending[..], &PAGE, &["--put", input], &keys].concat();
    let mut owner_watch = Watch::start(&hosts, 1, &owner);
    // host 2 watches them, in one process from here on: read over TCP from host 1's segment, byte for byte
    let mut watch = Watch::start(&hosts, 2, &[&mooncake2[..], &PAGE, &["--expect", input], &keys].concat());
    let first = watch.until("a whole read", ROUND_DEADLINE, |line| outcome(line) == "whole");
    eprintln!("Mooncake: host 2 read host 1's pages whole in {:.1} ms", millis(first.last().unwrap()));
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
    link_faults(&hosts, "Mooncake", &mut watch);
    // host 1's link down (the segment's owner cut off, alive): host 2's transfers from it hang until Mooncake's
    // transfer deadline (nothing tells host 2 the link is gone: its neighbour table is static), which leaves them running, so host 2's client is closed (stopping them) before the round
    // returns, and a new one connects; back up, host 1's watch writes its pages again once it finds them gone (the
    // master dropped its segment when its heartbeats stopped), and the same process on host 2 reads them whole
    watch.until("a whole read", ROUND_DEADLINE, |line| outcome(line) == "whole");
    hosts.link(1, false);
    let cut = watch.until("a failed round", ROUND_DEADLINE, |line| outcome(line) != "whole");
    hosts.link(1, true);
    let healed = watch.until("a whole read after host 1's link came back", ROUND_DEADLINE, whole);
    let cut = cut.last().unwrap();
    let message = cut["message"].as_str().unwrap_or_default();
    assert!(message.contains("TRANSFER_FAIL") && message.contains("client is closed"), "{cut}");
    eprintln!(
        "Mooncake: host 1's link down: host 2's round failed in {:.0} ms ({}); whole again {} rounds after the link \
         came back",
        millis(cut),
        cut["message"],
        healed.len()
    );
    // host 1 dies (its segment's owner killed): host 2's transfers fail at once (settled: the client stays), never
    // other bytes; once the master has dropped the dead segment, host 1 comes back and writes the pages again, and
    // the same process on host 2 reads them
    watch.until("a whole read", ROUND_DEADLINE, whole);
    drop(owner_watch);
    let dead = watch.until("a failed round", ROUND_DEADLINE, |line| outcome(line) != "whole");
    let dead = dead.last().unwrap();
    assert!(dead["message"].as_str().unwrap().contains("TRANSFER_FAIL"), "{dead}");
    assert!(!dead["message"].as_str().unwrap().contains("client is closed"), "a settled failure closed it: {dead}");
    eprintln!("Mooncake: host 1 killed: host 2's round failed in {:.0} ms ({})", millis(dead), dead["message"]);
    let gone = watch.until("the pages missing", ROUND_DEADLINE, |line| outcome(line) == "missing");
    owner_watch = Watch::start(&hosts, 1, &owner);
    let again = watch.until("a whole read", ROUND_DEADLINE, |line| outcome(line) == "whole");
    eprintln!(
        "Mooncake: {} rounds until the master dropped the dead segment's pages, {} more until host 2 read them whole \
         from host 1 come back",
        gone.len(),
        again.len()
    );
    drop((owner_watch, watch));
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
    let (hashes, input) = write_on_1_read_on_2(&hosts, (&target, &target), work.path());
    let replay = ["--backend", "3fs", "--extra-config", &replays];
    replays_share(&hosts, "3FS", (&replay, &replay));
    // host 2 watches the pages in one process: its link down, its calls to the metadata service fail within their
    // deadlines; back up, it serves again; a poor link
    let keys = keyed(Vec::new(), &hashes);
    let mut watch = Watch::start(&hosts, 2, &[&target[..], &["--expect", &input], &keys].concat());
    link_faults(&hosts, "3FS", &mut watch);
    drop(watch);
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
    let mut writer = Running(hicache_command(&hosts, 1, &workload).stdout(Stdio::null()).spawn().unwrap());
    let deadline = Instant::now() + Duration::from_secs(120);
    // (a writer that ended on its own after storing them is killed as a no-op: host 2's check is the same)
    while stored() < before + 64 {
        assert!(writer.0.try_wait().unwrap().is_none(), "host 1's replay ended before it stored 64 pages");
        assert!(Instant::now() < deadline, "host 1's replay stored no 64 pages in 2 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(writer);
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
