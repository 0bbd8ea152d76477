//! A storage client that its backend replaces after a failure the library cannot vouch for.
//!
//! Some libraries can fail a call while a transfer of that call is still in flight into the caller's memory (a
//! Mooncake batch whose transfers missed their deadline reports `TRANSFER_FAIL` with the transfers still running).
//! The caller's pages may be handed back only once nothing can write them any more, and the one way to be sure is to
//! close the client, which stops its transfers. [`Replaceable`] holds such a client:
//! * calls run under a shared lock ([`call`](Replaceable::call)), so a client is never closed under a call;
//! * [`retire`](Replaceable::retire) takes the client out once the calls in flight have ended, closes it, and
//!   returns only when it is closed. Every other call that used the same client and asks to retire it returns only
//!   then too, so no caller gets its memory back while that client can still write it;
//! * until [`install`](Replaceable::install) puts a new client in, calls fail at once, saying why;
//! * a client whose close does not end in time leaves the holder refused for good (its memory may still be written:
//!   the backend must be reopened, and the process should not reuse that memory).

use std::time::{Duration, Instant};

use crate::sync::{Condvar, Mutex, RwLock};

/// Which client a call ran on: [`Replaceable::retire`] names it, so a retirement never closes a newer client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Generation(u64);

/// A client that can be retired and replaced; see the module docs.
pub struct Replaceable<C> {
    state: RwLock<State<C>>,
    /// The generation being retired and why, from the retirement's start until its client is taken out: calls fail
    /// at once meanwhile, instead of queueing behind the retirement's wait for the calls in flight.
    retiring: Mutex<Option<(Generation, String)>>,
    closed: Mutex<Closed>,
    closed_changed: Condvar,
}

struct State<C> {
    /// The client and its generation; `None` between a retirement and the next install.
    current: Option<(Generation, C)>,
    /// The generation of the last client installed.
    installed: Generation,
    /// Why there is no client, and since when.
    down: Option<(Instant, String)>,
}

/// Which generations are closed. Generations are retired in order (a new client is installed only after the
/// retirement of the last one ended), so one number says it.
#[derive(Default)]
struct Closed {
    through: u64,
    /// Set when a close did not end in time: nothing is installed after it.
    stuck: Option<String>,
}

/// How [`Replaceable::retire`] ended, when the client is closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retired {
    /// This call closed it: the caller starts its replacement.
    ByThisCall,
    /// Another call retired it (or it was replaced already) and it is closed.
    ByAnother,
}

impl<C> Replaceable<C> {
    /// Holds `client`.
    pub fn new(client: C) -> Self {
        let first = Generation(1);
        Self {
            state: RwLock::new(State { current: Some((first, client)), installed: first, down: None }),
            retiring: Mutex::new(None),
            closed: Mutex::new(Closed::default()),
            closed_changed: Condvar::new(),
        }
    }

    /// Runs `f` on the client, under the shared lock; its generation with the result. `f` must not retire (it runs
    /// under the lock a retirement takes).
    ///
    /// # Errors
    ///
    /// Why there is no client (being retired, retired and not replaced yet, or stuck), at once.
    pub fn call<R>(&self, f: impl FnOnce(&C) -> R) -> Result<(Generation, R), String> {
        if let Some((_, why)) = &*self.retiring.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
            return Err(format!(
                "no client: {why}; it is being closed, and calls fail at once until a new one connects"
            ));
        }
        let state = self.state.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        match &state.current {
            Some((generation, client)) => Ok((*generation, f(client))),
            None => Err(down_message(state.down.as_ref())),
        }
    }

    /// Runs `f` on the client of `generation` if that is the client in place (to undo what an earlier call did on
    /// it, or to run a transfer on the client that registered its memory); `None` when it was retired.
    pub fn call_on<R>(&self, generation: Generation, f: impl FnOnce(&C) -> R) -> Option<R> {
        let state = self.state.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        match &state.current {
            Some((current, client)) if *current == generation => Some(f(client)),
            _ => None,
        }
    }

    /// Retires the client of `generation` for `why`: waits for the calls in flight on it, takes it out and closes it
    /// with `close` (which says whether the close ended), unless another call already does; returns once that
    /// client is closed, waiting up to `wait` for a close another call runs.
    ///
    /// # Errors
    ///
    /// The client could not be closed in time (by this call or another): its transfers may still touch memory, and
    /// the holder refuses every later call.
    pub fn retire(
        &self,
        generation: Generation,
        why: String,
        close: impl FnOnce(C) -> bool,
        wait: Duration,
    ) -> Result<Retired, String> {
        if let Some(settled) = self.closed_settles(generation) {
            return settled;
        }
        let retires = {
            let mut retiring = self.retiring.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let current = self.state_generation();
            let first = retiring.is_none() && current == Some(generation);
            if first {
                *retiring = Some((generation, why.clone()));
            }
            first
        };
        if retires {
            let client = {
                let mut state = self.state.write().unwrap_or_else(std::sync::PoisonError::into_inner);
                state.down = Some((Instant::now(), why.clone()));
                let (_, client) = state.current.take().expect("only the retiring call takes the client out");
                client
            };
            // (locks: `retiring` is taken before the state, never inside it)
            *self.retiring.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
            let ended = close(client);
            let mut closed = self.closed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if ended {
                closed.through = closed.through.max(generation.0);
            } else {
                let stuck =
                    format!("{why}; closing the client did not end in time, so it may still move bytes: reopen");
                self.state.write().unwrap_or_else(std::sync::PoisonError::into_inner).down =
                    Some((Instant::now(), stuck.clone()));
                closed.stuck.get_or_insert(stuck);
            }
            self.closed_changed.notify_all();
            return match &closed.stuck {
                Some(stuck) if !ended => Err(stuck.clone()),
                _ => Ok(Retired::ByThisCall),
            };
        }
        // another call retires it (or did): its close is waited for, with some margin over the close's own deadline
        // (which may have started before this wait did)
        let deadline = Instant::now() + wait + wait / 4;
        let mut closed = self.closed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if closed.through >= generation.0 {
                return Ok(Retired::ByAnother);
            }
            if let Some(stuck) = &closed.stuck {
                return Err(stuck.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "{why}; the client is being closed by another call, which did not end within {} ms",
                    wait.as_millis()
                ));
            }
            closed = self.closed_changed.wait_timeout(closed, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// How a retirement of `generation` ends without waiting: closed already, or stuck; `None` when it must wait.
    fn closed_settles(&self, generation: Generation) -> Option<Result<Retired, String>> {
        let closed = self.closed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if closed.through >= generation.0 { Some(Ok(Retired::ByAnother)) } else { closed.stuck.clone().map(Err) }
    }

    fn state_generation(&self) -> Option<Generation> {
        let state = self.state.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.current.as_ref().map(|(generation, _)| *generation)
    }

    /// Puts `client` in, replacing none: calls run on it from now on. A holder left stuck refuses it (it is dropped).
    pub fn install(&self, client: C) {
        if self.closed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).stuck.is_some() {
            return;
        }
        let mut state = self.state.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        let generation = Generation(state.installed.0 + 1);
        state.installed = generation;
        state.current = Some((generation, client));
        state.down = None;
    }

    /// Why calls fail now, if they do.
    pub fn down(&self) -> Option<String> {
        if let Some((_, why)) = &*self.retiring.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
            return Some(format!("no client: {why}; it is being closed"));
        }
        let state = self.state.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.current.is_none().then(|| down_message(state.down.as_ref()))
    }
}

fn down_message(down: Option<&(Instant, String)>) -> String {
    match down {
        Some((since, why)) if why.ends_with("reopen") => {
            format!("no client: {why} ({:.1} s ago)", since.elapsed().as_secs_f64())
        }
        Some((since, why)) => format!(
            "no client: {why} ({:.1} s ago); calls fail at once until a new client connects",
            since.elapsed().as_secs_f64()
        ),
        None => "no client".to_owned(),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;

    /// A client that knows whether it was closed.
    struct Fake {
        closed: Arc<AtomicBool>,
    }

    fn fake() -> (Fake, Arc<AtomicBool>) {
        let closed = Arc::new(AtomicBool::new(false));
        (Fake { closed: closed.clone() }, closed)
    }

    fn close(client: Fake) -> bool {
        client.closed.store(true, Ordering::SeqCst);
        true
    }

    #[test]
    fn every_failing_caller_returns_only_after_its_client_is_closed_and_none_runs_on_a_closed_one() {
        for round in 0..50 {
            let (client, _) = fake();
            let holder = Arc::new(Replaceable::new(client));
            let installs = Arc::new(AtomicUsize::new(0));
            let threads: Vec<_> = (0..6)
                .map(|thread| {
                    let (holder, installs) = (holder.clone(), installs.clone());
                    std::thread::spawn(move || {
                        for call in 0..40 {
                            let used = holder.call(|client| {
                                assert!(!client.closed.load(Ordering::SeqCst), "a call ran on a closed client");
                                client.closed.clone()
                            });
                            let Ok((generation, flag)) = used else { continue };
                            // a random few calls fail in a way that leaves the client unusable
                            if (thread * 7 + call * 3 + round) % 11 == 0 {
                                let retired =
                                    holder.retire(generation, "failed".into(), close, Duration::from_secs(60));
                                assert!(retired.is_ok());
                                assert!(flag.load(Ordering::SeqCst), "retire returned before the client was closed");
                                if retired == Ok(Retired::ByThisCall) {
                                    installs.fetch_add(1, Ordering::SeqCst);
                                    holder.install(fake().0);
                                }
                            }
                        }
                    })
                })
                .collect();
            for thread in threads {
                thread.join().unwrap();
            }
            assert!(installs.load(Ordering::SeqCst) > 0);
            assert!(holder.down().is_none());
        }
    }

    #[test]
    fn a_retired_client_fails_calls_at_once_naming_why_until_a_new_one_is_installed() {
        let (client, closed) = fake();
        let holder = Replaceable::new(client);
        let (generation, ()) = holder.call(|_| ()).unwrap();
        assert_eq!(holder.retire(generation, "TRANSFER_FAIL".into(), close, Duration::ZERO), Ok(Retired::ByThisCall));
        assert!(closed.load(Ordering::SeqCst));
        let refused = holder.call(|_| ()).unwrap_err();
        assert!(refused.contains("TRANSFER_FAIL") && refused.contains("fail at once"), "{refused}");
        assert!(holder.down().is_some_and(|why| why.contains("TRANSFER_FAIL")));
        // a late retirement of the old generation does not touch the new client
        let (new, new_closed) = fake();
        holder.install(new);
        assert_eq!(holder.call_on(generation, |_| ()), None, "ran on a retired client's generation");
        assert_eq!(holder.retire(generation, "late".into(), close, Duration::ZERO), Ok(Retired::ByAnother));
        assert!(!new_closed.load(Ordering::SeqCst));
        let (newer, ()) = holder.call(|_| ()).unwrap();
        assert!(newer > generation);
    }

    #[test]
    fn a_close_that_does_not_end_leaves_the_holder_refused_for_good() {
        let (client, _) = fake();
        let holder = Replaceable::new(client);
        let (generation, ()) = holder.call(|_| ()).unwrap();
        let stuck = holder.retire(generation, "TRANSFER_FAIL".into(), |_| false, Duration::ZERO).unwrap_err();
        assert!(stuck.contains("reopen"), "{stuck}");
        // another caller of the same client hears the same
        assert_eq!(holder.retire(generation, "again".into(), close, Duration::ZERO), Err(stuck));
        holder.install(fake().0);
        let refused = holder.call(|_| ()).unwrap_err();
        assert!(refused.contains("reopen") && !refused.contains("until a new client"), "{refused}");
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    struct Fake(Arc<AtomicBool>);

    #[test]
    fn loom_no_call_runs_on_a_closed_client_and_retire_returns_after_the_close() {
        loom::model(|| {
            let holder = Arc::new(Replaceable::new(Fake(Arc::new(AtomicBool::new(false)))));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let holder = holder.clone();
                    loom::thread::spawn(move || {
                        let used = holder.call(|client| {
                            assert!(!client.0.load(Ordering::SeqCst));
                            client.0.clone()
                        });
                        if let Ok((generation, flag)) = used {
                            let close = |client: Fake| {
                                client.0.store(true, Ordering::SeqCst);
                                true
                            };
                            let retired = holder.retire(generation, "failed".into(), close, Duration::from_secs(1));
                            assert!(retired.is_ok());
                            assert!(flag.load(Ordering::SeqCst));
                            if retired == Ok(Retired::ByThisCall) {
                                holder.install(Fake(Arc::new(AtomicBool::new(false))));
                            }
                        }
                    })
                })
                .collect();
            for thread in threads {
                thread.join().unwrap();
            }
        });
    }
}
