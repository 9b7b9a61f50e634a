//! A rank's own failure told to the other ranks of its job, with the error's causes, for collective entry
//! points (autosp's `Job::run_rank`, `Trainer::run`, `generate`, the command line): without it a rank that
//! returns an error leaves its peers waiting in their next collective until the group's timeout (minutes).

use std::error::Error;

use super::ProcessGroup;

/// `result`, after telling every rank of `group`'s job that this rank failed when it is an error
/// ([`ProcessGroup::abort`] with the error and its causes), so that the other ranks' collectives fail within
/// moments with `CommError::PeerFailed` naming this rank and its error instead of waiting for the timeout. The
/// group is unusable after that, as after any failed collective. An error that itself came from a peer's
/// failure is told as well, as the command line does: the back ends keep the first failure they heard of (MPI
/// sends no second notice; thread ranks report the first rank that aborted), so it changes nothing.
pub fn abort_on_error<T, E: Error>(group: &dyn ProcessGroup, result: Result<T, E>) -> Result<T, E> {
    if let Err(e) = &result {
        group.abort(&with_causes(e));
    }
    result
}

/// `e` and its causes, `: `-separated (as anyhow's `{:#}` prints them): the message [`abort_on_error`] sends.
pub fn with_causes(e: &dyn Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut cause = e.source();
    while let Some(c) = cause {
        let line = c.to_string();
        // A transparent wrapper repeats its source's message, and `#[error("what: {0}")]` ends with it: print
        // it once.
        if !parts.last().is_some_and(|p| p.ends_with(&line)) {
            parts.push(line);
        }
        cause = c.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("step 3 failed")]
        Step(#[source] Inner),
        #[error(transparent)]
        Through(Inner),
        #[error("saving: {0}")]
        Saving(#[from] Inner),
    }

    #[derive(Debug, thiserror::Error)]
    #[error("reading shard 1")]
    struct Inner(#[source] std::io::Error);

    #[test]
    fn causes_are_told_once_each() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        assert_eq!(with_causes(&Outer::Step(Inner(io()))), "step 3 failed: reading shard 1: no such file");
        // A transparent wrapper prints its source's message: it is not repeated.
        assert_eq!(with_causes(&Outer::Through(Inner(io()))), "reading shard 1: no such file");
        // A message that already ends with its source's does not repeat it.
        assert_eq!(with_causes(&Outer::Saving(Inner(io()))), "saving: reading shard 1: no such file");
    }
}
