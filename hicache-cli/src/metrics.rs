//! Prometheus metrics of long-running commands, served at `--metrics-addr` (`GET /metrics`), and the `tracing`
//! subscriber (`RUST_LOG` filters it; silent by default, warnings only for the store commands).
//!
//! The endpoint answers in the format the scraper asks for: OpenMetrics 1.0 (`application/openmetrics-text`) when its
//! `Accept` header names it, as Prometheus's does, else the Prometheus text format 0.0.4 (`text/plain`), which has
//! no `# EOF` and no `# UNIT` lines and names a counter's family after its `_total` samples.
//!
//! The endpoint is a small HTTP/1.1 responder over a `TcpListener` (one request per connection, then closed): two
//! threads answer, 64 connections may wait for them, each has 5 s to send its request and take the answer, and
//! connections beyond those are closed at once. Idle or half-open connections cost no thread and no memory past
//! that bound (an HTTP library's thread per connection did: 577 threads for 600 half-open connections).
//!
//! Metric names (counters get `_total`): `hicache_requests`, `hicache_prompt_tokens`, `hicache_hit_tokens{tier}`
//! (l1, l2, l3), `hicache_transfer_bytes{path}` (device_to_host, host_to_device, host_to_storage, storage_to_host),
//! `hicache_prefetched_tokens`, `hicache_backed_up_tokens`, `hicache_prefetch_stops{reason}`,
//! `hicache_prefetch_unfulfilled_tokens{reason}` (tokens storage held that a prefetch did not bring, by why it
//! stopped: SGLang's `storage_prefetch_unfulfilled_tokens_total`; `recompute_faster` when the cost plan chose to
//! compute them), and the histograms
//! `hicache_prefetch_gbps` (one observation per prefetch that brought pages) and `hicache_load_gbps` (per
//! load-back).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Tier {
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Path {
    path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: String,
}

/// The metrics a replay updates.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    requests: Counter,
    prompt_tokens: Counter,
    hit_tokens: Family<Tier, Counter>,
    transfer_bytes: Family<Path, Counter>,
    prefetched_tokens: Counter,
    backed_up_tokens: Counter,
    prefetch_stops: Family<Reason, Counter>,
    prefetch_unfulfilled_tokens: Family<Reason, Counter>,
    prefetch_gbps: Histogram,
    load_gbps: Histogram,
}

/// A data path of the cache.
#[derive(Clone, Copy, Debug)]
pub(crate) enum DataPath {
    DeviceToHost,
    HostToDevice,
    HostToStorage,
    StorageToHost,
}

impl Metrics {
    pub(crate) fn new() -> Self {
        // 10 MB/s to 80 GB/s
        let buckets = || exponential_buckets(0.01, 2.0, 14);
        let mut metrics = Self {
            registry: Registry::with_prefix("hicache"),
            requests: Counter::default(),
            prompt_tokens: Counter::default(),
            hit_tokens: Family::default(),
            transfer_bytes: Family::default(),
            prefetched_tokens: Counter::default(),
            backed_up_tokens: Counter::default(),
            prefetch_stops: Family::default(),
            prefetch_unfulfilled_tokens: Family::default(),
            prefetch_gbps: Histogram::new(buckets()),
            load_gbps: Histogram::new(buckets()),
        };
        let registry = &mut metrics.registry;
        registry.register("requests", "Requests run", metrics.requests.clone());
        registry.register("prompt_tokens", "Prompt tokens of the requests run", metrics.prompt_tokens.clone());
        registry.register("hit_tokens", "Prompt tokens served from a tier", metrics.hit_tokens.clone());
        registry.register("transfer_bytes", "Bytes moved along a path", metrics.transfer_bytes.clone());
        registry.register("prefetched_tokens", "Tokens prefetched from storage", metrics.prefetched_tokens.clone());
        registry.register("backed_up_tokens", "Tokens written to storage", metrics.backed_up_tokens.clone());
        registry.register("prefetch_stops", "Prefetches finished, by reason", metrics.prefetch_stops.clone());
        registry.register(
            "prefetch_unfulfilled_tokens",
            "Tokens storage held that prefetches did not bring, by reason",
            metrics.prefetch_unfulfilled_tokens.clone(),
        );
        registry.register("prefetch_gbps", "Bandwidth of prefetches that brought pages", metrics.prefetch_gbps.clone());
        registry.register("load_gbps", "Bandwidth of host-to-device load-backs", metrics.load_gbps.clone());
        metrics
    }

    pub(crate) fn request(&self, prompt_tokens: usize, l1: usize, l2: usize, l3: usize) {
        self.requests.inc();
        self.prompt_tokens.inc_by(prompt_tokens as u64);
        for (tier, tokens) in [("l1", l1), ("l2", l2), ("l3", l3)] {
            self.hit_tokens.get_or_create(&Tier { tier }).inc_by(tokens as u64);
        }
    }

    pub(crate) fn moved(&self, path: DataPath, bytes: u64) {
        let path = match path {
            DataPath::DeviceToHost => "device_to_host",
            DataPath::HostToDevice => "host_to_device",
            DataPath::HostToStorage => "host_to_storage",
            DataPath::StorageToHost => "storage_to_host",
        };
        self.transfer_bytes.get_or_create(&Path { path }).inc_by(bytes);
    }

    pub(crate) fn prefetch(&self, reason: &str, tokens: usize, unfulfilled: usize, bytes: u64, seconds: f64) {
        self.prefetch_stops.get_or_create(&Reason { reason: reason.to_owned() }).inc();
        self.prefetched_tokens.inc_by(tokens as u64);
        if unfulfilled > 0 {
            self.prefetch_unfulfilled_tokens
                .get_or_create(&Reason { reason: reason.to_owned() })
                .inc_by(unfulfilled as u64);
        }
        if bytes > 0 && seconds > 0.0 {
            self.prefetch_gbps.observe(bytes as f64 / seconds / 1e9);
        }
    }

    pub(crate) fn backed_up(&self, tokens: usize) {
        self.backed_up_tokens.inc_by(tokens as u64);
    }

    pub(crate) fn load(&self, bytes: u64, seconds: f64) {
        if bytes > 0 && seconds > 0.0 {
            self.load_gbps.observe(bytes as f64 / seconds / 1e9);
        }
    }

    fn render(&self) -> String {
        let mut text = String::new();
        // writing to a String cannot fail
        let _ = encode(&mut text, &self.registry);
        text
    }
}

/// Serves `metrics` at `addr` on a thread for the rest of the process; returns the bound address (port 0 picks
/// one) and says where on stderr.
///
/// # Errors
///
/// [`Usage`](crate::exit::Usage) when `addr` is not an address to listen on; an error when listening fails.
pub(crate) fn serve(addr: &str, metrics: Arc<Metrics>) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs as _;
    let usable = addr.to_socket_addrs().map(|mut addrs| addrs.next().is_some());
    if !matches!(usable, Ok(true)) {
        let why = usable.err().map_or_else(|| "it names no address".to_owned(), |error| error.to_string());
        return Err(crate::exit::Usage(format!(
            "--metrics-addr {addr}: not an address to listen on (HOST:PORT, e.g. 127.0.0.1:9090): {why}"
        ))
        .into());
    }
    let listener =
        std::net::TcpListener::bind(addr).with_context(|| format!("--metrics-addr {addr}: cannot listen"))?;
    let bound = listener.local_addr().context("--metrics-addr: the bound address")?;
    // a fixed number of threads answers, each connection within a deadline; connections past what they can take
    // wait in a bounded queue, then are closed unanswered: a scraper that never sends (or a flood of them) costs no
    // thread and no memory beyond these
    let (queue, connections) = std::sync::mpsc::sync_channel::<std::net::TcpStream>(SCRAPE_QUEUE);
    let connections = Arc::new(std::sync::Mutex::new(connections));
    for worker in 0..SCRAPE_THREADS {
        let (connections, metrics) = (connections.clone(), metrics.clone());
        std::thread::Builder::new().name(format!("hicache-metrics-{worker}")).spawn(move || {
            loop {
                let next = connections.lock().unwrap_or_else(std::sync::PoisonError::into_inner).recv();
                let Ok(stream) = next else { return };
                // a scraper that hung up or stalled is not our failure
                let _ = answer(stream, &metrics);
            }
        })?;
    }
    std::thread::Builder::new().name("hicache-metrics".into()).spawn(move || {
        for stream in listener.incoming().flatten() {
            // a full queue: closed at once (dropped)
            let _ = queue.try_send(stream);
        }
    })?;
    eprintln!("hicache: metrics at http://{bound}/metrics");
    Ok(bound)
}

/// Threads answering scrapes.
const SCRAPE_THREADS: usize = 2;

/// Connections waiting for one of them; more are closed.
const SCRAPE_QUEUE: usize = 64;

/// How long a connection may take to send its request and take the answer.
const SCRAPE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// The largest request head read.
const REQUEST_LIMIT: u64 = 16 << 10;

/// Reads one HTTP request head (within the deadline and the size limit) and answers it: `GET /metrics` in the format
/// its `Accept` header asks for, 404 for any other path, 400 for what is not a request; then closes.
fn answer(stream: std::net::TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    use std::io::{BufRead as _, Read as _, Write as _};
    stream.set_read_timeout(Some(SCRAPE_DEADLINE))?;
    stream.set_write_timeout(Some(SCRAPE_DEADLINE))?;
    let started = std::time::Instant::now();
    let mut reader = std::io::BufReader::new((&stream).take(REQUEST_LIMIT));
    let mut head = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || started.elapsed() > SCRAPE_DEADLINE {
            break;
        }
        if line.trim_end().is_empty() {
            break;
        }
        head.push(line.trim_end().to_owned());
    }
    let mut words = head.first().map(|line| line.split_whitespace()).into_iter().flatten();
    let (method, path) = (words.next(), words.next());
    let (status, content_type, body) = match (method, path) {
        (Some("GET"), Some("/metrics")) => {
            let wants_openmetrics = head.iter().skip(1).any(|line| {
                line.split_once(':').is_some_and(|(name, value)| {
                    name.trim().eq_ignore_ascii_case("accept") && value.contains("application/openmetrics-text")
                })
            });
            if wants_openmetrics {
                ("200 OK", "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics.render())
            } else {
                ("200 OK", "text/plain; version=0.0.4; charset=utf-8", text_format(&metrics.render()))
            }
        }
        (Some(_), Some(_)) => ("404 Not Found", "text/plain; charset=utf-8", "see /metrics\n".to_owned()),
        _ => ("400 Bad Request", "text/plain; charset=utf-8", "not an HTTP request\n".to_owned()),
    };
    let mut stream = &stream;
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}

/// OpenMetrics text as the Prometheus text format 0.0.4: without `# EOF` and `# UNIT`, and with each counter's
/// `# HELP` and `# TYPE` named as its samples are (`…_total`).
fn text_format(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|line| line.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut text = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{prefix}{name}_total {tail}"))
        });
        text.push_str(renamed.as_deref().unwrap_or(line));
        text.push('\n');
    }
    text
}

/// Installs the `tracing` subscriber: events to stderr, filtered by `RUST_LOG`, else by `default` (`off`, or `warn`
/// for commands whose warnings an operator must see).
pub(crate) fn init_tracing(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_format_names_every_family_as_its_samples_and_has_no_openmetrics_lines() {
        let metrics = Metrics::new();
        metrics.requests.inc();
        metrics.moved(crate::metrics::DataPath::DeviceToHost, 4096);
        let openmetrics = metrics.render();
        assert!(openmetrics.ends_with("# EOF\n"), "{openmetrics}");
        let text = text_format(&openmetrics);
        assert!(!text.contains("# EOF") && !text.contains("# UNIT"), "{text}");
        // 0.0.4: every sample belongs to a family declared by a TYPE line of its name, or of its name without a
        // histogram suffix
        let declared: Vec<&str> =
            text.lines().filter_map(|line| line.strip_prefix("# TYPE ")?.split(' ').next()).collect();
        for sample in text.lines().filter(|line| !line.starts_with('#')) {
            let name = sample.split(['{', ' ']).next().unwrap();
            let family =
                ["_bucket", "_sum", "_count"].iter().find_map(|suffix| name.strip_suffix(suffix)).unwrap_or(name);
            assert!(declared.contains(&name) || declared.contains(&family), "{name} undeclared in {text}");
        }
        assert!(text.contains("# TYPE hicache_requests_total counter\nhicache_requests_total 1\n"), "{text}");
    }
}
