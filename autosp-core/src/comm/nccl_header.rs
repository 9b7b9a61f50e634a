//! The fixed-size header the NCCL back end sends before each tensor: NCCL moves raw device buffers whose size
//! the receiver must know in advance, so every transfer is a header round (this codec) and then the payload.
//!
//! Layout (`HEADER_WORDS` u64 words): `[present, dtype code, ndim, kind, call, dims[0..MAX_DIMS]]`;
//! `present = 0` is an empty marker (a rank that rejected its own arguments); `kind` and `call` are the
//! message's [`Stamp`] (operation, `Collective::index() + 1`, and sequence number), sent with empty markers
//! too. dtype codes are those of the MPI [`wire`](super::wire) format.

use candle_core::DType;

use super::stamp::Stamp;
use super::wire::{code_dtype, dtype_code};

/// The most dimensions a tensor sent over NCCL may have.
pub(crate) const MAX_DIMS: usize = 8;
/// Words in one header.
pub(crate) const HEADER_WORDS: usize = 5 + MAX_DIMS;
/// Index of the first dimension word.
const DIMS: usize = 5;

/// The header of a tensor of `dtype` and `dims` (`None`: an empty marker) sent by the call `stamp`, or why
/// it cannot be sent.
pub(crate) fn encode_header(t: Option<(DType, &[usize])>, stamp: Stamp) -> Result<[u64; HEADER_WORDS], String> {
    let mut h = [0u64; HEADER_WORDS];
    h[3] = stamp.kind_code() as u64;
    h[4] = stamp.call;
    let Some((dtype, dims)) = t else {
        return Ok(h);
    };
    let code = dtype_code(dtype).map_err(|e| e.to_string())?;
    if dims.len() > MAX_DIMS {
        return Err(format!(
            "a tensor of rank {} ({dims:?}) cannot be sent over NCCL: at most {MAX_DIMS} dimensions; reshape it",
            dims.len()
        ));
    }
    h[0] = 1;
    h[1] = code as u64;
    h[2] = dims.len() as u64;
    for (slot, &d) in h[DIMS..].iter_mut().zip(dims) {
        *slot = d as u64;
    }
    Ok(h)
}

/// The dtype and dims of the tensor a header announces (`None`: an empty marker).
pub(crate) type Announced = Option<(DType, Vec<usize>)>;

/// The stamp and the tensor a header announces, or why it is malformed.
pub(crate) fn decode_header(h: &[u64]) -> Result<(Stamp, Announced), String> {
    if h.len() != HEADER_WORDS {
        return Err(format!("a header has {} words, expected {HEADER_WORDS}", h.len()));
    }
    let collective = Stamp::kind_from_code(h[3]).ok_or_else(|| format!("unknown operation code {}", h[3]))?;
    let stamp = Stamp::new(collective, h[4]);
    match h[0] {
        0 => return Ok((stamp, None)),
        1 => {}
        p => return Err(format!("bad presence word {p}")),
    }
    let dtype = u8::try_from(h[1]).ok().and_then(code_dtype).ok_or_else(|| format!("unknown dtype code {}", h[1]))?;
    let ndim = h[2] as usize;
    if ndim > MAX_DIMS {
        return Err(format!("rank {ndim} exceeds {MAX_DIMS}"));
    }
    let dims = h[DIMS..DIMS + ndim].iter().map(|&d| d as usize).collect();
    Ok((stamp, Some((dtype, dims))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Collective;

    const S: Stamp = Stamp { collective: Collective::ReduceScatter, call: 41 };

    #[test]
    fn headers_round_trip_and_reject_what_cannot_travel() {
        for (dtype, dims) in [(DType::F32, vec![2, 3, 4]), (DType::BF16, vec![]), (DType::I64, vec![1; MAX_DIMS])] {
            let h = encode_header(Some((dtype, &dims)), S).unwrap();
            assert_eq!(decode_header(&h).unwrap(), (S, Some((dtype, dims))));
        }
        let marker = Stamp::new(Collective::Barrier, 3);
        assert_eq!(decode_header(&encode_header(None, marker).unwrap()).unwrap(), (marker, None));
        assert!(encode_header(Some((DType::F32, &[1; MAX_DIMS + 1])), S).unwrap_err().contains("at most 8"));
        assert!(encode_header(Some((DType::F8E4M3, &[2])), S).is_err());
        let mut bad = encode_header(Some((DType::F32, &[2])), S).unwrap();
        bad[1] = 200;
        assert!(decode_header(&bad).unwrap_err().contains("dtype code 200"));
        assert!(decode_header(&bad[..4]).is_err());
        bad[3] = 0;
        assert!(decode_header(&bad).unwrap_err().contains("operation code 0"));
    }
}
