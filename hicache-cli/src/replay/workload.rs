//! SGLang's `bench_multiturn` workload at the cache level: clients holding multi-turn conversations.
//!
//! Client `c`'s conversation is `system prompt ++ (user turn ++ answer) × rounds`; the prompt of round `r` is the
//! conversation up to and including the user turn of round `r`, so each round re-sends the whole history and a
//! cache serves everything but the new turn. Token ids are drawn from the seed, so every run and every TP rank sees
//! the same workload.

use rand::rngs::StdRng;
use rand::{RngExt as _, SeedableRng as _};

/// The shape of a workload.
#[derive(Clone, Debug)]
pub(crate) struct WorkloadSpec {
    pub(crate) clients: usize,
    pub(crate) rounds: usize,
    pub(crate) request_length: usize,
    pub(crate) output_length: usize,
    pub(crate) system_prompt: usize,
    /// Mean arrivals per second of simulated time (Poisson), for first rounds; later rounds follow their client's
    /// previous answer after an exponential think time of the same mean spacing.
    pub(crate) request_rate: f64,
    pub(crate) seed: u64,
}

/// The generated conversations.
#[derive(Debug)]
pub(crate) struct Workload {
    pub(crate) spec: WorkloadSpec,
    conversations: Vec<Vec<u32>>,
    /// First-round arrival times, seconds of simulated time, per client.
    pub(crate) first_arrivals: Vec<f64>,
    rng: StdRng,
}

/// A vocabulary the size of Llama 3's.
const VOCABULARY: u32 = 128_256;

impl Workload {
    pub(crate) fn new(spec: WorkloadSpec) -> Self {
        let mut rng = StdRng::seed_from_u64(spec.seed);
        let system: Vec<u32> = (0..spec.system_prompt).map(|_| rng.random_range(0..VOCABULARY)).collect();
        let turn = spec.request_length + spec.output_length;
        let conversations = (0..spec.clients)
            .map(|_| {
                let mut conversation = system.clone();
                conversation.extend((0..turn * spec.rounds).map(|_| rng.random_range(0..VOCABULARY)));
                conversation
            })
            .collect();
        let mut now = 0.0;
        let first_arrivals = (0..spec.clients)
            .map(|_| {
                now += exponential(&mut rng, spec.request_rate);
                now
            })
            .collect();
        Self { spec, conversations, first_arrivals, rng }
    }

    /// The prompt of `client`'s round `round`.
    pub(crate) fn prompt(&self, client: usize, round: usize) -> &[u32] {
        let turn = self.spec.request_length + self.spec.output_length;
        &self.conversations[client][..self.spec.system_prompt + round * turn + self.spec.request_length]
    }

    /// The prompt and the answer of `client`'s round `round`.
    pub(crate) fn with_answer(&self, client: usize, round: usize) -> &[u32] {
        let turn = self.spec.request_length + self.spec.output_length;
        &self.conversations[client][..self.spec.system_prompt + (round + 1) * turn]
    }

    /// The think time before a client's next round, seconds of simulated time.
    pub(crate) fn think_time(&mut self) -> f64 {
        exponential(&mut self.rng, self.spec.request_rate / self.spec.clients.max(1) as f64)
    }

    /// Tokens of the longest conversation.
    pub(crate) fn longest(&self) -> usize {
        self.conversations.iter().map(Vec::len).max().unwrap_or(0)
    }
}

/// An exponential variate of rate `rate` (the spacing of a Poisson process).
fn exponential(rng: &mut StdRng, rate: f64) -> f64 {
    let uniform: f64 = rng.random_range(f64::EPSILON..1.0);
    -uniform.ln() / rate
}
