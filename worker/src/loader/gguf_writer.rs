//! A small GGUF writer: enough to build test models and fixtures with exact control of
//! every byte (tensor types, shapes, metadata), including deliberately broken files.

use super::gguf::MetaValue;
use std::io::Write;

pub struct GgufTensor {
    pub name: String,
    /// Row-major shape, outermost first.
    pub shape: Vec<usize>,
    /// ggml type id.
    pub ty: u32,
    /// Already encoded in `ty`'s layout.
    pub data: Vec<u8>,
}

impl GgufTensor {
    pub fn f32(name: &str, shape: &[usize], values: &[f32]) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            ty: 0,
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// Serialises a GGUF v3 file with 32-byte alignment.
pub fn write_gguf(metadata: &[(&str, MetaValue)], tensors: &[GgufTensor]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        put_str(&mut out, key);
        out.extend_from_slice(&type_id(value).to_le_bytes());
        put_value(&mut out, value);
    }
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for d in t.shape.iter().rev() {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        out.extend_from_slice(&t.ty.to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offset += (t.data.len() as u64).div_ceil(32) * 32;
    }
    pad(&mut out);
    for t in tensors {
        out.write_all(&t.data).expect("writing to a Vec");
        pad(&mut out);
    }
    out
}

fn pad(out: &mut Vec<u8>) {
    out.resize(out.len().div_ceil(32) * 32, 0);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => put_str(out, s),
        MetaValue::Array(items) => {
            let item_ty = items.first().map_or(4, type_id);
            out.extend_from_slice(&item_ty.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| put_value(out, i));
        }
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}
