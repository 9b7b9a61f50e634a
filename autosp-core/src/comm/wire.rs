//! The byte format tensors travel in between processes (MPI back end): a header the receiver needs
//! because it cannot know the shape or dtype in advance, then the elements in little-endian order.
//!
//! A tensor travels as two messages, so that the receiver can allocate the tensor's own storage from the first
//! and take the elements straight into it (no received byte buffer, no decoding copy):
//! - the header: `[present: u8][dtype code: u8][ndim: u8][kind: u8][4 zero bytes][call: u64][ndim x u64
//!   dims]`; `kind` and `call` are the message's [`Stamp`] (the operation, `Collective::index() + 1`, and its
//!   sequence number); `present = 0` (16 bytes, no dims) carries no tensor, only the stamp, and nothing follows;
//! - the elements, row-major, little-endian (the host's own order: they are received in place).
//!
//! MPI delivers two messages from one sender with one tag in the order they were sent. Supported dtypes: u8,
//! u32, i16, i32, i64, bf16, f16, f32, f64.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cpu_backend::CpuDevice;
use candle_core::{CpuStorage, DType, Device, Shape, Storage, Tensor};

use super::stamp::Stamp;

/// Why bytes could not be turned into a tensor or back.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("dtype {0:?} cannot be sent between processes; convert it to f32, bf16 or an integer type first")]
    UnsupportedDtype(DType),
    #[error("tensor of rank {0} cannot be sent between processes: at most 255 dimensions")]
    TooManyDims(usize),
    #[error("malformed tensor message of {len} bytes: {detail}")]
    Malformed { len: usize, detail: String },
    #[error("tensor operation failed while (de)serialising: {0}")]
    Candle(#[from] candle_core::Error),
}

const HEADER: usize = 16;

pub(crate) fn dtype_code(dtype: DType) -> Result<u8, WireError> {
    Ok(match dtype {
        DType::U8 => 1,
        DType::U32 => 2,
        DType::I16 => 3,
        DType::I32 => 4,
        DType::I64 => 5,
        DType::BF16 => 6,
        DType::F16 => 7,
        DType::F32 => 8,
        DType::F64 => 9,
        other => return Err(WireError::UnsupportedDtype(other)),
    })
}

pub(crate) fn code_dtype(code: u8) -> Option<DType> {
    Some(match code {
        1 => DType::U8,
        2 => DType::U32,
        3 => DType::I16,
        4 => DType::I32,
        5 => DType::I64,
        6 => DType::BF16,
        7 => DType::F16,
        8 => DType::F32,
        9 => DType::F64,
        _ => return None,
    })
}

/// The header bytes of a message: presence, dtype code, rank, the stamp.
fn header(present: bool, code: u8, ndim: u8, stamp: Stamp) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&[u8::from(present), code, ndim, stamp.kind_code()]);
    h[8..].copy_from_slice(&stamp.call.to_le_bytes());
    h
}

/// Why the elements travel in place: a little-endian host's memory already holds them in wire order.
#[cfg(not(target_endian = "little"))]
compile_error!("the MPI wire format receives tensor elements in place, which needs a little-endian host");

/// The element types the wire carries: plain numbers, no padding, every bit pattern valid, so their memory is
/// their little-endian bytes on this host.
///
/// # Safety
/// An implementor has no padding and every bit pattern is a valid value: the byte views rely on it.
unsafe trait Plain: Copy {}
// SAFETY: plain integers and IEEE floats (`half`'s are `repr(transparent)` over u16).
unsafe impl Plain for u8 {}
// SAFETY: as above.
unsafe impl Plain for u32 {}
// SAFETY: as above.
unsafe impl Plain for i16 {}
// SAFETY: as above.
unsafe impl Plain for i32 {}
// SAFETY: as above.
unsafe impl Plain for i64 {}
// SAFETY: as above.
unsafe impl Plain for half::bf16 {}
// SAFETY: as above.
unsafe impl Plain for half::f16 {}
// SAFETY: as above.
unsafe impl Plain for f32 {}
// SAFETY: as above.
unsafe impl Plain for f64 {}

/// `v`'s memory as bytes.
fn as_bytes<T: Plain>(v: &[T]) -> &[u8] {
    // SAFETY: `T: Plain` has no padding; the bytes cover exactly `v` for as long as `v` is borrowed.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// `v`'s memory as bytes to write into.
fn as_bytes_mut<T: Plain>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: `T: Plain` has no padding and every bit pattern is a valid `T`; the bytes cover exactly `v` for
    // as long as `v` is borrowed mutably.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// `$body` with `$v` bound to the vector inside `$storage` (a `CpuStorage`, by value or reference) when it is
/// one of the dtypes the wire carries, else `$other`.
macro_rules! on_wire_storage {
    ($storage:expr, $v:ident => $body:expr, _ => $other:expr) => {
        match $storage {
            CpuStorage::U8($v) => $body,
            CpuStorage::U32($v) => $body,
            CpuStorage::I16($v) => $body,
            CpuStorage::I32($v) => $body,
            CpuStorage::I64($v) => $body,
            CpuStorage::BF16($v) => $body,
            CpuStorage::F16($v) => $body,
            CpuStorage::F32($v) => $body,
            CpuStorage::F64($v) => $body,
            _ => $other,
        }
    };
}

/// The header message of `t` (`None`: an empty marker) stamped with `stamp`: what the receiver needs to
/// allocate the tensor before its elements arrive in a second message ([`elements`]).
pub fn header_of(t: Option<&Tensor>, stamp: Stamp) -> Result<Vec<u8>, WireError> {
    let Some(t) = t else {
        return Ok(header(false, 0, 0, stamp).to_vec());
    };
    let code = dtype_code(t.dtype())?;
    if t.rank() > 255 {
        return Err(WireError::TooManyDims(t.rank()));
    }
    let mut out = Vec::with_capacity(HEADER + 8 * t.rank());
    out.extend_from_slice(&header(true, code, t.rank() as u8, stamp));
    for &d in t.dims() {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    Ok(out)
}

/// The elements message of `t` (any layout, any device): its elements in row-major, little-endian order.
/// A contiguous CPU tensor is copied once, straight from its storage.
pub fn elements(t: &Tensor) -> Result<Vec<u8>, WireError> {
    dtype_code(t.dtype())?;
    let t = t.contiguous()?;
    if let (Storage::Cpu(cpu), Some((start, end))) = (&*t.storage_and_layout().0, t.layout().contiguous_offsets()) {
        return on_wire_storage!(cpu, v => Ok(as_bytes(&v[start..end]).to_vec()), _ => {
            Err(WireError::UnsupportedDtype(t.dtype()))
        });
    }
    // Other devices: to the host first.
    elements(&t.to_device(&Device::Cpu)?)
}

/// A parsed header message: the stamp, and the dtype and dims of the tensor whose elements follow (`None`:
/// an empty marker, nothing follows).
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub stamp: Stamp,
    pub tensor: Option<(DType, Vec<usize>)>,
}

/// Parses a header message made by [`header_of`].
pub fn parse_header(bytes: &[u8]) -> Result<Header, WireError> {
    let bad = |detail: String| WireError::Malformed { len: bytes.len(), detail };
    if bytes.len() < HEADER {
        return Err(bad(format!("shorter than the {HEADER}-byte header")));
    }
    let collective =
        Stamp::kind_from_code(bytes[3] as u64).ok_or_else(|| bad(format!("unknown operation code {}", bytes[3])))?;
    let stamp = Stamp::new(collective, u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")));
    match bytes[0] {
        0 => return Ok(Header { stamp, tensor: None }),
        1 => {}
        b => return Err(bad(format!("first byte {b} is neither 0 (none) nor 1 (tensor)"))),
    }
    let dtype = code_dtype(bytes[1]).ok_or_else(|| bad(format!("unknown dtype code {}", bytes[1])))?;
    let ndim = bytes[2] as usize;
    if bytes.len() != HEADER + 8 * ndim {
        return Err(bad(format!("a header of {ndim} dimensions is {} bytes", HEADER + 8 * ndim)));
    }
    let dims: Vec<usize> = bytes[HEADER..]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")) as usize)
        .collect();
    // No sender makes a message past MPI's 2 GiB count limit: a larger announced tensor is a damaged header,
    // refused before anything is allocated for it.
    let bytes_announced = dims.iter().try_fold(dtype.size_in_bytes(), |n, &d| n.checked_mul(d));
    if bytes_announced.is_none_or(|n| n > i32::MAX as usize) {
        return Err(bad(format!("{dims:?} of {dtype:?} is past the 2 GiB a message can carry")));
    }
    Ok(Header { stamp, tensor: Some((dtype, dims)) })
}

/// Host storage for a tensor whose elements are about to arrive: the receiver writes the elements message
/// straight into it ([`bytes_mut`](Self::bytes_mut)), and it becomes the tensor with no copy on the CPU.
pub struct Inbox {
    storage: CpuStorage,
    dims: Vec<usize>,
}

impl Inbox {
    /// Zeroed storage for a `dims`-shaped tensor of `dtype` (one the wire carries).
    pub fn new(dtype: DType, dims: &[usize]) -> Result<Self, WireError> {
        dtype_code(dtype)?;
        let storage = CpuDevice.zeros_impl(&Shape::from(dims), dtype)?;
        Ok(Self { storage, dims: dims.to_vec() })
    }

    /// The storage as bytes, to receive the elements message into (little-endian: in place).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        on_wire_storage!(&mut self.storage, v => as_bytes_mut(v), _ => unreachable!("Inbox::new makes only wire dtypes"))
    }

    /// How many bytes the elements message must have.
    pub fn byte_len(&self) -> usize {
        self.dims.iter().product::<usize>() * self.storage.dtype().size_in_bytes()
    }

    /// The received tensor, on `device` (the CPU keeps the storage itself; other devices upload it).
    pub fn into_tensor(self, device: &Device) -> Result<Tensor, WireError> {
        let dims = self.dims;
        let t = on_wire_storage!(self.storage, v => Tensor::from_vec(v, dims, &Device::Cpu)?, _ => {
            unreachable!("Inbox::new makes only wire dtypes")
        });
        Ok(if device.is_cpu() { t } else { t.to_device(device)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Collective;

    const STAMP: Stamp = Stamp { collective: Collective::AllGather, call: 0x0102_0304_0506 };

    /// What a receiver does: parse the header, allocate, take the elements in place.
    fn receive(header: &[u8], elements: &[u8]) -> Result<(Stamp, Option<Tensor>), WireError> {
        let h = parse_header(header)?;
        let Some((dtype, dims)) = h.tensor else {
            return Ok((h.stamp, None));
        };
        let mut inbox = Inbox::new(dtype, &dims)?;
        assert_eq!(inbox.byte_len(), elements.len(), "elements message length");
        inbox.bytes_mut().copy_from_slice(elements);
        Ok((h.stamp, Some(inbox.into_tensor(&Device::Cpu)?)))
    }

    fn round_trip(t: &Tensor) -> Tensor {
        let (stamp, back) = receive(&header_of(Some(t), STAMP).unwrap(), &elements(t).unwrap()).unwrap();
        assert_eq!(stamp, STAMP);
        back.unwrap()
    }

    #[test]
    fn every_supported_dtype_round_trips_bit_for_bit() -> candle_core::Result<()> {
        let base = Tensor::arange(0f32, 24., &Device::Cpu)?.affine(0.37, -3.1)?.reshape((2, 3, 4))?;
        for dtype in
            [DType::U8, DType::U32, DType::I16, DType::I32, DType::I64, DType::BF16, DType::F16, DType::F32, DType::F64]
        {
            let t = if dtype.is_int() { base.abs()?.to_dtype(dtype)? } else { base.to_dtype(dtype)? };
            let back = round_trip(&t);
            assert_eq!(back.dtype(), dtype);
            assert_eq!(back.dims(), &[2, 3, 4]);
            assert_eq!(elements(&back).unwrap(), elements(&t).unwrap(), "{dtype:?}");
        }
        // The elements are little-endian, whatever the host.
        let t = Tensor::new(&[1.5f32, -2.0], &Device::Cpu)?;
        let want: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(elements(&t).unwrap(), want);
        Ok(())
    }

    #[test]
    fn non_contiguous_scalar_and_empty_tensors() -> candle_core::Result<()> {
        let t = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((3, 4))?.t()?;
        assert!(!t.is_contiguous());
        let back = round_trip(&t);
        assert_eq!(back.to_vec2::<f32>()?, t.to_vec2::<f32>()?);
        let s = Tensor::new(7.5f64, &Device::Cpu)?;
        assert_eq!(round_trip(&s).to_scalar::<f64>()?, 7.5);
        // A contiguous view that starts inside its storage: only the view's elements travel, in order.
        let rows = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((3, 4))?.narrow(0, 1, 2)?;
        let want: Vec<u8> = (4..12).flat_map(|v| (v as f32).to_le_bytes()).collect();
        assert_eq!(elements(&rows).unwrap(), want);
        assert_eq!(round_trip(&rows).to_vec2::<f32>()?, rows.to_vec2::<f32>()?);
        let e = Tensor::zeros((0, 5), DType::F32, &Device::Cpu)?;
        assert!(elements(&e).unwrap().is_empty());
        assert_eq!(round_trip(&e).dims(), &[0, 5]);
        let marker = Stamp::new(Collective::Barrier, 7);
        let (stamp, none) = receive(&header_of(None, marker).unwrap(), &[]).unwrap();
        assert!(stamp == marker && none.is_none());
        Ok(())
    }

    #[test]
    fn malformed_headers_are_errors() {
        let t = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
        let mut bytes = header_of(Some(&t), STAMP).unwrap();
        bytes.pop();
        let err = parse_header(&bytes).unwrap_err().to_string();
        assert!(err.contains("a header of 1 dimensions is 24 bytes"), "{err}");
        let mut header = header_of(None, STAMP).unwrap();
        header[0] = 1;
        header[1] = 42;
        assert!(parse_header(&header).unwrap_err().to_string().contains("dtype code 42"));
        header[3] = 0;
        assert!(parse_header(&header).unwrap_err().to_string().contains("operation code 0"));
        header[3] = 1;
        header[0] = 2;
        assert!(parse_header(&header).unwrap_err().to_string().contains("first byte 2"));
        assert!(parse_header(&[3]).is_err());
        // A header announcing more than a message can carry (or more than usize holds) is refused.
        for dims in [[1u64 << 40, 4], [u64::MAX, 2]] {
            let mut h = header_of(None, STAMP).unwrap();
            h[..3].copy_from_slice(&[1, dtype_code(DType::F32).unwrap(), 2]);
            h.extend(dims.iter().flat_map(|d| d.to_le_bytes()));
            assert!(parse_header(&h).unwrap_err().to_string().contains("past the 2 GiB"), "{dims:?}");
        }
        assert!(matches!(Inbox::new(DType::F8E4M3, &[2]), Err(WireError::UnsupportedDtype(_))));
        assert!(matches!(
            header_of(Some(&t.to_dtype(DType::F8E4M3).unwrap()), STAMP),
            Err(WireError::UnsupportedDtype(_))
        ));
    }
}
