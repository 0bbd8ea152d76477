//! Page metadata in Redis, shared by every process and host that uses one 3FS file set: each operation on a batch
//! is one Lua script (one round trip), run atomically by Redis.
//!
//! A space's state lives under `hicache:3fs:{file}:` in six keys: `info` (page count, page size, pages never used,
//! LRU clock), `free` (freed pages, oldest first), `gen` (each page's generation), `keys` (key → `index:generation`),
//! `lru` (key → last use) and `reserved` (page → generation of its open reservation).
//!
//! Connections are pooled; each call (a new connection and its script loads included) ends within
//! [`RedisMetadata::with_timeout`]'s timeout (5 s by default), so a Redis that stops answering fails calls in bounded
//! time with an error naming its URL and how long it waited, and a
//! connection that failed is dropped and made again on the next call (service resumes when Redis is back). Scripts
//! are loaded on each new connection, so the operations themselves are one `EVALSHA` each.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hicache_core::Error;
use redis::{Connection, Value};

use super::{Located, PageMetadata, Reservation, Space, SpaceCounts};

macro_rules! script {
    ($name:literal) => {
        concat!(include_str!("lua/prelude.lua"), include_str!(concat!("lua/", $name, ".lua")))
    };
}

/// The operations, in [`Op`] order.
const SCRIPTS: [&str; 7] = [
    script!("reserve"),
    script!("confirm"),
    script!("locate"),
    script!("delete"),
    script!("clear"),
    script!("list"),
    script!("counts"),
];

#[derive(Clone, Copy)]
enum Op {
    Reserve,
    Confirm,
    Locate,
    Delete,
    Clear,
    List,
    Counts,
}

/// Page metadata in a Redis server.
pub struct RedisMetadata {
    url: String,
    client: redis::Client,
    timeout: Duration,
    hashes: Vec<String>,
    idle: Mutex<Vec<Connection>>,
    round_trips: AtomicU64,
}

impl RedisMetadata {
    /// Metadata in the Redis at `url` (`redis://host:port[/db]`, `rediss://…`, `unix:///path`); connects now, so a
    /// server that does not answer is an error here.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming `metadata_server_url` for a URL Redis cannot take; [`Error::Storage`] naming
    /// the URL when the server does not answer within the deadline.
    pub fn connect(url: &str) -> Result<Self, Error> {
        Self::with_timeout(url, Duration::from_secs(5))
    }

    /// As [`connect`](Self::connect), with `timeout` for connecting and for each call.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect).
    pub fn with_timeout(url: &str, timeout: Duration) -> Result<Self, Error> {
        let client = redis::Client::open(url).map_err(|error| Error::InvalidConfig {
            field: "metadata_server_url".into(),
            reason: format!("{url:?} is not a Redis URL ({error}); expected redis://host:port"),
        })?;
        let metadata = Self {
            url: url.to_owned(),
            client,
            timeout,
            hashes: SCRIPTS.iter().map(|source| redis::Script::new(source).get_hash().to_owned()).collect(),
            idle: Mutex::new(Vec::new()),
            round_trips: AtomicU64::new(0),
        };
        let connection = metadata.open_connection(Instant::now())?;
        metadata.give_back(connection);
        Ok(metadata)
    }

    /// The error of a call that began at `started`: a timeout says how long the call waited in all; any other
    /// failure is one line (a server that is not Redis answers with text the parser quotes over several lines).
    fn failure(&self, what: &str, error: &redis::RedisError, started: Instant) -> Error {
        if error.is_timeout() {
            return Error::Timeout {
                backend: format!("3fs metadata at {}", self.url),
                operation: "a metadata call",
                waited_ms: started.elapsed().as_millis() as u64,
            };
        }
        let text = error.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
        let hint = if matches!(error.kind(), redis::ErrorKind::Parse) {
            " (the server there does not speak Redis's protocol: is it a Redis server?)"
        } else {
            ""
        };
        Error::storage("3fs", format!("metadata at {}: {what}: {text}{hint}", self.url))
    }

    /// What is left of the timeout of a call that began at `started`, as a socket timeout (never zero, which means
    /// none).
    fn left(&self, started: Instant) -> Duration {
        self.timeout.saturating_sub(started.elapsed()).max(Duration::from_millis(1))
    }

    fn open_connection(&self, started: Instant) -> Result<Connection, Error> {
        let mut connection = self
            .client
            .get_connection_with_timeout(self.left(started))
            .map_err(|error| self.failure("cannot connect", &error, started))?;
        connection
            .set_write_timeout(Some(self.timeout))
            .map_err(|error| self.failure("write timeout", &error, started))?;
        for source in SCRIPTS {
            connection
                .set_read_timeout(Some(self.left(started)))
                .map_err(|error| self.failure("read timeout", &error, started))?;
            redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(source)
                .query::<String>(&mut connection)
                .map_err(|error| self.failure("loading its scripts", &error, started))?;
        }
        Ok(connection)
    }

    fn take(&self, started: Instant) -> Result<Connection, Error> {
        let idle = self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).pop();
        match idle {
            Some(connection) => Ok(connection),
            None => self.open_connection(started),
        }
    }

    fn give_back(&self, connection: Connection) {
        self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(connection);
    }

    /// Runs one command on a pooled connection, the whole call (a new connection included) within the timeout; a
    /// connection that failed (or lost its scripts) is dropped. The error of the call is returned with the time it
    /// began.
    fn query_raw(&self, command: &redis::Cmd) -> Result<Result<Value, (redis::RedisError, Instant)>, Error> {
        let started = Instant::now();
        let mut connection = self.take(started)?;
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let result = connection
            .set_read_timeout(Some(self.left(started)))
            .and_then(|()| command.query::<Value>(&mut connection));
        let healthy = match &result {
            Ok(_) => true,
            Err(error) => {
                !(error.is_io_error() || error.is_timeout() || error.is_connection_dropped())
                    && error.kind() != redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
            }
        };
        if healthy {
            self.give_back(connection);
        }
        Ok(result.map_err(|error| (error, started)))
    }

    fn query(&self, what: &str, command: &redis::Cmd) -> Result<Value, Error> {
        self.query_raw(command)?.map_err(|(error, started)| self.failure(what, &error, started))
    }

    fn run(&self, op: Op, space: &Space, args: &[&str]) -> Result<Value, Error> {
        let prefix = format!("hicache:3fs:{}:", space.id);
        let mut command = redis::cmd("EVALSHA");
        command.arg(&self.hashes[op as usize]).arg(6);
        for name in ["info", "free", "gen", "keys", "lru", "reserved"] {
            command.arg(format!("{prefix}{name}"));
        }
        command.arg(space.num_pages).arg(space.page_bytes);
        for arg in args {
            command.arg(*arg);
        }
        let what = match op {
            Op::Reserve => "reserve",
            Op::Confirm => "confirm",
            Op::Locate => "locate",
            Op::Delete => "delete",
            Op::Clear => "clear",
            Op::List => "list",
            Op::Counts => "counts",
        };
        self.query_raw(&command)?.map_err(|(error, started)| {
            let text = error.to_string();
            match text.find("HICACHE_MISMATCH") {
                Some(at) => {
                    let numbers: Vec<u64> =
                        text[at..].split(|c: char| !c.is_ascii_digit()).filter_map(|word| word.parse().ok()).collect();
                    match numbers.as_slice() {
                        [pages, bytes, ..] => super::mismatch(space, *pages, *bytes),
                        _ => self.failure(what, &error, started),
                    }
                }
                None => self.failure(what, &error, started),
            }
        })
    }

    fn bad_reply(&self, what: &str, value: &Value) -> Error {
        Error::storage("3fs", format!("metadata at {}: {what}: odd reply {value:?}", self.url))
    }

    /// Runs a per-key script (`op` over `keys`, none empty) whose reply is one text per key, each read by `parse`
    /// (`None`: not a reply the script gives).
    fn per_key<T>(
        &self,
        op: Op,
        what: &str,
        space: &Space,
        keys: &[String],
        parse: impl Fn(&str) -> Option<T>,
    ) -> Result<Vec<T>, Error> {
        let args: Vec<&str> = keys.iter().map(String::as_str).collect();
        let value = self.run(op, space, &args)?;
        let answers = texts(&value).filter(|answers| answers.len() == keys.len());
        let answers = answers.ok_or_else(|| self.bad_reply(what, &value))?;
        answers.iter().map(|answer| parse(answer).ok_or_else(|| self.bad_reply(what, &value))).collect()
    }
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(text) => Some(text.clone()),
        Value::Int(number) => Some(number.to_string()),
        _ => None,
    }
}

fn texts(value: &Value) -> Option<Vec<String>> {
    match value {
        Value::Array(items) => items.iter().map(text).collect(),
        _ => None,
    }
}

impl PageMetadata for RedisMetadata {
    fn describe(&self) -> String {
        self.url.clone()
    }

    fn reserve(&self, space: &Space, keys: &[String]) -> Result<Vec<Reservation>, Error> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.per_key(Op::Reserve, "reserve", space, keys, |answer| match answer {
            "present" => Some(Reservation::Present),
            "full" => Some(Reservation::Full),
            page => Located::parse(page).map(Reservation::Page),
        })
    }

    fn confirm(&self, space: &Space, written: &[(String, Located)], released: &[Located]) -> Result<(), Error> {
        if written.is_empty() && released.is_empty() {
            return Ok(());
        }
        let mut args = vec![written.len().to_string()];
        for (key, page) in written {
            args.push(key.clone());
            args.push(page.render());
        }
        args.extend(released.iter().map(Located::render));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.run(Op::Confirm, space, &args).map(drop)
    }

    fn locate(&self, space: &Space, keys: &[String]) -> Result<Vec<Option<Located>>, Error> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.per_key(Op::Locate, "locate", space, keys, |answer| match answer {
            "" => Some(None),
            page => Located::parse(page).map(Some),
        })
    }

    fn exists(&self, space: &Space, keys: &[String]) -> Result<Vec<bool>, Error> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut command = redis::cmd("HMGET");
        command.arg(format!("hicache:3fs:{}:keys", space.id));
        for key in keys {
            command.arg(key);
        }
        match self.query("exists", &command)? {
            Value::Array(items) if items.len() == keys.len() => {
                Ok(items.iter().map(|item| !matches!(item, Value::Nil)).collect())
            }
            other => Err(self.bad_reply("exists", &other)),
        }
    }

    fn delete(&self, space: &Space, keys: &[String]) -> Result<usize, Error> {
        if keys.is_empty() {
            return Ok(0);
        }
        let args: Vec<&str> = keys.iter().map(String::as_str).collect();
        match self.run(Op::Delete, space, &args)? {
            Value::Int(count) => Ok(count as usize),
            other => Err(self.bad_reply("delete", &other)),
        }
    }

    fn clear(&self, space: &Space, prefix: &str) -> Result<u64, Error> {
        match self.run(Op::Clear, space, &[prefix])? {
            Value::Int(count) => Ok(count as u64),
            other => Err(self.bad_reply("clear", &other)),
        }
    }

    fn list(&self, space: &Space, prefix: &str) -> Result<Vec<String>, Error> {
        let value = self.run(Op::List, space, &[prefix])?;
        texts(&value).ok_or_else(|| self.bad_reply("list", &value))
    }

    fn counts(&self, space: &Space) -> Result<SpaceCounts, Error> {
        match self.run(Op::Counts, space, &[])? {
            Value::Array(items) => match items.as_slice() {
                [Value::Int(stored), Value::Int(reserved)] => {
                    Ok(SpaceCounts { stored: *stored as u64, reserved: *reserved as u64 })
                }
                _ => Err(self.bad_reply("counts", &Value::Array(items))),
            },
            other => Err(self.bad_reply("counts", &other)),
        }
    }

    fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }
}
