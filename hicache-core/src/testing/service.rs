//! A service a storage backend's tests talk to (a Redis, a Mooncake master), run on loopback for one test and stopped
//! by its PID: when dropped, and by the kernel when the thread that started it ends (`PR_SET_PDEATHSIG`), so a test
//! that dies without dropping it leaves nothing behind.
#![expect(unsafe_code, reason = "the child asks the kernel for a parent-death signal before it runs the service")]

use std::net::TcpListener;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (free when asked; a service that finds it taken fails to start and is tried again).
///
/// # Panics
///
/// When no port can be bound at all.
pub fn free_loopback_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|listener| listener.local_addr()).expect("a free loopback port").port()
}

/// A running service process.
#[derive(Debug)]
pub struct LoopbackService {
    child: Child,
}

impl LoopbackService {
    /// Starts `command` (its standard streams closed) and waits up to `deadline` for `answers` to say it serves.
    /// `Ok(None)` when it exits first or never answers (it is then killed): most likely a port taken between
    /// choosing and binding it, so the caller tries other ports.
    ///
    /// # Errors
    ///
    /// The spawn's error: the program is missing or cannot run.
    pub fn start(
        mut command: Command,
        deadline: Duration,
        mut answers: impl FnMut() -> bool,
    ) -> std::io::Result<Option<Self>> {
        command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to kill the child when the thread that started
        // it ends.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut service = Self { child: command.spawn()? };
        let until = Instant::now() + deadline;
        while Instant::now() < until {
            if service.child.try_wait().ok().flatten().is_some() {
                return Ok(None);
            }
            if answers() {
                return Ok(Some(service));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(None)
    }

    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for LoopbackService {
    fn drop(&mut self) {
        // SIGKILL, then reap it
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_that_answers_is_kept_and_killed_by_its_pid_when_dropped() {
        let mut polls = 0;
        let mut command = Command::new("sleep");
        command.arg("30");
        let service = LoopbackService::start(command, Duration::from_secs(5), || {
            polls += 1;
            polls == 3
        })
        .unwrap()
        .expect("answered at the third poll");
        let proc = format!("/proc/{}", service.pid());
        assert!(std::path::Path::new(&proc).exists());
        drop(service);
        assert!(!std::path::Path::new(&proc).exists(), "killed and reaped on drop");
    }

    #[test]
    fn one_that_exits_or_never_answers_is_none_and_a_missing_program_an_error() {
        let started = LoopbackService::start(Command::new("true"), Duration::from_secs(5), || false).unwrap();
        assert!(started.is_none(), "exited before answering");
        let mut command = Command::new("sleep");
        command.arg("30");
        let silent = LoopbackService::start(command, Duration::from_millis(100), || false).unwrap();
        assert!(silent.is_none(), "never answered within the deadline");
        assert!(LoopbackService::start(Command::new("/nonexistent/service"), Duration::ZERO, || true).is_err());
        assert_ne!(free_loopback_port(), 0);
    }
}
