//! The compute dtype of a run: `--dtype bf16|f16|f32` parsed, and its default for a device (f32 on the CPU,
//! bf16 on a GPU). Master weights, optimizer moments, softmax statistics, the LSE, the loss and the gradient
//! all-reduce stay f32 whatever this says (see README "Mixed precision").

use candle_core::DType;

use crate::DeviceSpec;

/// Parses `bf16`, `f16` or `f32` (also `bfloat16`, `float16`/`half`, `float32`/`float`).
pub fn parse_dtype(s: &str) -> Result<DType, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
        "f32" | "fp32" | "float32" | "float" => Ok(DType::F32),
        other => Err(format!("--dtype {other:?} is not a training dtype: use bf16, f16 or f32")),
    }
}

/// The default compute dtype on `device`: bf16 on CUDA and Metal, f32 on the CPU (where bf16 is converted
/// to f32 inside every kernel and saves memory, not time).
pub fn default_dtype(device: &DeviceSpec) -> DType {
    match device {
        DeviceSpec::Cpu => DType::F32,
        DeviceSpec::Cuda(_) | DeviceSpec::Metal(_) => DType::BF16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_training_dtypes_and_defaults_by_device() {
        assert_eq!(parse_dtype("BF16").unwrap(), DType::BF16);
        assert_eq!(parse_dtype("half").unwrap(), DType::F16);
        assert_eq!(parse_dtype("f32").unwrap(), DType::F32);
        assert!(parse_dtype("int8").unwrap_err().contains("bf16, f16 or f32"));
        assert_eq!(default_dtype(&DeviceSpec::Cpu), DType::F32);
        assert_eq!(default_dtype(&DeviceSpec::Cuda(Some(0))), DType::BF16);
    }
}
