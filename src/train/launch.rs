//! Launching ranks: which back end carries a run's collectives ([`Carrier`]) and the line that says so, and the
//! group an MPI rank trains with (`over_mpi`, feature `mpi`: NCCL over MPI for CUDA in a build with `nccl`).
//!
//! - Thread ranks (`--launcher threads`): one process, the thread back end; the ranks share one device, and
//!   tensors pass between them in memory without a copy (on a shared GPU they stay on it). NCCL is never used
//!   here, even in a build with `nccl`: it needs one GPU per rank, and thread ranks share one.
//! - One process per rank (`--launcher mpi`): MPI, with tensors through host memory (CUDA tensors are copied
//!   to the host, sent, and copied back); or, in a build with `nccl` when the device is CUDA, an `NcclGroup`
//!   bootstrapped over the MPI group (`NcclId::share`), so the collectives of CUDA tensors go GPU to GPU. Every
//!   process then needs a GPU of its own (`cuda:(local rank mod device count)` gives one when a node has at
//!   least as many GPUs as processes). A rank that fails still tells the others through MPI
//!   (`ProcessGroup::abort` on the MPI group): ranks waiting inside NCCL do not take MPI's notice, so the
//!   failing process ends the job with `MPI_Abort` after MPI's grace period (5 s).
//!
//! The NCCL path is type-checked only (`scripts/cuda_typecheck.sh`, features `mpi,cuda,nccl`): it has not run on
//! GPUs (README, "Building with CUDA").

use candle_core::Device;
#[cfg(feature = "mpi")]
use {
    super::error::Result,
    autosp_core::comm::ProcessGroup,
    std::{sync::Arc, time::Duration},
};

/// The back end that carries a rank's collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carrier {
    /// Thread ranks of one process sharing one device.
    Threads,
    /// MPI, one process per rank; tensors through host memory.
    Mpi,
    /// NCCL, one GPU per process, bootstrapped over MPI.
    Nccl,
}

impl Carrier {
    /// The report line for P ranks computing on `device` (this process's device).
    pub fn describe(self, device: &Device) -> String {
        let on = format!("{:?}", device.location());
        match self {
            Carrier::Threads if device.is_cuda() => format!(
                "collectives: thread ranks of this process sharing {on}: tensors pass between the threads in GPU \
                 memory without a copy (NCCL is not used: it needs one GPU per rank)"
            ),
            Carrier::Threads => "collectives: thread ranks of this process: tensors pass between the threads in \
                                 memory without a copy"
                .to_string(),
            Carrier::Mpi if device.is_cuda() => format!(
                "collectives: MPI, one process per rank on {on}: CUDA tensors go through host memory (copied to \
                 the host, sent, copied back){}",
                if cfg!(feature = "nccl") { "" } else { "; build with `--features nccl` for GPU-to-GPU collectives" }
            ),
            Carrier::Mpi => "collectives: MPI, one process per rank: tensors go through host memory".to_string(),
            Carrier::Nccl => format!(
                "collectives: NCCL (bootstrapped over MPI), one GPU per process, this one {on}: CUDA tensors go \
                 GPU to GPU"
            ),
        }
    }
}

/// The group rank `mpi.rank()` trains with: an NCCL group over `device` when this build has `nccl` and
/// `device` is CUDA (every rank of `mpi` calls this, with the same kind of device), else `mpi` itself.
/// Collective over `mpi`: the NCCL id is shared over it, then `ncclCommInitRank` waits for every rank (no
/// timeout: see `autosp-core/src/comm/nccl.rs`); `timeout` bounds every later NCCL call.
#[cfg(feature = "mpi")]
pub fn over_mpi(
    mpi: &Arc<dyn ProcessGroup>,
    device: &Device,
    timeout: Duration,
) -> Result<(Arc<dyn ProcessGroup>, Carrier)> {
    #[cfg(feature = "nccl")]
    if device.is_cuda() {
        use super::error::TrainError;
        use autosp_core::comm::{NcclGroup, NcclId};
        let (rank, size) = (mpi.rank(), mpi.size());
        let id = NcclId::share(&**mpi, 0).map_err(|cause| TrainError::Comm {
            what: "sharing the NCCL id over MPI".into(),
            cause: Box::new(cause),
        })?;
        let group = NcclGroup::init(device, rank, size, id, timeout).map_err(|cause| TrainError::Comm {
            what: format!(
                "starting NCCL on {:?} for rank {rank} of {size}; NCCL needs one GPU per process: with more \
                 processes on a node than GPUs, start fewer per node, or use a build without `nccl` (MPI then \
                 carries the collectives through the host)",
                device.location()
            ),
            cause: Box::new(cause),
        })?;
        return Ok((Arc::new(group), Carrier::Nccl));
    }
    let _ = (device, timeout);
    Ok((mpi.clone(), Carrier::Mpi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_the_back_end() {
        let threads = Carrier::Threads.describe(&Device::Cpu);
        assert!(threads.contains("thread ranks") && !threads.contains("NCCL"), "{threads}");
        let mpi = Carrier::Mpi.describe(&Device::Cpu);
        assert!(mpi.contains("MPI") && mpi.contains("host memory"), "{mpi}");
    }
}
