//! GGUF v2/v3 reader: metadata, tensor directory, and tensors dequantised to f32.
//!
//! The file is memory-mapped; opening it parses the header and the tensor directory and
//! checks that every tensor's type is one we read and its bytes lie inside the file, so
//! a truncated download fails at open, naming the tensor it cuts.

use super::{HostTensor, LoadError, TensorSource};
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tessera_kernels::quant::{GgmlType, dequantize, type_name};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where a tensor lives in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Row-major shape, outermost first (GGUF stores it innermost first).
    pub shape: Vec<usize>,
    pub ty: GgmlType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile").field("path", &self.path).field("tensors", &self.tensors.len()).finish()
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
        // SAFETY: the map is read-only and private to this process; a file changed under
        // us while mapped is an operator error we accept, as every mmap-based loader does.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
        let mut r = Reader { path, bytes: &map, pos: 0 };
        let magic = r.take(4, "the magic number")?;
        if magic != MAGIC {
            return Err(LoadError::BadMagic { file: path.into(), found: magic.try_into().expect("4 bytes") });
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(LoadError::UnsupportedVersion { file: path.into(), version });
        }
        let tensor_count = r.u64("the tensor count")?;
        let kv_count = r.u64("the metadata count")?;
        let mut metadata = HashMap::new();
        for _ in 0..kv_count {
            let key = r.string("a metadata key")?;
            let ty = r.u32(&format!("the type of {key}"))?;
            let value = r.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }
        let mut raw = Vec::new();
        for i in 0..tensor_count {
            let name = r.string(&format!("the name of tensor {i}"))?;
            let n_dims = r.u32(&format!("tensor {name}"))?;
            if n_dims > 8 {
                return Err(LoadError::BadTensor {
                    file: path.into(),
                    tensor: name,
                    detail: format!("{n_dims} dimensions"),
                });
            }
            let mut dims = (0..n_dims).map(|_| r.u64(&format!("tensor {name}"))).collect::<Result<Vec<_>, _>>()?;
            dims.reverse();
            let ty = r.u32(&format!("tensor {name}"))?;
            let offset = r.u64(&format!("tensor {name}"))?;
            raw.push((name, dims, ty, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| LoadError::metadata(path, "general.alignment", "must be a power of two"))?,
        };
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
        let tensors = raw
            .into_iter()
            .map(|(name, dims, ty, offset)| tensor_info(path, map.len(), data_start, name, dims, ty, offset))
            .collect::<Result<Vec<_>, _>>()?;
        let by_name = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Self { path: path.into(), map, version, metadata, tensors, by_name })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor, as stored.
    pub fn raw(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.start..info.start + info.len]
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A required unsigned integer.
    pub fn get_u64(&self, key: &str) -> Result<u64, LoadError> {
        self.get(key)
            .ok_or_else(|| LoadError::metadata(&self.path, key, "missing"))?
            .as_u64()
            .ok_or_else(|| LoadError::metadata(&self.path, key, "not an unsigned integer"))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, LoadError> {
        self.get(key)
            .ok_or_else(|| LoadError::metadata(&self.path, key, "missing"))?
            .as_str()
            .ok_or_else(|| LoadError::metadata(&self.path, key, "not a string"))
    }
}

impl TensorSource for GgufFile {
    fn describe(&self) -> &Path {
        &self.path
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.info(name).map(|t| t.shape.clone())
    }

    fn load(&self, name: &str) -> Result<HostTensor, LoadError> {
        let info =
            self.info(name).ok_or_else(|| LoadError::MissingTensor { file: self.path.clone(), tensor: name.into() })?;
        Ok(HostTensor { shape: info.shape.clone(), data: dequantize(info.ty, self.raw(info)) })
    }

    fn blocks(&self, name: &str) -> Option<(GgmlType, &[u8])> {
        self.info(name).map(|info| (info.ty, self.raw(info)))
    }
}

fn tensor_info(
    path: &Path,
    file_len: usize,
    data_start: u64,
    name: String,
    shape: Vec<u64>,
    ty: u32,
    offset: u64,
) -> Result<TensorInfo, LoadError> {
    let bad = |detail: String| LoadError::BadTensor { file: path.into(), tensor: name.clone(), detail };
    let Some(kind) = GgmlType::from_id(ty) else {
        return Err(LoadError::UnsupportedTensorType { file: path.into(), tensor: name, ty: type_name(ty) });
    };
    let elems = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    let elems = usize::try_from(elems).map_err(|_| bad(format!("shape {shape:?} too large")))?;
    let inner = *shape.last().unwrap_or(&1) as usize;
    if !inner.is_multiple_of(kind.block_elems()) {
        return Err(bad(format!("row of {inner} elements is not whole {kind:?} blocks of {}", kind.block_elems())));
    }
    let len = kind.bytes_for(elems).ok_or_else(|| bad(format!("{elems} elements are not whole blocks")))?;
    let start = data_start
        .checked_add(offset)
        .and_then(|s| usize::try_from(s).ok())
        .filter(|s| s.checked_add(len).is_some_and(|e| e <= file_len));
    let Some(start) = start else {
        return Err(LoadError::Truncated { file: path.into(), what: format!("the data of tensor {name}") });
    };
    Ok(TensorInfo { name, shape: shape.into_iter().map(|d| d as usize).collect(), ty: kind, start, len })
}

/// A bounds-checked little-endian cursor over the file.
struct Reader<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], LoadError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(LoadError::Truncated { file: self.path.into(), what: what.into() });
        };
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], LoadError> {
        Ok(self.take(N, what)?.try_into().expect("length checked"))
    }
    fn u32(&mut self, what: &str) -> Result<u32, LoadError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, LoadError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn len(&mut self, what: &str) -> Result<usize, LoadError> {
        let n = self.u64(what)?;
        // Every element takes at least a byte: a count past the end is a truncation
        // (or garbage), caught here before anything is allocated for it.
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.bytes.len() - self.pos)
            .ok_or_else(|| LoadError::Truncated { file: self.path.into(), what: what.into() })
    }
    fn string(&mut self, what: &str) -> Result<String, LoadError> {
        let n = self.len(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| LoadError::format(self.path, format!("{what} is not UTF-8")))
    }
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<MetaValue, LoadError> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(key)?[0]),
            1 => MetaValue::I8(self.array::<1>(key)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => MetaValue::U32(self.u32(key)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => MetaValue::Bool(self.array::<1>(key)?[0] != 0),
            8 => MetaValue::String(self.string(key)?),
            9 if depth == 0 => {
                let item_ty = self.u32(key)?;
                let n = self.len(key)?;
                let items = (0..n).map(|_| self.value(item_ty, key, depth + 1)).collect::<Result<_, _>>()?;
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(key)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(key)?)),
            _ => return Err(LoadError::metadata(self.path, key, format!("value type {ty} is not supported"))),
        })
    }
}
