//! Element types and their safetensors wire names (format-spec/shard.md §Dtypes).

use std::fmt;

/// An element type a tensor may hold.
///
/// The wire names are those of the safetensors format, so shards stay readable by stock tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// Boolean, one byte, 0 or 1.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (the upper half of an IEEE binary32).
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// IEEE 754 binary32.
    F32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE 754 binary64.
    F64,
}

impl DType {
    /// Every dtype, in wire-name order of the spec table.
    pub const ALL: [DType; 13] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::U16,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U32,
        DType::F32,
        DType::I64,
        DType::U64,
        DType::F64,
    ];

    /// Size of one element in bytes. Also the alignment ckptstore guarantees for the
    /// tensor's offset in a shard file.
    pub const fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// The safetensors wire name ("F32", "BF16", "BOOL", ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::F32 => "F32",
            DType::I64 => "I64",
            DType::U64 => "U64",
            DType::F64 => "F64",
        }
    }

    /// Parse a wire name. Returns `None` for names this version does not know.
    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }

    /// True for F16, BF16, F32, F64.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

impl serde::Serialize for DType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for DType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = DType;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a safetensors dtype name such as \"F32\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DType, E> {
                DType::from_name(v).ok_or_else(|| E::custom(format!("unknown dtype {v:?}")))
            }
        }
        d.deserialize_str(V)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Number of elements of a shape, or `None` on overflow. The empty shape (0-dim) has one.
pub fn checked_numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

/// Byte length of a tensor of `dtype` and `shape`, or `None` on overflow.
pub fn checked_nbytes(dtype: DType, shape: &[u64]) -> Option<u64> {
    checked_numel(shape)?.checked_mul(dtype.size() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        assert_eq!(DType::from_name("F8_E4M3"), None);
        assert_eq!(DType::from_name("f32"), None);
    }

    #[test]
    fn numel_overflow_is_none() {
        assert_eq!(checked_numel(&[]), Some(1));
        assert_eq!(checked_numel(&[0, u64::MAX]), Some(0));
        assert_eq!(checked_numel(&[u64::MAX, 2]), None);
        assert_eq!(checked_nbytes(DType::F64, &[u64::MAX / 4]), None);
    }
}
