//! A rank's own failure told to the other ranks of its job, for the library's collective entry points
//! (`Job::run_rank`, `Trainer::run`, `Compiled::generate`): without it a rank that returns an error leaves its
//! peers waiting in their next collective until the group's timeout (minutes), where the command line and
//! `run_ranks_fallible` tell them at once.

use std::error::Error;

use autosp_core::comm::ProcessGroup;

/// `result`, after telling every rank of `group`'s job that this rank failed when it is an error
/// ([`ProcessGroup::abort`] with the error and its causes), so that the other ranks' collectives fail within
/// moments with `CommError::PeerFailed` naming this rank and its error instead of waiting for the timeout. The
/// group is unusable after that, as after any failed collective. An error that itself came from a peer's
/// failure is told as well, as the command line does: the back ends keep the first failure they heard of (MPI
/// sends no second notice; thread ranks report the first rank that aborted), so it changes nothing.
pub(crate) fn abort_on_error<T, E: Error>(group: &dyn ProcessGroup, result: Result<T, E>) -> Result<T, E> {
    if let Err(e) = &result {
        group.abort(&with_causes(e));
    }
    result
}

/// `e` and its causes, `: `-separated (as anyhow's `{:#}` prints them).
fn with_causes(e: &dyn Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut cause = e.source();
    while let Some(c) = cause {
        let line = c.to_string();
        // A transparent wrapper repeats its source's message; print it once.
        if parts.last() != Some(&line) {
            parts.push(line);
        }
        cause = c.source();
    }
    parts.join(": ")
}
