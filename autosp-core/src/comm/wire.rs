//! The byte format tensors travel in between processes (MPI back end): a header the receiver needs
//! because it cannot know the shape or dtype in advance, then the elements in little-endian order.
//!
//! Layout: `[present: u8][dtype code: u8][ndim: u8][kind: u8][4 zero bytes][call: u64][ndim x u64 dims]
//! [elements]`; `kind` and `call` are the message's [`Stamp`] (the operation, `Collective::index() + 1`, and
//! its sequence number); `present = 0` (a 16-byte message) carries no tensor, only the stamp. Supported dtypes: u8, u32, i16, i32, i64, bf16,
//! f16, f32, f64.

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

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

/// Serialises `t` (any layout, any device; `None`: an empty marker) stamped with `stamp`.
pub fn encode(t: Option<&Tensor>, stamp: Stamp) -> Result<Vec<u8>, WireError> {
    let Some(t) = t else {
        return Ok(header(false, 0, 0, stamp).to_vec());
    };
    let code = dtype_code(t.dtype())?;
    if t.rank() > 255 {
        return Err(WireError::TooManyDims(t.rank()));
    }
    let payload = t.elem_count() * t.dtype().size_in_bytes();
    let mut out = Vec::with_capacity(HEADER + 8 * t.rank() + payload);
    out.extend_from_slice(&header(true, code, t.rank() as u8, stamp));
    for &d in t.dims() {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    // A contiguous CPU tensor is read straight from its storage: no intermediate copy of the elements.
    let t = t.contiguous()?;
    if let (Storage::Cpu(cpu), Some((start, end))) = (&*t.storage_and_layout().0, t.layout().contiguous_offsets()) {
        macro_rules! put {
            ($v:expr) => {
                for x in &$v[start..end] {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            };
        }
        match cpu {
            CpuStorage::U8(v) => out.extend_from_slice(&v[start..end]),
            CpuStorage::U32(v) => put!(v),
            CpuStorage::I16(v) => put!(v),
            CpuStorage::I32(v) => put!(v),
            CpuStorage::I64(v) => put!(v),
            CpuStorage::BF16(v) => put!(v),
            CpuStorage::F16(v) => put!(v),
            CpuStorage::F32(v) => put!(v),
            CpuStorage::F64(v) => put!(v),
            _ => return Err(WireError::UnsupportedDtype(t.dtype())),
        }
        return Ok(out);
    }
    // Other devices: through a host vector.
    let flat = t.flatten_all()?;
    macro_rules! push {
        ($ty:ty) => {
            for v in flat.to_vec1::<$ty>()? {
                out.extend_from_slice(&v.to_le_bytes());
            }
        };
    }
    match t.dtype() {
        DType::U8 => out.extend_from_slice(&flat.to_vec1::<u8>()?),
        DType::U32 => push!(u32),
        DType::I16 => push!(i16),
        DType::I32 => push!(i32),
        DType::I64 => push!(i64),
        DType::BF16 => push!(half::bf16),
        DType::F16 => push!(half::f16),
        DType::F32 => push!(f32),
        DType::F64 => push!(f64),
        other => return Err(WireError::UnsupportedDtype(other)),
    }
    Ok(out)
}

/// Parses bytes made by [`encode`] into their stamp and a tensor on `device` (`None` for an empty marker).
pub fn decode(bytes: &[u8], device: &Device) -> Result<(Stamp, Option<Tensor>), WireError> {
    let bad = |detail: String| WireError::Malformed { len: bytes.len(), detail };
    if bytes.len() < HEADER {
        return Err(bad(format!("shorter than the {HEADER}-byte header")));
    }
    let collective =
        Stamp::kind_from_code(bytes[3] as u64).ok_or_else(|| bad(format!("unknown operation code {}", bytes[3])))?;
    let stamp = Stamp::new(collective, u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")));
    match bytes[0] {
        0 => return Ok((stamp, None)),
        1 => {}
        b => return Err(bad(format!("first byte {b} is neither 0 (none) nor 1 (tensor)"))),
    }
    let dtype = code_dtype(bytes[1]).ok_or_else(|| bad(format!("unknown dtype code {}", bytes[1])))?;
    let ndim = bytes[2] as usize;
    let data_start = HEADER + 8 * ndim;
    if bytes.len() < data_start {
        return Err(bad(format!("too short for {ndim} dimensions")));
    }
    let dims: Vec<usize> = bytes[HEADER..data_start]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")) as usize)
        .collect();
    let expected = dims.iter().product::<usize>() * dtype.size_in_bytes();
    let data = &bytes[data_start..];
    if data.len() != expected {
        return Err(bad(format!("shape {dims:?} of {dtype:?} needs {expected} data bytes, got {}", data.len())));
    }
    Ok((stamp, Some(Tensor::from_raw_buffer(data, dtype, &dims, device)?)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Collective;

    const STAMP: Stamp = Stamp { collective: Collective::AllGather, call: 0x0102_0304_0506 };

    fn round_trip(t: &Tensor) -> Tensor {
        let (stamp, back) = decode(&encode(Some(t), STAMP).unwrap(), &Device::Cpu).unwrap();
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
            assert_eq!(encode(Some(&back), STAMP).unwrap(), encode(Some(&t), STAMP).unwrap(), "{dtype:?}");
        }
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
        let bytes = encode(Some(&rows), STAMP).unwrap();
        let want: Vec<u8> = (4..12).flat_map(|v| (v as f32).to_le_bytes()).collect();
        assert_eq!(&bytes[bytes.len() - want.len()..], &want[..]);
        assert_eq!(round_trip(&rows).to_vec2::<f32>()?, rows.to_vec2::<f32>()?);
        let e = Tensor::zeros((0, 5), DType::F32, &Device::Cpu)?;
        assert_eq!(round_trip(&e).dims(), &[0, 5]);
        let marker = Stamp::new(Collective::Barrier, 7);
        let (stamp, none) = decode(&encode(None, marker).unwrap(), &Device::Cpu).unwrap();
        assert!(stamp == marker && none.is_none());
        Ok(())
    }

    #[test]
    fn malformed_messages_are_errors() {
        let t = Tensor::new(&[1f32, 2.], &Device::Cpu).unwrap();
        let mut bytes = encode(Some(&t), STAMP).unwrap();
        bytes.pop();
        let err = decode(&bytes, &Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("needs 8 data bytes, got 7"), "{err}");
        let mut header = encode(None, STAMP).unwrap();
        header[0] = 1;
        header[1] = 42;
        assert!(decode(&header, &Device::Cpu).unwrap_err().to_string().contains("dtype code 42"));
        header[3] = 0;
        assert!(decode(&header, &Device::Cpu).unwrap_err().to_string().contains("operation code 0"));
        assert!(decode(&[3], &Device::Cpu).is_err());
    }
}
