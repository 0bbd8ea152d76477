//! TP ranks as processes of one host without a GPU (`replay --processes --engine cpu`): the core's `Collective` over
//! a Unix socket, rank 0 the hub. Every rank sends its header (round, call, operation, length) and values to rank 0,
//! which checks that every header is its own, reduces, and sends the result (or the mismatch) back. Every wait is
//! bounded by the deadline; a rank that does not answer in time is named, and the group is broken after a failure.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use hicache_core::Error;
use hicache_core::collective::{Collective, ReduceOp};

/// A group of ranks joined through a socket file.
pub(crate) struct SocketGroup {
    rank: usize,
    world_size: usize,
    deadline: Duration,
    /// Rank 0: a stream per other rank (index `rank - 1`); other ranks: the stream to rank 0.
    links: Vec<UnixStream>,
    round: u64,
    broken: Option<String>,
}

const CALL_ALL_REDUCE: u64 = 1;
const CALL_BARRIER: u64 = 2;
const MISMATCH: u64 = u64::MAX;

fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Min => 1,
        ReduceOp::Max => 2,
        ReduceOp::Sum => 3,
    }
}

fn timeout(what: String, operation: &'static str, waited: Duration) -> Error {
    Error::Timeout { backend: what, operation, waited_ms: waited.as_millis() as u64 }
}

impl SocketGroup {
    /// Joins as `rank` of `world_size` through the socket file `path` (rank 0 makes it), within `deadline`.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] naming the ranks that did not join; [`Error::Storage`]-free I/O errors as
    /// [`Error::Internal`].
    pub(crate) fn join(rank: usize, world_size: usize, path: &Path, deadline: Duration) -> Result<Self, Error> {
        let started = Instant::now();
        let io = |what: &str, error: std::io::Error| {
            Error::Internal(format!("socket group at {}: {what}: {error}", path.display()))
        };
        let mut links = Vec::new();
        if rank == 0 {
            let listener = UnixListener::bind(path).map_err(|error| io("bind", error))?;
            listener.set_nonblocking(true).map_err(|error| io("listen", error))?;
            let mut joined: Vec<Option<UnixStream>> = (1..world_size).map(|_| None).collect();
            while joined.iter().any(Option::is_none) {
                match listener.accept() {
                    Ok((mut stream, _)) => {
                        stream.set_nonblocking(false).map_err(|error| io("accept", error))?;
                        stream.set_read_timeout(Some(deadline)).map_err(|error| io("accept", error))?;
                        let mut word = [0u8; 8];
                        stream.read_exact(&mut word).map_err(|error| io("a rank's greeting", error))?;
                        let peer = u64::from_le_bytes(word) as usize;
                        match joined.get_mut(peer.wrapping_sub(1)) {
                            Some(slot @ None) => *slot = Some(stream),
                            _ => {
                                return Err(Error::Internal(format!(
                                    "socket group: rank {peer} joined twice or is not in a group of {world_size}"
                                )));
                            }
                        }
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                        if started.elapsed() > deadline {
                            let missing: Vec<usize> = joined
                                .iter()
                                .enumerate()
                                .filter(|(_, slot)| slot.is_none())
                                .map(|(index, _)| index + 1)
                                .collect();
                            return Err(timeout(
                                format!("socket group (ranks {missing:?} did not join)"),
                                "join",
                                started.elapsed(),
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(error) => return Err(io("accept", error)),
                }
            }
            links = joined.into_iter().map(|slot| slot.expect("every rank joined")).collect();
        } else {
            let mut stream = loop {
                match UnixStream::connect(path) {
                    Ok(stream) => break stream,
                    Err(_) if started.elapsed() < deadline => std::thread::sleep(Duration::from_millis(5)),
                    Err(_) => {
                        return Err(timeout("socket group (rank 0 did not open it)".into(), "join", started.elapsed()));
                    }
                }
            };
            stream.write_all(&(rank as u64).to_le_bytes()).map_err(|error| io("greeting rank 0", error))?;
            links.push(stream);
        }
        for link in &links {
            link.set_read_timeout(Some(deadline)).map_err(|error| io("deadline", error))?;
            link.set_write_timeout(Some(deadline)).map_err(|error| io("deadline", error))?;
        }
        Ok(Self { rank, world_size, deadline, links, round: 0, broken: None })
    }

    fn exchange(&mut self, call: u64, op: u64, values: &mut [i64]) -> Result<(), Error> {
        if let Some(why) = &self.broken {
            return Err(Error::Internal(format!("socket group broken earlier: {why}")));
        }
        let result = self.exchange_once(call, op, values);
        if let Err(error) = &result {
            self.broken = Some(error.to_string());
        }
        self.round += 1;
        result
    }

    fn exchange_once(&mut self, call: u64, op: u64, values: &mut [i64]) -> Result<(), Error> {
        let header = [self.round, call, op, values.len() as u64];
        let (rank, deadline) = (self.rank, self.deadline);
        let lost = |peer: usize, error: std::io::Error| {
            if matches!(error.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                timeout(format!("socket group (rank {peer} did not answer)"), "collective", deadline)
            } else {
                Error::Internal(format!("socket group: rank {rank} lost rank {peer}: {error}"))
            }
        };
        if self.rank == 0 {
            let mut reduced = values.to_vec();
            let mut mismatch = None;
            for (index, link) in self.links.iter_mut().enumerate() {
                let peer = index + 1;
                let (theirs, their_values) = read_message(link).map_err(|error| lost(peer, error))?;
                if theirs != header {
                    mismatch.get_or_insert(format!(
                        "rank {peer} entered (round, call, op, length) {theirs:?} while rank 0 entered {header:?}"
                    ));
                    continue;
                }
                for (value, theirs) in reduced.iter_mut().zip(their_values) {
                    *value = match op {
                        1 => (*value).min(theirs),
                        2 => (*value).max(theirs),
                        _ => value.wrapping_add(theirs),
                    };
                }
            }
            let reply_header = if mismatch.is_some() { [self.round, MISMATCH, 0, 0] } else { header };
            let reply: &[i64] = if mismatch.is_some() { &[] } else { &reduced };
            for (index, link) in self.links.iter_mut().enumerate() {
                write_message(link, reply_header, reply).map_err(|error| lost(index + 1, error))?;
            }
            if let Some(reason) = mismatch {
                return Err(Error::CollectiveMismatch { rank: 0, reason });
            }
            values.copy_from_slice(&reduced);
        } else {
            let link = &mut self.links[0];
            write_message(link, header, values).map_err(|error| lost(0, error))?;
            let (reply, reduced) = read_message(link).map_err(|error| lost(0, error))?;
            if reply[1] == MISMATCH || reply != header || reduced.len() != values.len() {
                return Err(Error::CollectiveMismatch {
                    rank: self.rank,
                    reason: format!("the ranks entered different collectives at round {}", self.round),
                });
            }
            values.copy_from_slice(&reduced);
        }
        Ok(())
    }
}

fn write_message(link: &mut UnixStream, header: [u64; 4], values: &[i64]) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(32 + values.len() * 8);
    for word in header {
        bytes.extend_from_slice(&word.to_le_bytes());
    }
    for value in values {
        bytes.extend_from_slice(&value.to_le_bytes());
    }
    link.write_all(&bytes)
}

fn read_message(link: &mut UnixStream) -> std::io::Result<([u64; 4], Vec<i64>)> {
    let mut head = [0u8; 32];
    link.read_exact(&mut head)?;
    let word = |index: usize| u64::from_le_bytes(head[index * 8..index * 8 + 8].try_into().expect("8 bytes"));
    let header = [word(0), word(1), word(2), word(3)];
    let count = if header[1] == MISMATCH { 0 } else { header[3] as usize };
    if count > 1 << 20 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{count} values in one collective")));
    }
    let mut body = vec![0u8; count * 8];
    link.read_exact(&mut body)?;
    Ok((header, body.chunks_exact(8).map(|chunk| i64::from_le_bytes(chunk.try_into().expect("8 bytes"))).collect()))
}

impl Collective for SocketGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&mut self, values: &mut [i64], op: ReduceOp) -> Result<(), Error> {
        self.exchange(CALL_ALL_REDUCE, op_code(op), values)
    }

    fn barrier(&mut self) -> Result<(), Error> {
        self.exchange(CALL_BARRIER, 0, &mut [])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(world_size: usize, dir: &Path) -> Vec<std::thread::JoinHandle<Result<SocketGroup, Error>>> {
        let path = dir.join("group.sock");
        (0..world_size)
            .map(|rank| {
                let path = path.clone();
                std::thread::spawn(move || SocketGroup::join(rank, world_size, &path, Duration::from_secs(5)))
            })
            .collect()
    }

    #[test]
    fn ranks_reduce_as_the_operation_says_and_mismatches_are_errors_on_every_rank() {
        let dir = tempfile::tempdir().unwrap();
        let members: Vec<SocketGroup> =
            group(3, dir.path()).into_iter().map(|handle| handle.join().unwrap().unwrap()).collect();
        let handles: Vec<_> = members
            .into_iter()
            .map(|mut member| {
                std::thread::spawn(move || {
                    let rank = member.rank() as i64;
                    let mut values = [rank, 10 - rank, rank * rank];
                    member.all_reduce(&mut values, ReduceOp::Min).unwrap();
                    let mut sums = [rank, 1];
                    member.all_reduce(&mut sums, ReduceOp::Sum).unwrap();
                    let mut maxima = [rank];
                    member.all_reduce(&mut maxima, ReduceOp::Max).unwrap();
                    member.barrier().unwrap();
                    // rank 2 enters another length: every rank is told
                    let mut odd = vec![0; if rank == 2 { 2 } else { 1 }];
                    let mismatch = member.all_reduce(&mut odd, ReduceOp::Sum).unwrap_err();
                    (values, sums, maxima, mismatch)
                })
            })
            .collect();
        for handle in handles {
            let (values, sums, maxima, mismatch) = handle.join().unwrap();
            assert_eq!((values, sums, maxima), ([0, 8, 0], [3, 3], [2]));
            assert!(matches!(mismatch, Error::CollectiveMismatch { .. }), "{mismatch}");
        }
    }

    #[test]
    fn a_rank_that_never_joins_is_named_at_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let started = Instant::now();
        let error = SocketGroup::join(0, 3, &dir.path().join("group.sock"), Duration::from_millis(300)).err().unwrap();
        assert!(error.to_string().contains("[1, 2]"), "{error}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
