//! Which device a run trains on: `--device cpu|cuda|cuda:N|metal|metal:N` parsed into a candle [`Device`], the
//! default (the first CUDA device when this build has CUDA and one exists, else the CPU), and the device of
//! one rank of an MPI job (`cuda:(local rank mod device count)`). Thread ranks of one process share the
//! device they are given, which on CUDA allows one thread rank ([`DeviceSpec::check_thread_ranks`]). A CUDA device
//! is opened with the memory pool keeping its memory and cudarc's per-allocation events off (see
//! [`cuda_runtime_settings`]).

use candle_core::Device;

/// A device the user asked for, before it is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU.
    Cpu,
    /// A CUDA device: `Some(i)` is `cuda:i`; `None` (plain `cuda`) lets the launcher pick (device 0 for thread
    /// ranks, the local rank's device under MPI).
    Cuda(Option<usize>),
    /// A Metal device (`metal` is `metal:0`).
    Metal(usize),
}

/// A device that cannot be parsed or opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// Not one of the accepted spellings.
    #[error("--device {0:?} is not a device: use cpu, cuda, cuda:N (N = 0, 1, ...), metal or metal:N")]
    Parse(String),
    /// More than one thread rank on one CUDA device: candle gives each thread its own CUDA stream, cudarc
    /// orders work across streams only in its multi-stream mode, and thread ranks hand tensors to each other
    /// without a copy, so a rank could read another's pieces before they are written (a race).
    #[error(
        "--device {spec} with {ranks} thread ranks: thread ranks on one GPU race (each thread runs on its own \
         CUDA stream and tensors pass between them unordered) and buy nothing; run one rank per GPU: --sp 1 \
         --dp 1 here, or --launcher mpi (one process per GPU) for more ranks"
    )]
    ThreadRanksOnGpu {
        /// The device, as the user spelled it.
        spec: String,
        /// The thread ranks asked for.
        ranks: usize,
    },
    /// This build has CUDA but the machine shows no CUDA device (no GPU, no driver, or
    /// `CUDA_VISIBLE_DEVICES` hides them all).
    #[error(
        "--device {spec}: no CUDA device ({driver}): no NVIDIA GPU or driver here, or CUDA_VISIBLE_DEVICES \
         hides them (`nvidia-smi` lists what the driver sees); use --device cpu on this machine"
    )]
    NoCudaDevice {
        /// What was asked for, as the user spelled it.
        spec: String,
        /// The driver's answer (`cuInit` / `cuDeviceGetCount`).
        driver: String,
    },
    /// The device exists in name only for this build or machine.
    #[error("--device {spec}: {why}")]
    Open {
        /// What was asked for, as the user spelled it.
        spec: String,
        /// candle's reason, with what to do.
        why: String,
    },
}

impl std::str::FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, DeviceError> {
        let t = s.trim().to_ascii_lowercase();
        let ordinal = |rest: &str| rest.parse::<usize>().map_err(|_| DeviceError::Parse(s.to_string()));
        match t.as_str() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" | "gpu" => Ok(DeviceSpec::Cuda(None)),
            "metal" | "mps" => Ok(DeviceSpec::Metal(0)),
            _ => match t.split_once(':') {
                Some(("cuda", n)) => Ok(DeviceSpec::Cuda(Some(ordinal(n)?))),
                Some(("metal", n)) => Ok(DeviceSpec::Metal(ordinal(n)?)),
                _ => Err(DeviceError::Parse(s.to_string())),
            },
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(None) => write!(f, "cuda"),
            DeviceSpec::Cuda(Some(i)) => write!(f, "cuda:{i}"),
            DeviceSpec::Metal(i) => write!(f, "metal:{i}"),
        }
    }
}

impl DeviceSpec {
    /// The default: `cuda` when this build has candle's CUDA backend (feature `cuda`) and a CUDA device
    /// opens, else the CPU.
    pub fn default_for_build() -> Self {
        if candle_core::utils::cuda_is_available() && Device::new_cuda(0).is_ok() {
            DeviceSpec::Cuda(None)
        } else {
            DeviceSpec::Cpu
        }
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }

    /// Whether `ranks` thread ranks of one process may share this device: any number on the CPU (each runs its
    /// kernels on its share of the cores) and Metal, one on CUDA ([`DeviceError::ThreadRanksOnGpu`] otherwise,
    /// which names `--launcher mpi`). A pure function of the device kind and the count, checked before the
    /// device is opened.
    pub fn check_thread_ranks(&self, ranks: usize) -> Result<(), DeviceError> {
        match self {
            DeviceSpec::Cuda(_) if ranks > 1 => Err(DeviceError::ThreadRanksOnGpu { spec: self.to_string(), ranks }),
            _ => Ok(()),
        }
    }

    /// Opens the device for one rank. `local` is `(local rank, ranks on this node)` for one process per rank
    /// (MPI): plain `cuda` then takes `cuda:(local rank mod device count)`. Thread ranks pass `None` and
    /// share one device (on CUDA only one thread rank: see [`check_thread_ranks`](Self::check_thread_ranks)).
    pub fn open(&self, local: Option<(usize, usize)>) -> Result<Device, DeviceError> {
        let open_err = |why: String| DeviceError::Open { spec: self.to_string(), why };
        match *self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(ordinal) => {
                if !candle_core::utils::cuda_is_available() {
                    return Err(open_err(
                        "this binary was built without CUDA: rebuild with `--features cuda` (nvcc and the CUDA \
                         libraries must be installed; see README \"Building with CUDA\")"
                            .into(),
                    ));
                }
                let i = match (ordinal, local) {
                    (Some(i), _) => i,
                    (None, Some((local_rank, _))) => local_rank % cuda_device_count().max(1),
                    (None, None) => 0,
                };
                let count =
                    cuda_devices().map_err(|driver| DeviceError::NoCudaDevice { spec: self.to_string(), driver })?;
                if count == 0 {
                    let driver = "the driver lists 0 devices".to_string();
                    return Err(DeviceError::NoCudaDevice { spec: self.to_string(), driver });
                }
                if i >= count {
                    return Err(open_err(format!(
                        "this machine has {count} CUDA device(s), cuda:0 to cuda:{}: pick one of them",
                        count - 1
                    )));
                }
                let device = Device::new_cuda(i).map_err(|e| open_err(format!("opening cuda:{i}: {e}")))?;
                cuda_runtime_settings(&device).map_err(|e| open_err(format!("setting up cuda:{i}: {e}")))?;
                Ok(device)
            }
            DeviceSpec::Metal(i) => {
                if !candle_core::utils::metal_is_available() {
                    return Err(open_err(
                        "this binary was built without Metal: candle's `metal` feature is needed".into(),
                    ));
                }
                Device::new_metal(i).map_err(|e| open_err(format!("opening metal:{i}: {e}")))
            }
        }
    }
}

/// What [`DeviceSpec::open`] sets on a CUDA device it opens, for a run with one rank (one thread) per GPU:
///
/// - the default memory pool's release threshold to `u64::MAX`: cudarc allocates stream-ordered from the
///   device's default pool, whose threshold (0 by default) hands every freed byte back to the driver at each
///   synchronisation, so each step would map its memory again; the process keeps what it used instead (its
///   peak stays as [`device_memory_peak`] reports it);
/// - event tracking off: cudarc records two CUDA events for every allocation so that several streams can be
///   ordered, but it waits on them only in its multi-stream mode, which candle's device (one stream of the
///   opening thread) never enters; with one rank per GPU ([`DeviceSpec::check_thread_ranks`]) nothing is lost.
///   Only tensors made after this call are untracked. Skipped (tracking kept) if the context is in
///   multi-stream mode.
///
/// A driver without stream-ordered allocation has no pool: the threshold is then left alone.
#[cfg(feature = "cuda")]
fn cuda_runtime_settings(device: &Device) -> Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    let Device::Cuda(d) = device else {
        return Ok(());
    };
    let stream = d.cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread().map_err(|e| format!("binding the CUDA context: {e:?}"))?;
    if ctx.has_async_alloc() {
        let mut threshold = u64::MAX;
        // SAFETY: the device belongs to the live context bound above, and the attribute is a cuuint64_t.
        unsafe {
            let pool = result::device::get_default_mem_pool(ctx.cu_device())
                .map_err(|e| format!("cuDeviceGetDefaultMemPool: {e:?}"))?;
            let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
            result::mem_pool::set_attribute(pool, attr, (&mut threshold as *mut u64).cast())
                .map_err(|e| format!("raising the memory pool's release threshold: {e:?}"))?;
        }
    }
    if !ctx.is_in_multi_stream_mode() {
        // SAFETY: one stream: every tensor of this device is made and used on the stream of the one thread
        // rank that opened it (more thread ranks on a CUDA device are refused before it is opened), so the
        // events cudarc would record are never waited on (it orders streams only in multi-stream mode).
        unsafe { d.disable_event_tracking() };
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn cuda_runtime_settings(_device: &Device) -> Result<(), String> {
    Ok(())
}

/// The number of CUDA devices this process sees (0 without CUDA, or when the driver cannot be initialised).
pub fn cuda_device_count() -> usize {
    cuda_devices().unwrap_or(0)
}

/// The number of CUDA devices, or the driver's error (`cuInit`, `cuDeviceGetCount`) when it cannot say.
#[cfg(feature = "cuda")]
fn cuda_devices() -> Result<usize, String> {
    candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| format!("{e:?}"))
}

/// No CUDA in this build: no devices.
#[cfg(not(feature = "cuda"))]
fn cuda_devices() -> Result<usize, String> {
    Ok(0)
}

/// The peak of device memory in use on `device` so far, bytes: on CUDA the high-water mark of the device's
/// default memory pool (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`), which every allocation candle makes comes from
/// (cudarc allocates stream-ordered from it); the CUDA context, cuBLAS's workspace and other processes are not
/// in it. Shared by the thread ranks on one GPU, as the process heap is. `None` on the CPU and Metal, and on a
/// driver without stream-ordered allocation.
pub fn device_memory_peak(device: &Device) -> Option<u64> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => cuda_pool_peak(d),
        _ => None,
    }
}

#[cfg(feature = "cuda")]
fn cuda_pool_peak(d: &candle_core::CudaDevice) -> Option<u64> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    let stream = d.cuda_stream();
    let ctx = stream.context();
    if !ctx.has_async_alloc() {
        return None;
    }
    ctx.bind_to_thread().ok()?;
    let mut high: u64 = 0;
    // SAFETY: the device comes from a live context (bound above) and the attribute is a u64 (cuuint64_t).
    unsafe {
        let pool = result::device::get_default_mem_pool(ctx.cu_device()).ok()?;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        result::mem_pool::get_attribute(pool, attr, (&mut high as *mut u64).cast()).ok()?;
    }
    Some(high)
}

/// The local rank of this process among the ranks of its node under mpirun (OpenMPI's
/// `OMPI_COMM_WORLD_LOCAL_RANK`, MPICH's `MPI_LOCALRANKID`, Slurm's `SLURM_LOCALID`), else `global_rank`.
pub fn local_rank(global_rank: usize) -> usize {
    launcher_number(&["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"]).unwrap_or(global_rank)
}

/// How many ranks of the job run on this node under mpirun (OpenMPI's `OMPI_COMM_WORLD_LOCAL_SIZE`, MPICH's
/// `MPI_LOCALNRANKS`), if the launcher says.
pub fn local_size() -> Option<usize> {
    launcher_number(&["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"])
}

/// The first of the launcher's variables `names` that is set to a number.
fn launcher_number(names: &[&str]) -> Option<usize> {
    names.iter().find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_spelling_and_names_a_bad_one() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("CUDA".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(None));
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(Some(3)));
        assert_eq!("metal".parse::<DeviceSpec>().unwrap(), DeviceSpec::Metal(0));
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap().to_string(), "cuda:3");
        for bad in ["gpu:x", "cuda:", "tpu", "cuda:-1"] {
            let e = bad.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("cuda:N"), "{e}");
        }
    }

    #[test]
    fn one_thread_rank_per_gpu_and_any_number_on_the_cpu() {
        for ranks in [1, 2, 8] {
            DeviceSpec::Cpu.check_thread_ranks(ranks).unwrap();
            DeviceSpec::Metal(0).check_thread_ranks(ranks).unwrap();
        }
        DeviceSpec::Cuda(None).check_thread_ranks(1).unwrap();
        DeviceSpec::Cuda(Some(1)).check_thread_ranks(1).unwrap();
        for (spec, ranks) in [(DeviceSpec::Cuda(None), 2), (DeviceSpec::Cuda(Some(1)), 4)] {
            let e = spec.check_thread_ranks(ranks).unwrap_err();
            assert!(matches!(e, DeviceError::ThreadRanksOnGpu { .. }), "{e:?}");
            let e = e.to_string();
            assert!(e.contains("--launcher mpi") && e.contains(&spec.to_string()), "{e}");
            assert!(e.contains(&format!("{ranks} thread ranks")), "{e}");
        }
    }

    #[test]
    fn cpu_opens_and_cuda_without_the_feature_says_how_to_build() {
        assert!(DeviceSpec::Cpu.open(None).unwrap().is_cpu());
        if !candle_core::utils::cuda_is_available() {
            let e = DeviceSpec::Cuda(Some(1)).open(Some((1, 2))).unwrap_err().to_string();
            assert!(e.contains("--features cuda") && e.contains("cuda:1"), "{e}");
            assert_eq!(DeviceSpec::default_for_build(), DeviceSpec::Cpu);
        }
    }
}
