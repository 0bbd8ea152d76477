//! Collectives across tensor-parallel ranks: all-reduce of small fixed-shape integer vectors, and a barrier.
//!
//! Every TP rank must make the same cache decisions, so every value that can differ per rank is reduced before it
//! changes shared state (docs/sglang.md#invariants, item 3). SGLang enters its collectives conditionally on local state
//! and can hang (docs/sglang.md#fixed-16); hicache's controller enters the same collectives in the same order on every
//! rank, and this module makes a violation visible: ranks that enter different collectives in one round all get
//! [`Error::CollectiveMismatch`] instead of silently combining unrelated values, and a rank that never arrives makes
//! the others fail with [`Error::Timeout`] at the deadline instead of hanging. After either, the group is broken and
//! every later call fails at once.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::Error;

/// How an all-reduce combines the ranks' values, element by element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// The smallest.
    Min,
    /// The largest.
    Max,
    /// The sum (wrapping is an error of the caller; values here are small counters).
    Sum,
}

/// A communication group of TP ranks.
pub trait Collective: Send {
    /// This rank.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn world_size(&self) -> usize;

    /// Replaces `values` with their element-wise reduction over all ranks; every rank passes the same length.
    ///
    /// # Errors
    ///
    /// [`Error::CollectiveMismatch`] when ranks entered different collectives or lengths; [`Error::Timeout`] when a
    /// rank did not arrive in time; either breaks the group.
    fn all_reduce(&mut self, values: &mut [i64], op: ReduceOp) -> Result<(), Error>;

    /// Returns once every rank has entered.
    ///
    /// # Errors
    ///
    /// As [`all_reduce`](Self::all_reduce).
    fn barrier(&mut self) -> Result<(), Error>;
}

/// The group of one rank: every collective returns at once, values unchanged.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce(&mut self, _values: &mut [i64], _op: ReduceOp) -> Result<(), Error> {
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), Error> {
        Ok(())
    }
}

/// What a rank entered, to check that all ranks of a round entered the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    AllReduce { op: ReduceOp, len: usize },
    Barrier,
}

#[derive(Debug)]
struct Round {
    /// Rounds completed so far.
    generation: u64,
    arrived: usize,
    entry: Option<Entry>,
    values: Vec<i64>,
    mismatch: Option<String>,
    /// The outcome of the last completed round.
    outcome: Result<Vec<i64>, String>,
    /// Set when a round failed or timed out: the ranks are no longer in step.
    broken: Option<String>,
}

#[derive(Debug)]
struct Shared {
    round: Mutex<Round>,
    arrived: Condvar,
    world_size: usize,
    timeout: Duration,
}

/// One rank of a group of threads in one process (tests, and single-process multi-rank replays).
#[derive(Debug)]
pub struct InProcessGroup {
    shared: Arc<Shared>,
    rank: usize,
}

impl InProcessGroup {
    /// The ranks of a group of `world_size`, whose collectives fail after waiting `timeout` for a rank.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `world_size` is zero.
    pub fn new(world_size: usize, timeout: Duration) -> Result<Vec<Self>, Error> {
        if world_size == 0 {
            return Err(Error::InvalidArgument { field: "world_size", reason: "must be at least 1".into() });
        }
        let shared = Arc::new(Shared {
            round: Mutex::new(Round {
                generation: 0,
                arrived: 0,
                entry: None,
                values: Vec::new(),
                mismatch: None,
                outcome: Ok(Vec::new()),
                broken: None,
            }),
            arrived: Condvar::new(),
            world_size,
            timeout,
        });
        Ok((0..world_size).map(|rank| Self { shared: shared.clone(), rank }).collect())
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        // a round's fields are updated together under the lock by code that cannot panic midway
        self.shared.round.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn enter(&self, entry: Entry, values: &[i64], op: ReduceOp) -> Result<Vec<i64>, Error> {
        let mut round = self.lock();
        if let Some(reason) = &round.broken {
            return Err(Error::CollectiveMismatch {
                rank: self.rank,
                reason: format!("group broken earlier: {reason}"),
            });
        }
        let generation = round.generation;
        match round.entry {
            None => {
                round.entry = Some(entry);
                round.values = values.to_vec();
            }
            Some(first) if first != entry => {
                let note = format!("rank {} entered {entry:?} while another rank entered {first:?}", self.rank);
                round.mismatch.get_or_insert(note);
            }
            Some(_) => {
                for (into, &value) in round.values.iter_mut().zip(values) {
                    *into = match op {
                        ReduceOp::Min => (*into).min(value),
                        ReduceOp::Max => (*into).max(value),
                        ReduceOp::Sum => into.wrapping_add(value),
                    };
                }
            }
        }
        round.arrived += 1;
        if round.arrived == self.shared.world_size {
            round.outcome = match round.mismatch.take() {
                None => Ok(std::mem::take(&mut round.values)),
                Some(reason) => {
                    round.broken = Some(reason.clone());
                    Err(reason)
                }
            };
            round.generation += 1;
            round.arrived = 0;
            round.entry = None;
            self.shared.arrived.notify_all();
        } else {
            let deadline = Instant::now() + self.shared.timeout;
            while round.generation == generation && round.broken.is_none() {
                let now = Instant::now();
                if now >= deadline {
                    let reason = format!(
                        "rank {} waited {} ms for {} of {} ranks in {entry:?}",
                        self.rank,
                        self.shared.timeout.as_millis(),
                        self.shared.world_size - round.arrived,
                        self.shared.world_size
                    );
                    round.broken = Some(reason);
                    self.shared.arrived.notify_all();
                    return Err(Error::Timeout {
                        backend: "collective".into(),
                        operation: "all_reduce or barrier",
                        waited_ms: self.shared.timeout.as_millis() as u64,
                    });
                }
                round = self
                    .shared
                    .arrived
                    .wait_timeout(round, deadline - now)
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .0;
            }
            if round.generation == generation {
                let reason = round.broken.clone().unwrap_or_default();
                return Err(Error::CollectiveMismatch { rank: self.rank, reason });
            }
        }
        // the next round cannot complete without this rank, so the last outcome is this round's
        round.outcome.clone().map_err(|reason| Error::CollectiveMismatch { rank: self.rank, reason })
    }
}

impl Collective for InProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce(&mut self, values: &mut [i64], op: ReduceOp) -> Result<(), Error> {
        let reduced = self.enter(Entry::AllReduce { op, len: values.len() }, values, op)?;
        values.copy_from_slice(&reduced);
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), Error> {
        self.enter(Entry::Barrier, &[], ReduceOp::Min).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn run<T: Send + 'static>(
        world: usize,
        timeout: Duration,
        body: impl Fn(InProcessGroup) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let body = Arc::new(body);
        let ranks = InProcessGroup::new(world, timeout).unwrap();
        let threads: Vec<_> = ranks
            .into_iter()
            .map(|group| {
                let body = body.clone();
                std::thread::spawn(move || body(group))
            })
            .collect();
        threads.into_iter().map(|thread| thread.join().unwrap()).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        /// Many rounds of random vectors: every rank gets the element-wise reduction, computed here independently.
        #[test]
        fn all_ranks_get_the_reduction(world in 1usize..5, rounds in prop::collection::vec(prop::collection::vec(any::<i32>(), 4 * 3), 1..12)) {
            let inputs: Vec<Vec<i64>> = rounds.iter().map(|round| round.iter().map(|&value| i64::from(value)).collect()).collect();
            let shared_inputs = Arc::new(inputs.clone());
            let results = run(world, Duration::from_secs(20), move |mut group| {
                let mut outputs = Vec::new();
                for (index, input) in shared_inputs.iter().enumerate() {
                    let op = [ReduceOp::Min, ReduceOp::Max, ReduceOp::Sum][index % 3];
                    // each rank contributes its slice of the round's values, 3 per rank, rotated by rank
                    let mut values: Vec<i64> = (0..3).map(|at| input[(group.rank() * 3 + at) % input.len()]).collect();
                    group.all_reduce(&mut values, op).unwrap();
                    outputs.push(values);
                }
                group.barrier().unwrap();
                outputs
            });
            for (index, input) in inputs.iter().enumerate() {
                let expected: Vec<i64> = (0..3)
                    .map(|at| {
                        let column = (0..world).map(|rank| input[(rank * 3 + at) % input.len()]);
                        match index % 3 {
                            0 => column.min().unwrap(),
                            1 => column.max().unwrap(),
                            _ => column.sum(),
                        }
                    })
                    .collect();
                for per_rank in &results {
                    prop_assert_eq!(&per_rank[index], &expected);
                }
            }
        }
    }

    #[test]
    fn ranks_in_different_collectives_all_fail_and_stay_failed() {
        let results = run(3, Duration::from_secs(20), |mut group| {
            let first = if group.rank() == 1 { group.barrier() } else { group.all_reduce(&mut [1, 2], ReduceOp::Min) };
            let second = group.all_reduce(&mut [1, 2], ReduceOp::Min);
            (first, second)
        });
        for (first, second) in results {
            assert!(matches!(first, Err(Error::CollectiveMismatch { .. })), "{first:?}");
            assert!(second.unwrap_err().to_string().contains("group broken earlier"));
        }
        let lengths = run(2, Duration::from_secs(20), |mut group| {
            let mut values = vec![0; group.rank() + 1];
            group.all_reduce(&mut values, ReduceOp::Max)
        });
        assert!(lengths.iter().all(Result::is_err), "different lengths are a mismatch: {lengths:?}");
    }

    #[test]
    fn a_missing_rank_times_out_instead_of_hanging() {
        let started = Instant::now();
        let results = run(3, Duration::from_millis(100), |mut group| {
            if group.rank() == 2 {
                // this rank skips the collective, as SGLang's conditional all-reduces could
                return Ok(());
            }
            group.all_reduce(&mut [5], ReduceOp::Min)
        });
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(
            matches!(results[0], Err(Error::Timeout { .. }) | Err(Error::CollectiveMismatch { .. })),
            "{results:?}"
        );
        assert!(results[1].is_err());
        let mut single = SingleRank;
        let mut values = [3, 1];
        single.all_reduce(&mut values, ReduceOp::Sum).unwrap();
        assert_eq!((values, single.world_size()), ([3, 1], 1));
    }
}
