//! Exit codes: 1 for runtime failures, 2 for usage and configuration errors.

use std::process::ExitCode;

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
pub(crate) fn code_for(error: &anyhow::Error) -> ExitCode {
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
    ExitCode::from(if usage { 2 } else { 1 })
}
