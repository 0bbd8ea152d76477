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
//! The rates come from [`CostModel`]: priors from the config until measurements exist, then decayed averages of what
//! the storage threads, the loads and the engine's prefills report. Until both the engine's compute and the tier's
//! reads are known, every hit is fetched whole (so the tier's reads get measured); once the compute is known, the
//! scheduler waits for such reads no longer than computing what they bring would take. A decision must be the same on
//! every TP rank, so the controller reduces each rank's rates over the TP group at its tick (the slowest rank's,
//! [`Rates::encode`]) and plans with the reduced values only.

use std::time::Duration;

/// The rates a plan is made with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// Storage → host: seconds per storage call (its fixed cost).
    pub storage_call_s: f64,
    /// Storage → host: bytes per second; `None` until a read was measured (and no prior given): then a hit is
    /// fetched whole, which measures it.
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
}

/// Why a plan fetches what it fetches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanReason {
    /// The engine's compute or the tier's read rate is not known yet (no prior, nothing measured): the whole hit is
    /// fetched (and its reads measure the tier).
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
    /// picoseconds per byte read and loaded, picoseconds per token, attoseconds per token per prefix token
    /// (0: unknown, for the read and the prefill rates).
    pub fn encode(&self) -> [i64; ENCODED] {
        let scaled = |value: f64, unit: f64| (value * unit).round().clamp(0.0, i64::MAX as f64) as i64;
        [
            scaled(self.storage_call_s, 1e9),
            self.storage_read_bytes_per_s.map_or(0, |rate| scaled(1.0 / rate, 1e12).max(1)),
            scaled(1.0 / self.load_bytes_per_s, 1e12),
            self.prefill_s_per_token.map_or(0, |alpha| scaled(alpha, 1e12).max(1)),
            scaled(self.prefill_s_per_token_per_prefix, 1e18),
        ]
    }

    /// The rates [`encode`](Self::encode) gave (reduced over the ranks), with `batch_pages`.
    pub fn decode(values: &[i64; ENCODED], batch_pages: usize) -> Self {
        // a zero time per byte would be an infinite rate: one picosecond per byte (1 TB/s) is the fastest kept
        let per_byte = |value: i64| 1e12 / value.max(1) as f64;
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
        return Plan {
            compute_head_pages: 0,
            fetch_pages: hit.pages,
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
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn rates(read_gbps: f64, tokens_per_s: f64) -> Rates {
        Rates {
            storage_call_s: 1e-4,
            storage_read_bytes_per_s: Some(read_gbps * 1e9),
            load_bytes_per_s: 25e9,
            prefill_s_per_token: Some(1.0 / tokens_per_s),
            prefill_s_per_token_per_prefix: 0.0,
            batch_pages: 128,
        }
    }

    fn hit(pages: usize) -> Hit {
        Hit {
            cached_tokens: 512,
            pages,
            page_tokens: 32,
            page_bytes: 128 << 10,
            prompt_tokens: 512 + pages * 32 + 512,
            arrived_pages: 0,
            split: false,
        }
    }

    #[test]
    fn a_fast_tier_fetches_all_a_slow_one_nothing() {
        // 128 KiB pages of 32 tokens: 4 KiB a token; at 25 000 tokens/s compute is 102 MB/s of KV
        let fast = plan(&rates(2.0, 25_000.0), &hit(64), 0);
        assert_eq!((fast.fetch_pages, fast.reason), (64, PlanReason::FetchAll));
        assert!(fast.expected < fast.recompute, "{fast:?}");
        let slow = plan(&rates(0.04, 25_000.0), &hit(64), 0);
        assert_eq!((slow.fetch_pages, slow.reason), (0, PlanReason::RecomputeFaster));
        assert_eq!(slow.expected, slow.recompute);
        // pages already on their way are kept
        assert_eq!(plan(&rates(0.04, 25_000.0), &hit(64), 5).fetch_pages, 5);
        // pages that arrived cost nothing more: waiting for the rest of a slow read is not worth it, keeping what
        // came is
        let arrived = Hit { arrived_pages: 40, ..hit(64) };
        assert_eq!(plan(&rates(0.04, 25_000.0), &arrived, 40).fetch_pages, 40);
        assert_eq!(plan(&rates(2.0, 25_000.0), &arrived, 40).fetch_pages, 64);
    }

    #[test]
    fn without_a_compute_rate_the_hit_is_fetched_whole() {
        let unknown = Rates { prefill_s_per_token: None, ..rates(0.001, 1.0) };
        let unmeasured_tier = Rates { storage_read_bytes_per_s: None, ..rates(0.001, 1.0) };
        assert_eq!(plan(&unmeasured_tier, &hit(10), 0).reason, PlanReason::Unmeasured);
        let planned = plan(&unknown, &hit(10), 0);
        assert_eq!((planned.fetch_pages, planned.reason), (10, PlanReason::Unmeasured));
    }

    #[test]
    fn a_tier_as_slow_as_the_compute_is_met_in_the_middle() {
        // a page's read (128 KiB at 102.4 MB/s) takes as long as its compute (32 tokens at 25 000 tokens/s): the
        // engine computes half the hit while the other half is read, in about half the time of either alone
        let even = Rates { storage_call_s: 0.0, ..rates(0.1024, 25_000.0) };
        let split = Hit { cached_tokens: 0, prompt_tokens: 64 * 32 + 1, split: true, ..hit(64) };
        let planned = plan(&even, &split, 0);
        assert_eq!(planned.reason, PlanReason::Split, "{planned:?}");
        assert_eq!(planned.compute_head_pages + planned.fetch_pages, 64);
        assert!((31..=33).contains(&planned.compute_head_pages), "{planned:?}");
        let ratio = planned.expected.as_secs_f64() / planned.fetch_all.min(planned.recompute).as_secs_f64();
        assert!((0.49..0.53).contains(&ratio), "{ratio} {planned:?}");
        // an engine that cannot split, or a hit whose first pages are on their way, is not split
        let whole = plan(&even, &Hit { split: false, ..split }, 0);
        assert_eq!(whole.compute_head_pages, 0);
        assert_eq!(plan(&even, &split, 1).compute_head_pages, 0);
        assert_eq!(plan(&even, &Hit { arrived_pages: 1, ..split }, 0).compute_head_pages, 0);
        // a fast tier is fetched whole, a very slow one not at all: a split only where it is faster
        // (at 2 GB/s, computing 3 pages while the other 61 are read would gain 3%: not enough for a split)
        let fast = plan(&rates(2.0, 25_000.0), &split, 0);
        assert_eq!(fast.reason, PlanReason::FetchAll);
        let two = rates(2.0, 25_000.0);
        assert!(two.split_ttft_s(&split, 3) < two.ttft_s(&split, 64) && fast.expected == fast.fetch_all);
        assert_eq!(plan(&rates(0.001, 25_000.0), &split, 0).reason, PlanReason::RecomputeFaster);
    }

    #[test]
    fn a_slow_load_makes_part_of_a_hit_worth_fetching() {
        // storage reads at once; the load (1 GB/s: 1.05 ms a page) runs beside the compute of the rest (1 ms a page):
        // the best is to load about half and compute the other half at the same time
        let rates = Rates {
            storage_call_s: 0.0,
            storage_read_bytes_per_s: Some(1e15),
            load_bytes_per_s: 1e9,
            prefill_s_per_token: Some(1e-5),
            prefill_s_per_token_per_prefix: 0.0,
            batch_pages: 8,
        };
        let hit = Hit {
            cached_tokens: 0,
            pages: 100,
            page_tokens: 100,
            page_bytes: 1 << 20,
            prompt_tokens: 10_000,
            arrived_pages: 0,
            split: false,
        };
        let planned = plan(&rates, &hit, 0);
        assert_eq!((planned.fetch_pages, planned.reason), (49, PlanReason::FetchPart), "{planned:?}");
        let brute = (0..=hit.pages).map(|fetch| rates.ttft_s(&hit, fetch)).fold(f64::INFINITY, f64::min);
        assert!((rates.ttft_s(&hit, planned.fetch_pages) - brute).abs() <= 1e-12);
        assert!(planned.expected < planned.fetch_all && planned.expected < planned.recompute, "{planned:?}");
    }

    #[test]
    fn measured_rates_replace_the_priors() {
        let priors = Priors {
            storage_read_bytes_per_s: Some(1e9),
            storage_call_s: 0.0,
            load_bytes_per_s: 1e10,
            prefill_tokens_per_s: None,
        };
        let mut model = CostModel::new(priors, 4);
        assert_eq!(model.rates().prefill_s_per_token, None);
        assert!((model.rates().storage_read_bytes_per_s.unwrap() / 1e9 - 1.0).abs() < 1e-12);
        // reads: 1 ms per call plus 2 GB/s, in batches of different sizes
        for (calls, bytes) in [(1, 1u64 << 20), (2, 8 << 20), (1, 4 << 20), (3, 2 << 20)] {
            let seconds = calls as f64 * 1e-3 + bytes as f64 / 2e9;
            model.observe_read(calls, bytes, Duration::from_secs_f64(seconds));
        }
        let measured = model.rates();
        assert!((measured.storage_read_bytes_per_s.unwrap() / 2e9 - 1.0).abs() < 1e-6, "{measured:?}");
        // a hit query's calls alone (no bytes): the cost of a call, the prior per byte
        let mut queried = CostModel::new(priors, 4);
        queried.observe_read(3, 0, Duration::from_millis(6));
        let rates = queried.rates();
        assert!((rates.storage_call_s / 2e-3 - 1.0).abs() < 1e-9, "{rates:?}");
        assert!((rates.storage_read_bytes_per_s.unwrap() / 1e9 - 1.0).abs() < 1e-9, "{rates:?}");
        assert!((measured.storage_call_s / 1e-3 - 1.0).abs() < 1e-6, "{measured:?}");
        // prefills: 40 us per token plus 1 ns per token of prefix
        for (tokens, prefix) in [(512, 0), (512, 4096), (1024, 512), (64, 8192)] {
            let (n, x) = (tokens as f64, prefix as f64);
            let seconds = 4e-5 * n + 1e-9 * (n * x + n * n / 2.0);
            model.observe_prefill(tokens, prefix, Duration::from_secs_f64(seconds));
        }
        let measured = model.rates();
        assert!((measured.prefill_s_per_token.unwrap() / 4e-5 - 1.0).abs() < 1e-6, "{measured:?}");
        assert!((measured.prefill_s_per_token_per_prefix / 1e-9 - 1.0).abs() < 1e-6, "{measured:?}");
    }

    #[test]
    fn a_read_slower_than_the_fit_slows_the_plans_rate_until_reads_are_steady_again() {
        let mut model = CostModel::new(Priors::UNKNOWN, 4);
        let steady = |bytes: u64| Duration::from_secs_f64(bytes as f64 / 1e9);
        for bytes in [1u64 << 20, 2 << 20, 3 << 20, 4 << 20] {
            model.observe_read(1, bytes, steady(bytes));
        }
        assert!((model.rates().storage_read_bytes_per_s.unwrap() / 1e9 - 1.0).abs() < 1e-6);
        // one read at half the speed: the plans' rate halves at once (the fit itself moves by a 32nd)
        model.observe_read(1, 4 << 20, steady(8 << 20));
        let slowed = model.rates().storage_read_bytes_per_s.unwrap();
        assert!(slowed < 0.55e9, "{slowed}");
        // steady reads take it back towards the fit, a little each
        let mut last = slowed;
        for _ in 0..64 {
            model.observe_read(1, 4 << 20, steady(4 << 20));
            let now = model.rates().storage_read_bytes_per_s.unwrap();
            assert!(now >= last, "{now} < {last}");
            last = now;
        }
        assert!(last > 0.85e9, "{last}");
        // a read 100 times slower slows the plans 4 times at most beyond what it does to the fit
        model.observe_read(1, 4 << 20, steady(400 << 20));
        assert_eq!(model.read_slack, MAX_SLACK);
    }

    fn arb_rates() -> impl Strategy<Value = Rates> {
        (0.0f64..1e-2, 1e6f64..1e11, 1e8f64..1e11, 1e-7f64..1e-3, 0.0f64..1e-8, 1usize..256).prop_map(
            |(call, read, load, alpha, beta, batch_pages)| Rates {
                storage_call_s: call,
                storage_read_bytes_per_s: Some(read),
                load_bytes_per_s: load,
                prefill_s_per_token: Some(alpha),
                prefill_s_per_token_per_prefix: beta,
                batch_pages,
            },
        )
    }

    fn arb_hit() -> impl Strategy<Value = Hit> {
        (0usize..8192, 0usize..2000, 1usize..128, 1u64..1 << 24, 0usize..4096, 0usize..2000, any::<bool>()).prop_map(
            |(cached, pages, page_tokens, page_bytes, after, arrived, split)| Hit {
                cached_tokens: cached,
                pages,
                page_tokens,
                page_bytes,
                prompt_tokens: cached + pages * page_tokens + after,
                // a split is planned only before anything arrived: half the hits are such
                arrived_pages: if split { 0 } else { arrived.min(pages) },
                split,
            },
        )
    }

    proptest! {
        #[test]
        fn the_plan_is_the_best_of_every_split(rates in arb_rates(), hit in arb_hit(), at_least in 0usize..2500) {
            let planned = plan(&rates, &hit, at_least);
            let floor = at_least.min(hit.pages);
            let head = planned.compute_head_pages;
            prop_assert!(head + planned.fetch_pages <= hit.pages);
            let chosen = if head > 0 {
                prop_assert!(hit.split && floor == 0 && planned.reason == PlanReason::Split);
                prop_assert_eq!(head + planned.fetch_pages, hit.pages);
                rates.split_ttft_s(&hit, head)
            } else {
                prop_assert!(planned.fetch_pages >= floor && planned.fetch_pages <= hit.pages);
                rates.ttft_s(&hit, planned.fetch_pages)
            };
            if hit.split && floor == 0 {
                // against every head: a split is the best of them, and a plan without one leaves none that gains
                // SPLIT_GAIN over it
                let bound = if head > 0 { chosen } else { chosen * (1.0 - SPLIT_GAIN) };
                for head in 1..hit.pages {
                    let other = rates.split_ttft_s(&hit, head);
                    prop_assert!(bound <= other * (1.0 + 1e-9), "computing a head of {head} ({other}) beats the plan {planned:?} ({chosen})");
                }
            }
            // against every count (a relative slack for rounding: the plan evaluates only the candidates)
            for fetch in floor..=hit.pages {
                let other = rates.ttft_s(&hit, fetch);
                prop_assert!(chosen <= other * (1.0 + 1e-9), "fetching {fetch} ({other}) beats the plan's {} ({chosen})", planned.fetch_pages);
            }
            // never slower than either extreme it could choose
            prop_assert!(chosen <= rates.ttft_s(&hit, hit.pages));
            if floor == 0 {
                prop_assert!(chosen <= rates.ttft_s(&hit, 0));
            }
        }

        #[test]
        fn a_faster_tier_never_fetches_fewer_pages(
            rates in arb_rates(), hit in arb_hit(), faster in 1.0f64..100.0, lower_latency in 0.0f64..=1.0,
        ) {
            let quicker = Rates {
                storage_read_bytes_per_s: rates.storage_read_bytes_per_s.map(|rate| rate * faster),
                storage_call_s: rates.storage_call_s * lower_latency,
                ..rates
            };
            prop_assert!(plan(&quicker, &hit, 0).fetch_pages >= plan(&rates, &hit, 0).fetch_pages);
        }

        #[test]
        fn the_reduced_rates_are_the_slowest_ranks(first in arb_rates(), second in arb_rates()) {
            // each rank encodes its own rates; the collective keeps each value's largest (slowest); both ranks
            // decode the same integers
            let (a, b) = (first.encode(), second.encode());
            let reduced: [i64; ENCODED] = std::array::from_fn(|index| a[index].max(b[index]));
            let agreed = Rates::decode(&reduced, first.batch_pages);
            for own in [Rates::decode(&a, first.batch_pages), Rates::decode(&b, first.batch_pages)] {
                prop_assert!(agreed.storage_call_s >= own.storage_call_s);
                prop_assert!(agreed.storage_read_bytes_per_s <= own.storage_read_bytes_per_s);
                prop_assert!(agreed.load_bytes_per_s <= own.load_bytes_per_s);
                prop_assert!(agreed.prefill_s_per_token >= own.prefill_s_per_token);
                prop_assert!(agreed.prefill_s_per_token_per_prefix >= own.prefill_s_per_token_per_prefix);
            }
            // encoding what was decoded changes nothing: the values survive the next tick's reduction as they are
            prop_assert_eq!(agreed.encode(), reduced);
        }
    }
}
