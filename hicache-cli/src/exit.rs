//! Exit codes: 1 for runtime failures, 2 for usage and configuration errors.

use hicache_core::Error;

/// A usage error found by a command itself (clap reports its own with code 2).
#[derive(Debug)]
pub(crate) struct Usage(pub(crate) String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// 2 when the error is the user's input (bad token, key, argument or config, missing input), 1 otherwise.
pub(crate) fn code_for(error: &anyhow::Error) -> u8 {
    let usage = error.chain().any(|cause| {
        cause.is::<Usage>()
            || matches!(
                cause.downcast_ref::<Error>(),
                Some(
                    Error::InvalidToken { .. }
                        | Error::InvalidTokenList { .. }
                        | Error::InvalidKey { .. }
                        | Error::PartialPage { .. }
                        | Error::InvalidArgument { .. }
                        | Error::InvalidConfig { .. }
                )
            )
    });
    if usage { 2 } else { 1 }
}

/// Ends the process with `code` once its output is flushed, without running the libraries' exit-time destructors.
/// By then everything hicache made is dropped; what is left is a storage library's own teardown, which can wait for
/// minutes on a service that is gone (Mooncake's client unmounts its segment at a master that was stopped, retrying
/// every 30 s).
pub(crate) fn now(code: u8) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit(2) ends the process at once; nothing of this process runs after it.
    unsafe { libc::_exit(i32::from(code)) }
}
