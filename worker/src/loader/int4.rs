//! 4-bit weight-only checkpoints as AutoAWQ and GPTQ write them: for a linear layer
//! `NAME` with `k` inputs and `n` outputs, no `NAME.weight` but
//!
//! - `NAME.qweight` (I32): eight 4-bit values a word. AWQ: `[k, n / 8]`, the word's
//!   nibble `i` (bits 4i..4i+4) holding output column `8c + ORDER[i]`, ORDER =
//!   [0, 2, 4, 6, 1, 3, 5, 7]. GPTQ: `[k / 8, n]`, nibble `i` holding input row `8r + i`;
//! - `NAME.qzeros` (I32, `[⌈k / group⌉, n / 8]`): each group's zero points, packed along
//!   the outputs as `qweight` is (AWQ's order, or GPTQ's plain one). GPTQ's original
//!   format stores each zero less one (`checkpoint_format` "gptq"; "gptq_v2" does not);
//! - `NAME.scales` (F16, `[⌈k / group⌉, n]`);
//! - GPTQ only, `NAME.g_idx` (I32, `[k]`): each input row's group, where activation
//!   order permuted them; absent, row `r` is in group `r / group`.
//!
//! The weight is `(q − zero) × scale`, returned as the `[n, k]` matrix a `.weight`
//! holds: decoded to f32 (`dequantize`), or kept in 4 bits as rows of outputs
//! (`repack`), the layout the GPU's kernels read.

use super::LoadError;
use std::path::Path;
use tessera_kernels::quant::Int4Weight;

/// AutoAWQ's packing order: nibble `i` of a word holds column `8c + AWQ_ORDER[i]`.
const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// Which writer packed the tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Packing {
    Awq,
    /// `zero_minus_one`: zeros stored less one (GPTQ's original checkpoint format).
    Gptq {
        zero_minus_one: bool,
    },
}

/// A 4-bit layer's tensors, as stored.
#[derive(Clone, Copy)]
pub struct Packed<'a> {
    pub qweight: &'a [i32],
    pub qzeros: &'a [i32],
    pub scales: &'a [f32],
    pub g_idx: Option<&'a [i32]>,
    pub inputs: usize,
    pub outputs: usize,
    pub group: usize,
}

/// Nibble `i` of `word`.
fn nibble(word: i32, i: usize) -> i32 {
    (word as u32 >> (4 * i) & 0xf) as i32
}

/// The number of groups, once the pieces' sizes are known to fit each other; an error
/// names `tensor` when they do not.
fn check(file: &Path, tensor: &str, p: &Packed<'_>) -> Result<usize, LoadError> {
    let (k, n) = (p.inputs, p.outputs);
    let bad = |detail: String| LoadError::BadTensor { file: file.into(), tensor: tensor.into(), detail };
    if p.group == 0 || n % 8 != 0 || k % 8 != 0 {
        return Err(bad(format!("{k} inputs and {n} outputs do not pack 8 a word in groups of {}", p.group)));
    }
    // The last group may be short (GPTQ allows inputs that no group size divides).
    let groups = k.div_ceil(p.group);
    let sizes = [
        (p.qweight.len(), k * n / 8, "qweight"),
        (p.qzeros.len(), groups * n / 8, "qzeros"),
        (p.scales.len(), groups * n, "scales"),
    ];
    if let Some((got, want, what)) = sizes.into_iter().find(|(got, want, _)| got != want) {
        return Err(bad(format!(
            "{what} holds {got} values, not the {want} of {k} inputs, {n} outputs, groups of {}",
            p.group
        )));
    }
    if let Some(g) = p.g_idx
        && (g.len() != k || g.iter().any(|&x| x < 0 || x as usize >= groups))
    {
        return Err(bad(format!("g_idx is not {k} group numbers below {groups}")));
    }
    Ok(groups)
}

/// Each weight's 4-bit value, `[outputs, inputs]`, and each group's zero point,
/// `[groups, outputs]`, as the writer packed them (sizes checked).
fn unpack(p: &Packed<'_>, packing: Packing, groups: usize) -> (Vec<u8>, Vec<i32>) {
    let (k, n) = (p.inputs, p.outputs);
    let column = |word: usize, i: usize| match packing {
        Packing::Awq => 8 * word + AWQ_ORDER[i],
        Packing::Gptq { .. } => 8 * word + i,
    };
    let mut zeros = vec![0i32; groups * n];
    let plus = i32::from(matches!(packing, Packing::Gptq { zero_minus_one: true }));
    for (w, &word) in p.qzeros.iter().enumerate() {
        let (g, c) = (w / (n / 8), w % (n / 8));
        for i in 0..8 {
            zeros[g * n + column(c, i)] = nibble(word, i) + plus;
        }
    }
    let mut q = vec![0u8; n * k];
    for (w, &word) in p.qweight.iter().enumerate() {
        for i in 0..8 {
            let (row, col) = match packing {
                Packing::Awq => (w / (n / 8), column(w % (n / 8), i)),
                Packing::Gptq { .. } => (8 * (w / n) + i, w % n),
            };
            q[col * k + row] = nibble(word, i) as u8;
        }
    }
    (q, zeros)
}

/// The `[outputs, inputs]` weight of a packed layer; an error names `tensor` when the
/// pieces' sizes do not fit each other.
pub fn dequantize(file: &Path, tensor: &str, p: &Packed<'_>, packing: Packing) -> Result<Vec<f32>, LoadError> {
    let groups = check(file, tensor, p)?;
    let (q, zeros) = unpack(p, packing, groups);
    let (k, n) = (p.inputs, p.outputs);
    let out = q
        .iter()
        .enumerate()
        .map(|(i, &q)| {
            let (col, row) = (i / k, i % k);
            let g = p.g_idx.map_or(row / p.group, |g| g[row] as usize);
            (i32::from(q) - zeros[g * n + col]) as f32 * p.scales[g * n + col]
        })
        .collect();
    Ok(out)
}

/// The layer kept in 4 bits, rows of outputs (`quant::Int4Weight`), or None where
/// `g_idx` permuted the groups (activation order): that layer is read dequantised.
pub fn repack(file: &Path, tensor: &str, p: &Packed<'_>, packing: Packing) -> Result<Option<Int4Weight>, LoadError> {
    let groups = check(file, tensor, p)?;
    if let Some(g) = p.g_idx
        && g.iter().enumerate().any(|(row, &g)| g as usize != row / p.group)
    {
        return Ok(None);
    }
    let (q, zeros) = unpack(p, packing, groups);
    let (n, zeros) = (p.outputs, &zeros);
    // Scales and zeros are stored [groups, outputs]; a row of outputs wants its own.
    let per_row = |col: usize, g: usize| g * n + col;
    Ok(Some(Int4Weight {
        nibbles: q.chunks_exact(2).map(|pair| pair[0] | (pair[1] << 4)).collect(),
        scales: (0..n).flat_map(|c| (0..groups).map(move |g| p.scales[per_row(c, g)])).collect(),
        zeros: (0..n).flat_map(|c| (0..groups).map(move |g| zeros[per_row(c, g)] as u8)).collect(),
        group: p.group,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One word each way, spelled out: which nibble lands where.
    #[test]
    fn nibbles_land_where_each_writer_put_them() {
        // Nibble i holds the value i + 1; zero 0, scale 1: the weight is the value.
        let word = (0..8).fold(0u32, |w, i| w | ((i as u32 + 1) << (4 * i))) as i32;
        let p = Packed {
            qweight: &[word; 8],
            qzeros: &[0],
            scales: &[1.0; 8],
            g_idx: None,
            inputs: 8,
            outputs: 8,
            group: 8,
        };
        // AWQ, [k = 8, n / 8 = 1] words, every input row alike: column ORDER[i] gets i + 1.
        let w = dequantize(Path::new("m"), "w", &p, Packing::Awq).unwrap();
        let columns: Vec<f32> = (0..8).map(|c| w[c * 8]).collect();
        assert_eq!(columns, [1.0, 5.0, 2.0, 6.0, 3.0, 7.0, 4.0, 8.0]);
        // GPTQ, [k / 8 = 1, n = 8] words: input row i of every column gets i + 1, and a
        // stored zero of 0 means 1 in the original format.
        let gptq = p;
        let w = dequantize(Path::new("m"), "w", &gptq, Packing::Gptq { zero_minus_one: true }).unwrap();
        assert_eq!(&w[..8], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        let w = dequantize(Path::new("m"), "w", &gptq, Packing::Gptq { zero_minus_one: false }).unwrap();
        assert_eq!(&w[8..16], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    }

    #[test]
    fn pieces_that_do_not_fit_are_an_error_naming_the_tensor() {
        let ok =
            Packed { qweight: &[0; 8], qzeros: &[0], scales: &[1.0; 8], g_idx: None, inputs: 8, outputs: 8, group: 8 };
        assert!(dequantize(Path::new("m"), "w", &ok, Packing::Awq).is_ok());
        let cases = [
            Packed { qweight: &[0; 7], ..ok },
            Packed { scales: &[1.0; 7], ..ok },
            Packed { group: 0, ..ok },
            Packed { g_idx: Some(&[0, 0, 0, 0, 0, 0, 0, 1]), ..ok },
        ];
        for p in &cases {
            let err = dequantize(Path::new("m"), "layer.qweight", p, Packing::Awq).unwrap_err().to_string();
            assert!(err.contains("layer.qweight"), "{err}");
        }
    }
}
