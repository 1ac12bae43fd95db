//! The GGUF container (versions 2 and 3): metadata, tensor directory and the tensors' bytes, read
//! from a memory map without copying.
//!
//! The header parser trusts nothing in the file: every length and count is checked against the
//! bytes that remain before anything is allocated, tensor extents against the data section,
//! element counts against overflow, so a truncated or hostile file is a [`GgufError`], never a
//! panic or an allocation of what the file merely claims (fuzzed in the tests).

use candle_core::quantized::GgmlDType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why a GGUF file could not be read.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GgufError {
    #[error("{0}")]
    Io(String),
    #[error("not a GGUF file (magic {0:02x?})")]
    Magic([u8; 4]),
    #[error("GGUF version {0} is not supported (2 or 3)")]
    Version(u32),
    #[error("the file ends inside {0} (truncated or not GGUF)")]
    Truncated(String),
    #[error("{0}")]
    Malformed(String),
    #[error("tensor `{name}` has GGML type {ty}, which rserve does not serve")]
    UnsupportedType { name: String, ty: String },
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Uint(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    /// Arrays of numbers are kept as integers or floats, arrays of strings as strings.
    Ints(Vec<i64>),
    Floats(Vec<f64>),
    Bools(Vec<bool>),
    Strs(Vec<String>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Uint(v) => Some(*v),
            Value::Int(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(v) => Some(*v),
            Value::Uint(v) => Some(*v as f64),
            Value::Int(v) => Some(*v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

/// Where one tensor lies in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// GGML order: `dims[0]` is the length of a row (the fastest-moving index).
    pub dims: Vec<usize>,
    pub dtype: GgmlDType,
    /// Byte range in the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    /// The shape in row-major (PyTorch) order: `[out, in]` for a weight.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// The parsed header of a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
}

/// The GGML type of a GGUF type id, for the types rserve serves.
fn ggml_type(id: u32) -> Result<GgmlDType, String> {
    Ok(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        30 => GgmlDType::BF16,
        other => {
            let name = match other {
                9 => "q8_1",
                15 => "q8_k",
                16..=23 | 29 => "an i-quant (iq*)",
                24 => "i8",
                25 => "i16",
                26 => "i32",
                27 => "i64",
                28 => "f64",
                34 => "tq1_0",
                35 => "tq2_0",
                39 => "mxfp4",
                _ => "",
            };
            return Err(if name.is_empty() {
                format!("unknown type id {other}")
            } else {
                format!("{name} (type id {other})")
            });
        }
    })
}

/// A bounds-checked cursor over the header bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| GgufError::Truncated(what.to_string()))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn u8(&mut self, what: &str) -> Result<u8, GgufError> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A count of items of at least `min_item` bytes each, checked against what remains.
    fn count(&mut self, min_item: usize, what: &str) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let n = usize::try_from(n).map_err(|_| GgufError::Truncated(what.to_string()))?;
        if n.saturating_mul(min_item.max(1)) > self.remaining() {
            return Err(GgufError::Truncated(format!("{what} (claims {n} items)")));
        }
        Ok(n)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.count(1, what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| GgufError::Malformed(format!("{what} is not UTF-8")))
    }

    /// A scalar of GGUF type `ty` (not a string or array).
    fn scalar(&mut self, ty: u32, what: &str) -> Result<Value, GgufError> {
        let b = |c: &mut Self, n| c.take(n, what).map(|s| s.to_vec());
        Ok(match ty {
            0 => Value::Uint(u64::from(self.u8(what)?)),
            1 => Value::Int(i64::from(self.u8(what)? as i8)),
            2 => {
                let s = b(self, 2)?;
                Value::Uint(u64::from(u16::from_le_bytes([s[0], s[1]])))
            }
            3 => {
                let s = b(self, 2)?;
                Value::Int(i64::from(i16::from_le_bytes([s[0], s[1]])))
            }
            4 => Value::Uint(u64::from(self.u32(what)?)),
            5 => Value::Int(i64::from(self.u32(what)? as i32)),
            6 => Value::Float(f64::from(f32::from_bits(self.u32(what)?))),
            7 => match self.u8(what)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                v => return Err(GgufError::Malformed(format!("{what}: bool byte {v}"))),
            },
            10 => Value::Uint(self.u64(what)?),
            11 => Value::Int(self.u64(what)? as i64),
            12 => Value::Float(f64::from_bits(self.u64(what)?)),
            other => {
                return Err(GgufError::Malformed(format!(
                    "{what}: unknown value type {other}"
                )))
            }
        })
    }

    fn value(&mut self, ty: u32, what: &str) -> Result<Value, GgufError> {
        match ty {
            8 => Ok(Value::Str(self.string(what)?)),
            9 => {
                let ity = self.u32(what)?;
                let item = match ity {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => {
                        return Err(GgufError::Malformed(format!(
                            "{what}: nested arrays are not supported"
                        )))
                    }
                    other => {
                        return Err(GgufError::Malformed(format!(
                            "{what}: unknown array item type {other}"
                        )))
                    }
                };
                let n = self.count(item, what)?;
                Ok(match ity {
                    8 => Value::Strs(
                        (0..n)
                            .map(|_| self.string(what))
                            .collect::<Result<_, _>>()?,
                    ),
                    7 => Value::Bools(
                        (0..n)
                            .map(|_| match self.scalar(7, what)? {
                                Value::Bool(b) => Ok(b),
                                _ => Err(GgufError::Malformed(what.to_string())),
                            })
                            .collect::<Result<_, _>>()?,
                    ),
                    6 | 12 => Value::Floats(
                        (0..n)
                            .map(|_| self.scalar(ity, what).map(|v| v.as_f64().unwrap_or(0.0)))
                            .collect::<Result<_, _>>()?,
                    ),
                    _ => Value::Ints(
                        (0..n)
                            .map(|_| {
                                self.scalar(ity, what).map(|v| match v {
                                    Value::Uint(u) => u as i64,
                                    Value::Int(i) => i,
                                    _ => 0,
                                })
                            })
                            .collect::<Result<_, _>>()?,
                    ),
                })
            }
            _ => self.scalar(ty, what),
        }
    }
}

/// Parses the header of a GGUF file held in `buf` (the whole file, normally a memory map).
pub fn parse(buf: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.take(4, "the magic")?;
    if magic != b"GGUF" {
        let mut m = [0u8; 4];
        m.copy_from_slice(magic);
        return Err(GgufError::Magic(m));
    }
    let version = c.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::Version(version));
    }
    // a tensor entry takes at least 8 + 4 + 8 + 4 + 8 bytes, a metadata entry 8 + 4 + 1
    let n_tensors = c.u64("the tensor count")?;
    let n_kv = c.count(13, "the metadata count")?;
    let mut metadata = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key {i}"))?;
        let ty = c.u32(&format!("the type of `{key}`"))?;
        let v = c.value(ty, &format!("metadata `{key}`"))?;
        metadata.insert(key, v);
    }
    let n_tensors = usize::try_from(n_tensors)
        .ok()
        .filter(|&n| n.saturating_mul(32) <= c.remaining())
        .ok_or_else(|| {
            GgufError::Truncated(format!("the tensor directory ({n_tensors} tensors)"))
        })?;
    let mut raw = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor name {i}"))?;
        let nd = c.u32(&format!("the dimensions of `{name}`"))? as usize;
        if nd == 0 || nd > 4 {
            return Err(GgufError::Malformed(format!(
                "tensor `{name}` has {nd} dimensions (1 to 4)"
            )));
        }
        let dims = (0..nd)
            .map(|_| {
                c.u64(&format!("the shape of `{name}`")).and_then(|d| {
                    usize::try_from(d).map_err(|_| {
                        GgufError::Malformed(format!("tensor `{name}`: dimension {d}"))
                    })
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ty = c.u32(&format!("the type of `{name}`"))?;
        let offset = c.u64(&format!("the offset of `{name}`"))?;
        raw.push((name, dims, ty, offset));
    }
    let alignment = match metadata.get("general.alignment") {
        None => 32,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a as usize,
            _ => {
                return Err(GgufError::Malformed(format!(
                    "general.alignment {v:?} is not a power of two"
                )))
            }
        },
    };
    let data_start = c.pos.div_ceil(alignment) * alignment;
    let mut tensors = HashMap::with_capacity(raw.len());
    for (name, dims, ty, offset) in raw {
        let dtype = ggml_type(ty).map_err(|t| GgufError::UnsupportedType {
            name: name.clone(),
            ty: t,
        })?;
        let elems = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| GgufError::Malformed(format!("tensor `{name}`: shape {dims:?}")))?;
        let bs = dtype.block_size();
        if elems == 0 || !dims[0].is_multiple_of(bs) {
            return Err(GgufError::Malformed(format!(
                "tensor `{name}`: rows of {} values do not fill {dtype:?} blocks of {bs}",
                dims[0]
            )));
        }
        let len = (elems / bs).checked_mul(dtype.type_size()).ok_or_else(|| {
            GgufError::Malformed(format!("tensor `{name}`: shape {dims:?} is too large"))
        })?;
        let start = usize::try_from(offset)
            .ok()
            .filter(|o| o.is_multiple_of(alignment))
            .and_then(|o| o.checked_add(data_start))
            .ok_or_else(|| {
                GgufError::Malformed(format!("tensor `{name}`: offset {offset} is not aligned"))
            })?;
        if start.checked_add(len).is_none_or(|e| e > buf.len()) {
            return Err(GgufError::Truncated(format!(
                "tensor `{name}` ({len} bytes at {start}, file of {})",
                buf.len()
            )));
        }
        if tensors
            .insert(
                name.clone(),
                TensorInfo {
                    dims,
                    dtype,
                    start,
                    len,
                },
            )
            .is_some()
        {
            return Err(GgufError::Malformed(format!(
                "tensor `{name}` appears twice"
            )));
        }
    }
    Ok(Header {
        version,
        metadata,
        tensors,
    })
}

/// A GGUF file mapped into memory, with its parsed header.
pub struct GgufFile {
    pub path: PathBuf,
    pub header: Header,
    map: Arc<memmap2::Mmap>,
}

/// A tensor's bytes that keep the file's map alive (an embedding table read in place).
#[derive(Clone)]
pub struct SharedBytes {
    map: Arc<memmap2::Mmap>,
    range: std::ops::Range<usize>,
}

impl std::ops::Deref for SharedBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // the range was checked against the map when this value was made
        &self.map[self.range.clone()]
    }
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBytes({} bytes)", self.range.len())
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let file = std::fs::File::open(path)
            .map_err(|e| GgufError::Io(format!("{}: {e}", path.display())))?;
        // SAFETY: mapped read-only; rserve never writes to the file, and the map lives as long
        // as this value.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| GgufError::Io(format!("{}: {e}", path.display())))?;
        let header = parse(&map)?;
        Ok(Self {
            path: path.to_path_buf(),
            header,
            map: Arc::new(map),
        })
    }

    /// The bytes of tensor `name`, with its directory entry.
    pub fn tensor(&self, name: &str) -> Option<(&TensorInfo, &[u8])> {
        let t = self.header.tensors.get(name)?;
        self.map.get(t.start..t.start + t.len).map(|b| (t, b))
    }

    /// The bytes of tensor `name` as a value that outlives this one.
    pub fn tensor_shared(&self, name: &str) -> Option<SharedBytes> {
        let t = self.header.tensors.get(name)?;
        let range = t.start..t.start + t.len;
        self.map.get(range.clone())?;
        Some(SharedBytes {
            map: self.map.clone(),
            range,
        })
    }

    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.header.metadata.get(key)
    }
}

/// Whether `path` names a GGUF file (by its extension or its magic).
pub fn is_gguf(path: &Path) -> bool {
    if !path.is_file() {
        return false;
    }
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok_and(|()| &magic == b"GGUF")
}
