//! Picking tokens on the GPU: penalties, logit bias, the greedy argmax or a sampled
//! draw (temperature, top-k, top-p, min-p), and the log-probabilities computed where
//! the logits are, so only a few numbers per row cross to the host instead of the
//! whole `[rows, vocab]` matrix.

use super::{CudaBackend, CudaBuffer, Data, device_err, flat, launch, per_row};
use crate::error::expect_len;
use crate::pick::{Draw, MAX_TOP_LOGPROBS, PickRow, Picked};
use crate::{KernelError, Result};
use cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

/// Threads of a pick's blocks, and the fewest tokens of a row one takes.
const PICK_THREADS: u32 = 256;
const PICK_MIN_SPLIT: usize = 2048;
/// Most blocks per row and the words of a row's state (PICK_SPLITS_MAX and
/// PICK_STATE_WORDS in sampling.cu).
const PICK_SPLITS_MAX: usize = 128;
const PICK_STATE_WORDS: usize = 4 + 3 * PICK_SPLITS_MAX / 2 + 3 * 4 * 256;

/// One logit type's pick kernels.
pub(super) struct PickKernels {
    best: CudaFunction,
    radix: CudaFunction,
    count: CudaFunction,
    find: CudaFunction,
    /// Radix passes of a key: four bytes of an f32's, two of a bf16's.
    passes: u32,
}

pub(super) struct PickSet {
    f32: PickKernels,
    bf16: PickKernels,
    tokens: CudaFunction,
    lse_parts: CudaFunction,
    lse_merge: CudaFunction,
    topk_parts: CudaFunction,
    topk_merge: CudaFunction,
}

impl PickSet {
    pub(super) fn load(find: &impl Fn(&str) -> Result<CudaFunction>) -> Result<Self> {
        let of = |name: &str, passes| -> Result<PickKernels> {
            Ok(PickKernels {
                best: find(&format!("pick_best_{name}"))?,
                radix: find(&format!("pick_radix_{name}"))?,
                count: find(&format!("pick_count_{name}"))?,
                find: find(&format!("pick_find_{name}"))?,
                passes,
            })
        };
        Ok(Self {
            f32: of("f32", 4)?,
            bf16: of("bf16", 2)?,
            tokens: find("pick_tokens")?,
            lse_parts: find("lse_parts")?,
            lse_merge: find("lse_merge")?,
            topk_parts: find("topk_parts")?,
            topk_merge: find("topk_merge")?,
        })
    }
}

impl CudaBackend {
    /// Picks each row's token from `logits` (`[rows.len(), vocab]`).
    pub(super) fn pick_on_device(&self, logits: &CudaBuffer, vocab: usize, rows: &[PickRow]) -> Result<Vec<Picked>> {
        const OP: &str = "device_pick";
        expect_len(OP, "logits", logits.len(), rows.len() * vocab)?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        for (i, r) in rows.iter().enumerate() {
            let bad =
                r.history.iter().map(|h| h.0).chain(r.logit_bias.iter().map(|b| b.0)).find(|&t| t as usize >= vocab);
            if let Some(t) = bad {
                return Err(KernelError::shape(OP, format!("row {i}: token {t} outside a vocabulary of {vocab}")));
            }
            if let Some(d) = r.draw
                && !(d.temperature > 0.0 && (0.0..1.0).contains(&d.uniform))
            {
                return Err(KernelError::shape(
                    OP,
                    format!("row {i}: a draw needs temperature > 0 and uniform in [0, 1)"),
                ));
            }
            if r.top_logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
                return Err(KernelError::shape(OP, format!("row {i}: more than {MAX_TOP_LOGPROBS} top_logprobs")));
            }
        }
        let v = u32::try_from(vocab).map_err(|_| KernelError::shape(OP, "vocabulary too large"))?;
        let n = rows.len();
        let want_logprobs = rows.iter().any(|r| r.top_logprobs.is_some());
        let penalised = rows.iter().any(|r| !r.history.is_empty() || !r.logit_bias.is_empty());
        // The raw logits in f32 where log-probabilities are read from them or penalties
        // change them (in a copy of their own); otherwise the pick reads them as they are.
        let raw = if want_logprobs || penalised { Some(self.f32_copy(OP, logits)?) } else { None };
        let k = rows.iter().filter_map(|r| r.top_logprobs).max().unwrap_or(0);
        // Each row's max and log-sum-exp, and its top k, from the raw logits.
        let logprob_parts = match raw.as_ref().filter(|_| want_logprobs) {
            Some(raw) => Some(self.logprob_parts(OP, raw, v, n, k)?),
            None => None,
        };
        let work = match &raw {
            Some(raw) if penalised => Some(self.penalise(OP, raw, v, rows)?),
            _ => None,
        };
        let tokens = match (&work, &logits.0) {
            (Some(w), _) => self.pick(OP, w, &self.k.pick.f32, v, rows)?,
            (None, Data::F32(s)) => self.pick(OP, s, &self.k.pick.f32, v, rows)?,
            (None, Data::Bf16(s)) => self.pick(OP, s, &self.k.pick.bf16, v, rows)?,
        };
        let tokens = self.stream.clone_dtoh(&tokens).map_err(device_err(OP))?;
        let (Some(raw), Some((maxes, lses, top))) = (&raw, logprob_parts) else {
            return Ok(tokens
                .into_iter()
                .map(|token| Picked { token, logprob: None, top_logprobs: Vec::new() })
                .collect());
        };
        let maxes = self.stream.clone_dtoh(&maxes).map_err(device_err(OP))?;
        let lses = self.stream.clone_dtoh(&lses).map_err(device_err(OP))?;
        let top = self.stream.clone_dtoh(&top).map_err(device_err(OP))?;
        // The raw logits of the picked and the top tokens, gathered on the host side
        // from a small download rather than the whole matrix.
        let mut wanted: Vec<u32> = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            if let Some(kr) = r.top_logprobs {
                wanted.push((i * vocab) as u32 + tokens[i]);
                wanted.extend(top[i * k as usize..][..kr as usize].iter().map(|&t| (i * vocab) as u32 + t));
            }
        }
        let values = self.gather_f32(OP, raw, &wanted)?;
        let mut at = 0;
        let mut picked = Vec::with_capacity(n);
        for (i, r) in rows.iter().enumerate() {
            let Some(kr) = r.top_logprobs else {
                picked.push(Picked { token: tokens[i], logprob: None, top_logprobs: Vec::new() });
                continue;
            };
            let lp = |raw: f32| raw - maxes[i] - lses[i];
            let logprob = Some(lp(values[at]));
            let top_logprobs = (0..kr as usize).map(|j| (top[i * k as usize + j], lp(values[at + 1 + j]))).collect();
            at += 1 + kr as usize;
            picked.push(Picked { token: tokens[i], logprob, top_logprobs });
        }
        Ok(picked)
    }

    /// Blocks a row of `vocab` logits is split over: until the grid fills the GPU twice
    /// over, each split at least PICK_MIN_SPLIT tokens.
    fn pick_splits(&self, rows: usize, vocab: u32) -> usize {
        (2 * self.sm_count).div_ceil(rows).min(vocab as usize / PICK_MIN_SPLIT).clamp(1, PICK_SPLITS_MAX)
    }

    /// Each row's maximum and log-sum-exp, and its `k` largest logits, largest first
    /// (`lse_*` and `topk_*` in sampling.cu: chunks, then a merge per row).
    fn logprob_parts(
        &self,
        op: &'static str,
        raw: &CudaSlice<f32>,
        vocab: u32,
        n: usize,
        k: u32,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>, CudaSlice<u32>)> {
        let splits = self.pick_splits(n, vocab);
        let (n32, splits32) = (n as u32, splits as u32);
        let grid = LaunchConfig { grid_dim: (n32, splits32, 1), block_dim: (PICK_THREADS, 1, 1), shared_mem_bytes: 0 };
        let (mut part_max, mut part_sum) = (self.uninit::<f32>(op, n * splits)?, self.uninit::<f32>(op, n * splits)?);
        let mut l = self.stream.launch_builder(&self.k.pick.lse_parts);
        l.arg(raw).arg(&vocab).arg(&splits32).arg(&mut part_max).arg(&mut part_sum);
        launch(&mut l, grid, op)?;
        let (mut maxes, mut lses) = (self.uninit::<f32>(op, n)?, self.uninit::<f32>(op, n)?);
        let mut l = self.stream.launch_builder(&self.k.pick.lse_merge);
        l.arg(&part_max).arg(&part_sum).arg(&n32).arg(&splits32).arg(&mut maxes).arg(&mut lses);
        launch(&mut l, flat(n), op)?;
        let mut top = self.uninit::<u32>(op, n * k as usize)?;
        if k > 0 {
            let mut cand = self.uninit::<u32>(op, n * splits * k as usize)?;
            let mut l = self.stream.launch_builder(&self.k.pick.topk_parts);
            l.arg(raw).arg(&vocab).arg(&k).arg(&splits32).arg(&mut cand);
            launch(&mut l, grid, op)?;
            let mut l = self.stream.launch_builder(&self.k.pick.topk_merge);
            l.arg(raw).arg(&vocab).arg(&k).arg(&splits32).arg(&cand).arg(&mut top);
            launch(&mut l, per_row(n, PICK_THREADS), op)?;
        }
        Ok((maxes, lses, top))
    }

    /// Each row's token, greedy or drawn (`pick_*` in sampling.cu), each row split over
    /// `pick_splits` blocks; the launches only the batch's rows need.
    fn pick<T: DeviceRepr>(
        &self,
        op: &'static str,
        logits: &CudaSlice<T>,
        kernels: &PickKernels,
        vocab: u32,
        rows: &[PickRow],
    ) -> Result<CudaSlice<u32>> {
        let n = rows.len();
        let splits = self.pick_splits(n, vocab);
        let (n32, splits32) = (n as u32, splits as u32);
        let mut state = self.stream.alloc_zeros::<u64>(n * PICK_STATE_WORDS).map_err(device_err(op))?;
        let grid = LaunchConfig { grid_dim: (n32, splits32, 1), block_dim: (PICK_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut l = self.stream.launch_builder(&kernels.best);
        l.arg(logits).arg(&vocab).arg(&mut state).arg(&splits32);
        launch(&mut l, grid, op)?;
        if rows.iter().any(|r| r.draw.is_some()) {
            // Greedy rows carry temperature 0, which every cut skips.
            let params: Vec<u32> = rows
                .iter()
                .flat_map(|r| match r.draw {
                    Some(d) => {
                        [d.temperature.to_bits(), d.top_k, d.top_p.to_bits(), d.min_p.to_bits(), d.uniform.to_bits()]
                    }
                    None => [0, 0, 1f32.to_bits(), 0, 0],
                })
                .collect();
            let params = self.htod(op, &params)?;
            let needs = |cut: u32, d: &Draw| match cut {
                0 => d.top_k > 0 && d.top_k < vocab,
                1 => d.top_p < 1.0,
                _ => true,
            };
            for cut in 0..3u32 {
                if !rows.iter().any(|r| r.draw.is_some_and(|d| needs(cut, &d))) {
                    continue;
                }
                for pass in 0..kernels.passes {
                    let mut l = self.stream.launch_builder(&kernels.radix);
                    l.arg(logits).arg(&vocab).arg(&params).arg(&mut state).arg(&splits32).arg(&cut).arg(&pass);
                    launch(&mut l, grid, op)?;
                }
                for f in [&kernels.count, &kernels.find] {
                    let mut l = self.stream.launch_builder(f);
                    l.arg(logits).arg(&vocab).arg(&params).arg(&mut state).arg(&splits32).arg(&cut);
                    launch(&mut l, grid, op)?;
                }
            }
        }
        let mut tokens = self.uninit::<u32>(op, n)?;
        let mut l = self.stream.launch_builder(&self.k.pick.tokens);
        l.arg(&state).arg(&n32).arg(&vocab).arg(&mut tokens);
        launch(&mut l, flat(n), op)?;
        Ok(tokens)
    }

    /// A new f32 copy of `b`.
    fn f32_copy(&self, op: &'static str, b: &CudaBuffer) -> Result<CudaSlice<f32>> {
        match &b.0 {
            Data::F32(s) => self.stream.clone_dtod(s).map_err(device_err(op)),
            Data::Bf16(_) => match self.param(op, b)? {
                super::Slice::Owned(s) => Ok(s),
                super::Slice::Borrowed(s) => self.stream.clone_dtod(s).map_err(device_err(op)),
            },
        }
    }

    /// `raw` with each row's penalties and bias applied, as a new buffer.
    fn penalise(&self, op: &'static str, raw: &CudaSlice<f32>, vocab: u32, rows: &[PickRow]) -> Result<CudaSlice<f32>> {
        let mut work = self.stream.clone_dtod(raw).map_err(device_err(op))?;
        let (mut r_idx, mut tok, mut cnt, mut seen) = (vec![], vec![], vec![], vec![]);
        let (mut b_idx, mut b_tok, mut b_val) = (vec![], vec![], vec![]);
        for (i, r) in rows.iter().enumerate() {
            for &(t, c, s) in &r.history {
                r_idx.push(i as u32);
                tok.push(t);
                cnt.push(c);
                seen.push(u32::from(s));
            }
            for &(t, b) in &r.logit_bias {
                b_idx.push(i as u32);
                b_tok.push(t);
                b_val.push(b);
            }
        }
        let each_row = |f: fn(&PickRow) -> f32| -> Vec<f32> { rows.iter().map(f).collect() };
        if !r_idx.is_empty() {
            let up_u = |v: &[u32]| self.htod(op, v);
            let up_f = |v: &[f32]| self.htod(op, v);
            let (ri, ti, ci, si) = (up_u(&r_idx)?, up_u(&tok)?, up_u(&cnt)?, up_u(&seen)?);
            let rep = up_f(&each_row(|r| r.repetition_penalty))?;
            let freq = up_f(&each_row(|r| r.frequency_penalty))?;
            let pres = up_f(&each_row(|r| r.presence_penalty))?;
            let n = r_idx.len() as u32;
            let mut l = self.stream.launch_builder(&self.k.apply_penalties);
            l.arg(&mut work).arg(&vocab).arg(&ri).arg(&ti).arg(&ci).arg(&si).arg(&rep).arg(&freq).arg(&pres).arg(&n);
            launch(&mut l, flat(r_idx.len()), op)?;
        }
        if !b_idx.is_empty() {
            let (ri, ti, vi) = (self.htod(op, &b_idx)?, self.htod(op, &b_tok)?, self.htod(op, &b_val)?);
            let n = b_idx.len() as u32;
            let mut l = self.stream.launch_builder(&self.k.add_at);
            l.arg(&mut work).arg(&vocab).arg(&ri).arg(&ti).arg(&vi).arg(&n);
            launch(&mut l, flat(b_idx.len()), op)?;
        }
        Ok(work)
    }

    /// `src[at[i]]` for each i, on the host.
    fn gather_f32(&self, op: &'static str, src: &CudaSlice<f32>, at: &[u32]) -> Result<Vec<f32>> {
        if at.is_empty() {
            return Ok(Vec::new());
        }
        let idx = self.htod(op, at)?;
        let mut out = self.uninit::<f32>(op, at.len())?;
        let n = at.len() as u64;
        let mut l = self.stream.launch_builder(&self.k.gather_f32);
        l.arg(&mut out).arg(src).arg(&idx).arg(&n);
        launch(&mut l, flat(at.len()), op)?;
        self.stream.clone_dtoh(&out).map_err(device_err(op))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state's size here is the one the kernels index: sampling.cu's defines.
    #[test]
    fn pick_state_layout_matches_sampling_cu() {
        let source = include_str!("../../cuda/sampling.cu");
        let define = |name: &str| -> usize {
            let line = source.lines().find(|l| l.starts_with(&format!("#define {name} "))).unwrap();
            line.split_whitespace().nth(2).unwrap().parse().unwrap_or_else(|_| panic!("{line}"))
        };
        let (splits, cuts, passes, bins) =
            (define("PICK_SPLITS_MAX"), define("PICK_CUTS"), define("PICK_PASSES_MAX"), define("SAMPLE_BINS"));
        assert_eq!(splits, PICK_SPLITS_MAX);
        assert_eq!(PICK_STATE_WORDS, define("PW_COUNTS") + cuts * splits / 2 + cuts * passes * bins);
        assert!(source.contains("#define PW_HIST (PW_COUNTS + PICK_CUTS * PICK_SPLITS_MAX / 2)"));
        assert!(source.contains("#define PICK_STATE_WORDS (PW_HIST + PICK_CUTS * PICK_PASSES_MAX * SAMPLE_BINS)"));
    }
}
