//! What bringing a page costs against computing it: rates measured online per tier and direction, and the plan that
//! picks how much of a storage hit to fetch so that the first token comes soonest.
//!
//! A storage hit of `N` pages, after `cached` tokens the request already has (device and host), for a prompt of
//! `prompt` tokens, can be served by fetching its first `k` pages (`0 ≤ k ≤ N`) and computing the rest. The expected
//! time to first token of that choice is
//!
//! ```text
//! T(k) = F(k) + max(H(k), C(cached + k·P → prompt))
//! ```
//!
//! where `F(k)` is the storage read of the `k` pages not in host memory yet (a per-call latency for each batch of
//! [`Rates::batch_pages`] plus the bytes at the read rate; `F(0) = 0`), `H(k)` the load of those pages to the device,
//! which runs layer by layer beside the compute of the rest (so only the longer of the two counts), and `C(a → b)` the
//! prefill of tokens `a..b` after a prefix of `a` tokens: `α·(b − a) + β·(b² − a²)/2`, a cost per token plus
//! attention's cost per token of prefix. [`plan`] takes the `k` of the smallest `T` (evaluating only the counts where
//! it can be least); on a tie, the larger `k` (less compute), so a faster tier never fetches fewer pages.
//!
//! An engine that can compute a prompt in chunks may also *split* a hit ([`Hit::split`]): it computes the hit's
//! first `a` pages (the head, which needs nothing from storage) while the other `N − a` (the tail) are read, then
//! loads the tail beside the compute of the prompt's rest:
//!
//! ```text
//! S(a) = max(C(cached → cached + a·P), F'(N − a)) + max(H(N − a), C(cached + N·P → prompt))
//! ```
//!
//! (`F'` reads the tail: pages that do not start the hit). `S(0)` is fetching the whole hit and `S(N)` computing
//! all of it. Where the read is about as slow as the compute, the two halves meet in the middle and the first token
//! comes up to twice as soon as from either alone (the idea of Cake, arXiv 2410.03065). A split is planned only
//! before any page of the hit is on its way, and taken only when it is at least [`SPLIT_GAIN`] faster than the best
//! `T(k)`: it gives up hits (the head is computed) and makes the engine compute before it asks for the request, which
//! a gain within the model's error does not pay for.
//!
//! A plan's times are expectations; a read can still come late. An engine that *meets* the reads (config
//! `prefetch_meet`) turns that into no loss: every planned fetch, a split's head included, is read from its last
//! page backwards while the engine computes from the front, and the engine takes the pages read as soon as its
//! compute reaches them (`CacheController::meet_prefetch`). Its first token then comes no later than computing
//! everything, and no later than the reads of everything; the plan's head is only where it expects the two to
//! meet.
//!
//! The rates come from [`CostModel`]: priors from the config until measurements exist, then decayed averages of what
//! the storage threads, the loads and the engine's prefills report. Until both the engine's compute and the tier's
//! reads are known, a hit is read so that the reads measure the tier: an engine that splits reads the hit's last
//! quarter ([`PROBE_SHARE`]) while it computes the other three, so a tier of any speed costs the request little
//! more than computing its hit (the read of a quarter hides behind the compute of three quarters unless the tier is
//! three times slower than the compute); an engine that cannot split fetches the whole hit, and once the compute is
//! known the scheduler waits for those reads no longer than computing what they bring would take. A decision must be the same on
//! every TP rank, so the controller reduces each rank's rates over the TP group at its tick (the slowest rank's,
//! [`Rates::encode`]) and plans with the reduced values only.

use std::time::Duration;

/// The rates a plan is made with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// Storage → host: seconds per storage call (its fixed cost).
    pub storage_call_s: f64,
    /// Storage → host: bytes per second; `None` until a read was measured (and no prior given): then a hit is
    /// read to measure it ([`PlanReason::Unmeasured`]).
    pub storage_read_bytes_per_s: Option<f64>,
    /// Host → device: bytes per second.
    pub load_bytes_per_s: f64,
    /// Prefill: seconds per token with no prefix (`α`); `None` while the engine's compute is unknown: then no
    /// plan is made and a hit is fetched whole.
    pub prefill_s_per_token: Option<f64>,
    /// Prefill: seconds each token adds per token of prefix before it (`β`, attention).
    pub prefill_s_per_token_per_prefix: f64,
    /// Pages per storage call.
    pub batch_pages: usize,
}

/// What a hit is, for a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    /// Tokens the request has before the hit (on the device and the host).
    pub cached_tokens: usize,
    /// Pages storage holds after them.
    pub pages: usize,
    /// Tokens per page.
    pub page_tokens: usize,
    /// Bytes of one page on this rank.
    pub page_bytes: u64,
    /// The prompt's tokens (at least `cached_tokens + pages · page_tokens`).
    pub prompt_tokens: usize,
    /// The hit's first pages already in host memory: they cost no read.
    pub arrived_pages: usize,
    /// The engine can compute the hit's head while its tail is read (a chunked prefill); see the module docs.
    pub split: bool,
    /// The fewest pages worth a read (the prefetch threshold): the tail that measures a tier not yet measured is no
    /// shorter.
    pub min_fetch_pages: usize,
}

/// Why a plan fetches what it fetches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanReason {
    /// The engine's compute or the tier's read rate is not known yet (no prior, nothing measured): the whole hit is
    /// fetched, or, where the engine splits, its last quarter while the rest is computed (the reads measure the tier).
    Unmeasured,
    /// Fetching the whole hit is the fastest.
    FetchAll,
    /// Fetching part of the hit and computing the rest is the fastest.
    FetchPart,
    /// Computing the whole hit is faster than fetching any of it.
    RecomputeFaster,
    /// Computing the hit's head while its tail is fetched is the fastest.
    Split,
}

impl PlanReason {
    /// The name used in reports and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::Unmeasured => "unmeasured",
            Self::FetchAll => "fetch_all",
            Self::FetchPart => "fetch_part",
            Self::RecomputeFaster => "recompute_faster",
            Self::Split => "split",
        }
    }
}

/// A plan for one hit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    /// Pages at the hit's start the engine computes while the others are fetched (0 unless the plan splits).
    pub compute_head_pages: usize,
    /// Pages to fetch: those after the head (the hit's first ones when it does not split).
    pub fetch_pages: usize,
    /// Why.
    pub reason: PlanReason,
    /// The expected time to first token of the plan, of fetching the whole hit and of computing all of it (zero
    /// when the compute rate is unknown).
    pub expected: Duration,
    /// As `expected`, fetching the whole hit.
    pub fetch_all: Duration,
    /// As `expected`, fetching nothing.
    pub recompute: Duration,
    /// The rates the plan was made with.
    pub rates: Rates,
}

impl Rates {
    /// Seconds to compute tokens `from..to` after a prefix of `from` tokens (zero when the compute is unknown).
    pub fn compute_s(&self, from: usize, to: usize) -> f64 {
        let Some(alpha) = self.prefill_s_per_token else { return 0.0 };
        let (from, to) = (from as f64, to.max(from) as f64);
        alpha * (to - from) + self.prefill_s_per_token_per_prefix * (to * to - from * from) / 2.0
    }

    /// Seconds to read `pages` pages of `page_bytes` from storage (the bytes cost nothing while the rate is unknown).
    pub fn fetch_s(&self, pages: usize, page_bytes: u64) -> f64 {
        if pages == 0 {
            return 0.0;
        }
        let calls = pages.div_ceil(self.batch_pages.max(1)) as f64;
        let per_byte = self.storage_read_bytes_per_s.map_or(0.0, |rate| 1.0 / rate);
        calls * self.storage_call_s + (pages as u64 * page_bytes) as f64 * per_byte
    }

    /// Seconds to load `pages` pages of `page_bytes` to the device.
    pub fn load_s(&self, pages: usize, page_bytes: u64) -> f64 {
        (pages as u64 * page_bytes) as f64 / self.load_bytes_per_s
    }

    /// Expected time to first token when the hit's first `fetch` pages are fetched and the rest computed.
    pub fn ttft_s(&self, hit: &Hit, fetch: usize) -> f64 {
        let computed_from = hit.cached_tokens + fetch * hit.page_tokens;
        self.fetch_s(fetch.saturating_sub(hit.arrived_pages), hit.page_bytes)
            + self.load_s(fetch, hit.page_bytes).max(self.compute_s(computed_from, hit.prompt_tokens))
    }

    /// Expected time to first token when the hit's first `head` pages are computed while the others are fetched
    /// (nothing of the hit arrived yet), then the others loaded beside the compute of the prompt's rest.
    pub fn split_ttft_s(&self, hit: &Hit, head: usize) -> f64 {
        let head = head.min(hit.pages);
        let tail = hit.pages - head;
        let head_end = hit.cached_tokens + head * hit.page_tokens;
        let hit_end = hit.cached_tokens + hit.pages * hit.page_tokens;
        self.compute_s(hit.cached_tokens, head_end).max(self.fetch_s(tail, hit.page_bytes))
            + self.load_s(tail, hit.page_bytes).max(self.compute_s(hit_end, hit.prompt_tokens))
    }

    /// The rates as integers for the tick's collective, in units where larger is slower, so that a MAX over the
    /// ranks is the slowest rank's (the collective reduces with MIN: the caller negates): nanoseconds per call,
    /// femtoseconds per byte read and loaded (a load at 55 GB/s is 18 182 fs a byte; whole picoseconds would round
    /// it to 18, and 52 GB/s to 50), picoseconds per token, attoseconds per token per prefix token
    /// (0: unknown, for the read and the prefill rates).
    pub fn encode(&self) -> [i64; ENCODED] {
        let scaled = |value: f64, unit: f64| (value * unit).round().clamp(0.0, i64::MAX as f64) as i64;
        [
            scaled(self.storage_call_s, 1e9),
            self.storage_read_bytes_per_s.map_or(0, |rate| scaled(1.0 / rate, 1e15).max(1)),
            scaled(1.0 / self.load_bytes_per_s, 1e15),
            self.prefill_s_per_token.map_or(0, |alpha| scaled(alpha, 1e12).max(1)),
            scaled(self.prefill_s_per_token_per_prefix, 1e18),
        ]
    }

    /// The rates [`encode`](Self::encode) gave (reduced over the ranks), with `batch_pages`.
    pub fn decode(values: &[i64; ENCODED], batch_pages: usize) -> Self {
        // a zero time per byte would be an infinite rate: one femtosecond per byte (1 PB/s) is the fastest kept
        let per_byte = |value: i64| 1e15 / value.max(1) as f64;
        Self {
            storage_call_s: values[0] as f64 / 1e9,
            storage_read_bytes_per_s: (values[1] > 0).then(|| per_byte(values[1])),
            load_bytes_per_s: per_byte(values[2]),
            prefill_s_per_token: (values[3] > 0).then(|| values[3] as f64 / 1e12),
            prefill_s_per_token_per_prefix: values[4] as f64 / 1e18,
            batch_pages,
        }
    }
}

/// Values [`Rates::encode`] puts in the tick's collective.
pub const ENCODED: usize = 5;

/// The plan for `hit` with `rates`, fetching at least `at_least` pages (already on their way); see the module docs.
pub fn plan(rates: &Rates, hit: &Hit, at_least: usize) -> Plan {
    let at_least = at_least.min(hit.pages);
    let seconds = |value: f64| Duration::from_secs_f64(value.clamp(0.0, 1e9));
    if rates.prefill_s_per_token.is_none() || rates.storage_read_bytes_per_s.is_none() {
        // an engine that splits computes the head while the tail measures the tier (see the module docs)
        let probe = if hit.split && at_least == 0 && hit.arrived_pages == 0 && hit.pages > 1 {
            hit.pages.div_ceil(PROBE_SHARE).max(hit.min_fetch_pages).min(hit.pages)
        } else {
            hit.pages
        };
        return Plan {
            compute_head_pages: hit.pages - probe,
            fetch_pages: probe,
            reason: PlanReason::Unmeasured,
            expected: Duration::ZERO,
            fetch_all: Duration::ZERO,
            recompute: Duration::ZERO,
            rates: *rates,
        };
    }
    // the last minimum: on a tie the larger fetch
    let mut best = (at_least, rates.ttft_s(hit, at_least));
    for fetch in candidates(rates, hit, at_least) {
        let ttft = rates.ttft_s(hit, fetch);
        if ttft < best.1 || (ttft == best.1 && fetch > best.0) {
            best = (fetch, ttft);
        }
    }
    let mut planned = Plan {
        compute_head_pages: 0,
        fetch_pages: best.0,
        reason: match best.0 {
            fetch if fetch == hit.pages => PlanReason::FetchAll,
            0 => PlanReason::RecomputeFaster,
            _ => PlanReason::FetchPart,
        },
        expected: seconds(best.1),
        fetch_all: seconds(rates.ttft_s(hit, hit.pages)),
        recompute: seconds(rates.ttft_s(hit, 0)),
        rates: *rates,
    };
    if hit.split && at_least == 0 && hit.arrived_pages == 0 {
        let (head, ttft) = split_candidates(rates, hit)
            .into_iter()
            .map(|head| (head, rates.split_ttft_s(hit, head)))
            .fold((0, f64::INFINITY), |best, next| if next.1 < best.1 { next } else { best });
        if ttft < best.1 * (1.0 - SPLIT_GAIN) && head > 0 && head < hit.pages {
            planned.compute_head_pages = head;
            planned.fetch_pages = hit.pages - head;
            planned.reason = PlanReason::Split;
            planned.expected = seconds(ttft);
        }
    }
    planned
}

/// How much faster than the best plan without a split a split must be expected to be (a fraction of it).
pub const SPLIT_GAIN: f64 = 0.05;

/// While a rate is unknown, an engine that splits reads one page in this many of a hit (its tail, at least one
/// page and [`Hit::min_fetch_pages`]) and computes the rest beside the read.
pub const PROBE_SHARE: usize = 4;

/// The head lengths (0 to the hit's pages) where the split's `S` can be least. Below the first head whose compute
/// is no shorter than the tail's read, `S` is the read plus the tail's load or the rest's compute, which never grow
/// with the head: the least value there is at its end. From it on, `S` is the head's compute (convex: its cost per
/// token grows with the prefix) plus the larger of the tail's load (linear) and the rest's compute (constant), a
/// convex sum: its least value is where its step stops falling. Both are found by bisection.
fn split_candidates(rates: &Rates, hit: &Hit) -> Vec<usize> {
    let pages = hit.pages;
    let head_s = |head: usize| rates.compute_s(hit.cached_tokens, hit.cached_tokens + head * hit.page_tokens);
    // the first head whose compute is no shorter than the tail's read (the difference only grows)
    let crossed = first(0, pages, |head| head_s(head) >= rates.fetch_s(pages - head, hit.page_bytes));
    // from there, the first head whose next step does not lower S
    let rising = first(crossed, pages, |head| {
        head == pages || rates.split_ttft_s(hit, head + 1) >= rates.split_ttft_s(hit, head)
    });
    let mut points = vec![0, pages, crossed.saturating_sub(1), crossed, rising];
    points.retain(|point| *point <= pages);
    points.sort_unstable();
    points.dedup();
    points
}

/// The first of `low..=high` where `holds` (false up to a point, true from it on), or `high`.
fn first(low: usize, high: usize, holds: impl Fn(usize) -> bool) -> usize {
    let (mut below, mut above) = (low, high);
    if holds(below) {
        return below;
    }
    while above - below > 1 {
        let middle = below + (above - below) / 2;
        if holds(middle) {
            above = middle;
        } else {
            below = middle;
        }
    }
    above
}

/// The fetch counts (from `at_least` to the hit's pages) where `T` can be least: between two of them `T` is concave
/// or linear. The read `F` is linear between the starts of its calls (a call every `batch_pages` pages after the
/// arrived ones); the load `H` is linear and grows, the compute of the rest `C` is concave (its cost per token grows
/// with the prefix) and shrinks, so `max(H, C)` is `C` up to their crossing and `H` after it. On a concave or linear
/// stretch the least value is at one of its ends. Sorted, without repeats; `O(pages / batch_pages)` of them, so
/// a plan costs that many evaluations, not one per page.
fn candidates(rates: &Rates, hit: &Hit, at_least: usize) -> Vec<usize> {
    let (low, high) = (at_least, hit.pages);
    let mut points = vec![low, high];
    let batch = rates.batch_pages.max(1);
    let arrived = hit.arrived_pages;
    let mut start = arrived;
    while start <= high {
        points.extend([start, start + 1]);
        start += batch;
    }
    // the first count where the load is no shorter than the compute of the rest (the difference only grows)
    let crossed = |fetch: usize| {
        rates.load_s(fetch, hit.page_bytes)
            >= rates.compute_s(hit.cached_tokens + fetch * hit.page_tokens, hit.prompt_tokens)
    };
    let (mut below, mut above) = (low, high);
    if !crossed(low) && crossed(high) {
        while above - below > 1 {
            let middle = below + (above - below) / 2;
            if crossed(middle) {
                above = middle;
            } else {
                below = middle;
            }
        }
        points.extend([below, above]);
    }
    points.retain(|point| (low..=high).contains(point));
    points.sort_unstable();
    points.dedup();
    points
}

/// Decayed sums of one linear fit `seconds ≈ a·x + b·y` (or `a·x` alone), the newest samples weighing most.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Fit {
    xx: f64,
    xy: f64,
    yy: f64,
    xs: f64,
    ys: f64,
    samples: u64,
}

/// Each new sample scales the older ones by this: about the last 32 samples count.
const DECAY: f64 = 31.0 / 32.0;

/// Reads measured before a read's slowness against the fit counts ([`CostModel`]'s slack).
const SLACK_AFTER: u64 = 3;

/// The most a slow read slows the rates plans use: 4×.
const MAX_SLACK: f64 = 4.0;

impl Fit {
    fn add(&mut self, x: f64, y: f64, seconds: f64) {
        self.add_weighted(x, y, seconds, 1.0);
    }

    /// A sample counted `weight` times (a weight of `1 / seconds²` fits the relative error).
    fn add_weighted(&mut self, x: f64, y: f64, seconds: f64, weight: f64) {
        for sum in [&mut self.xx, &mut self.xy, &mut self.yy, &mut self.xs, &mut self.ys] {
            *sum *= DECAY;
        }
        self.xx += weight * x * x;
        self.xy += weight * x * y;
        self.yy += weight * y * y;
        self.xs += weight * x * seconds;
        self.ys += weight * y * seconds;
        self.samples += 1;
    }

    /// `b` alone, from samples where `x` was 0 (calls that moved no bytes); `None` without such samples.
    fn solve_y(&self) -> Option<f64> {
        (self.samples > 0 && self.xx <= 0.0 && self.yy > 0.0).then(|| (self.ys / self.yy).max(0.0))
    }

    /// `(a, b)` by least squares, both at least zero; `b` is zero (and `a` fitted alone) when the samples cannot
    /// tell the two apart.
    fn solve(&self) -> Option<(f64, f64)> {
        if self.samples == 0 || self.xx <= 0.0 {
            return None;
        }
        let alone = (self.xs / self.xx, 0.0);
        let det = self.xx * self.yy - self.xy * self.xy;
        if det <= 1e-9 * self.xx * self.yy.max(f64::MIN_POSITIVE) {
            return Some(alone);
        }
        let a = (self.xs * self.yy - self.ys * self.xy) / det;
        let b = (self.xx * self.ys - self.xy * self.xs) / det;
        if a > 0.0 && b >= 0.0 { Some((a, b)) } else { Some(alone) }
    }
}

/// Priors: the rates used until measurements exist (the config's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Priors {
    /// Storage → host bytes per second; `None`: unknown until a read is measured.
    pub storage_read_bytes_per_s: Option<f64>,
    /// Seconds per storage call.
    pub storage_call_s: f64,
    /// Host → device bytes per second.
    pub load_bytes_per_s: f64,
    /// Prefill tokens per second with no prefix; `None`: unknown until the engine reports.
    pub prefill_tokens_per_s: Option<f64>,
}

impl Priors {
    /// No compute or read rate (so no plan until both are measured), 10 GB/s loads.
    pub const UNKNOWN: Self = Self {
        storage_read_bytes_per_s: None,
        storage_call_s: 0.0,
        load_bytes_per_s: 1e10,
        prefill_tokens_per_s: None,
    };
}

/// One rank's measured rates.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    priors: Priors,
    batch_pages: usize,
    /// Storage reads: seconds ≈ calls · latency + bytes / rate.
    reads: Fit,
    /// Reads that moved bytes, measured so far.
    byte_reads: u64,
    /// How much slower than the fit recent reads were (at least 1): a read slower than the fit sets it to its ratio,
    /// and each read or hit query after it takes it back towards 1 by [`DECAY`]. Plans read at the fit's rates
    /// divided by it, so a tier whose reads vary is judged by its slow ones: a fetch is chosen only when it is faster
    /// than computing even then.
    read_slack: f64,
    /// Loads: seconds ≈ bytes / rate.
    loads: Fit,
    /// Prefills: seconds ≈ α · tokens + β · (tokens · prefix + tokens² / 2).
    prefills: Fit,
}

impl CostModel {
    /// A model that answers with `priors` until it has measurements; storage calls carry `batch_pages` pages.
    pub fn new(priors: Priors, batch_pages: usize) -> Self {
        Self {
            priors,
            batch_pages,
            reads: Fit::default(),
            byte_reads: 0,
            read_slack: 1.0,
            loads: Fit::default(),
            prefills: Fit::default(),
        }
    }

    /// Storage reads of `bytes` in `calls` calls took `elapsed` (`bytes` 0: calls that only ask what storage
    /// holds, which measure a call's fixed cost).
    pub fn observe_read(&mut self, calls: usize, bytes: u64, elapsed: Duration) {
        if calls == 0 {
            return;
        }
        if bytes > 0 {
            // once the fit has a few reads to stand on, how this one compares with it (the first reads say more
            // about the prior than about the tier); a ratio above MAX_SLACK is taken as MAX_SLACK
            if self.byte_reads >= SLACK_AFTER {
                let (per_byte, per_call) = self.fitted_read();
                let predicted = per_byte.unwrap_or(0.0) * bytes as f64 + per_call * calls as f64;
                let ratio = if predicted > 0.0 { elapsed.as_secs_f64() / predicted } else { 1.0 };
                self.read_slack = ratio.clamp(1.0, MAX_SLACK).max(self.eased_slack());
            }
            self.byte_reads += 1;
        } else {
            // a hit query's calls: time passes for the tier too, and they keep coming while plans compute rather
            // than read (so no read would take the slack back), which a tier that got faster needs
            self.read_slack = self.eased_slack();
        }
        self.reads.add(bytes as f64, calls as f64, elapsed.as_secs_f64());
    }

    /// The slack one sample later, taken back towards 1 by [`DECAY`].
    fn eased_slack(&self) -> f64 {
        1.0 + (self.read_slack - 1.0) * DECAY
    }

    /// Seconds per byte (`None`: unknown) and per call of storage reads: fitted, else the prior per byte and what
    /// the queries say a call costs.
    fn fitted_read(&self) -> (Option<f64>, f64) {
        match self.reads.solve().filter(|(per_byte, _)| *per_byte > 0.0) {
            Some((per_byte, per_call)) => (Some(per_byte), per_call),
            None => (
                self.priors.storage_read_bytes_per_s.map(|rate| 1.0 / rate),
                self.reads.solve_y().unwrap_or(self.priors.storage_call_s),
            ),
        }
    }

    /// A load of `bytes` to the device took `elapsed`.
    pub fn observe_load(&mut self, bytes: u64, elapsed: Duration) {
        if bytes > 0 {
            self.loads.add(bytes as f64, 0.0, elapsed.as_secs_f64());
        }
    }

    /// The engine computed `tokens` after a prefix of `prefix` tokens in `elapsed`.
    pub fn observe_prefill(&mut self, tokens: usize, prefix: usize, elapsed: Duration) {
        if tokens > 0 {
            let tokens = tokens as f64;
            // by relative error: a short pass after a long prefix counts as much as a long prompt computed from
            // scratch, whose seconds would otherwise outweigh it (and it is the pass a plan weighs)
            let seconds = elapsed.as_secs_f64().max(1e-6);
            let attention = tokens * prefix as f64 + tokens * tokens / 2.0;
            self.prefills.add_weighted(tokens, attention, seconds, 1.0 / (seconds * seconds));
        }
    }

    /// The rates now: measured where measured, else the priors.
    pub fn rates(&self) -> Rates {
        let (read_s_per_byte, call_s) = self.fitted_read();
        let slack = self.read_slack;
        let (read_s_per_byte, call_s) = (read_s_per_byte.map(|per_byte| per_byte * slack), call_s * slack);
        let load_s_per_byte = self
            .loads
            .solve()
            .map(|(per_byte, _)| per_byte)
            .filter(|per_byte| *per_byte > 0.0)
            .unwrap_or(1.0 / self.priors.load_bytes_per_s);
        let (alpha, beta) = match self.prefills.solve() {
            Some((alpha, beta)) => (Some(alpha), beta),
            None => (self.priors.prefill_tokens_per_s.map(|rate| 1.0 / rate), 0.0),
        };
        Rates {
            storage_call_s: call_s,
            storage_read_bytes_per_s: read_s_per_byte.map(|per_byte| 1.0 / per_byte),
            load_bytes_per_s: 1.0 / load_s_per_byte,
            prefill_s_per_token: alpha,
            prefill_s_per_token_per_prefix: beta,
            batch_pages: self.batch_pages,
        }
    }
}

#[cfg(test)]
mod tests;
