//! Picking tokens on the GPU: penalties, logit bias, the greedy argmax or a sampled
//! draw (temperature, top-k, top-p, min-p), and the log-probabilities computed where
//! the logits are, so only a few numbers per row cross to the host instead of the
//! whole `[rows, vocab]` matrix.

use super::{CudaBackend, CudaBuffer, Data, device_err, flat, launch, per_row};
use crate::error::expect_len;
use crate::pick::{Draw, MAX_TOP_LOGPROBS, PickRow, Picked};
use crate::{KernelError, Result};
use cudarc::driver::{CudaSlice, PushKernelArg};

const ROW_THREADS: u32 = 1024;

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
        // The raw logits in f32: log-probabilities are read from them, the pick from a
        // penalised copy.
        let raw = self.f32_copy(OP, logits)?;
        let want_logprobs = rows.iter().any(|r| r.top_logprobs.is_some());
        let (mut maxes, mut lses) = (self.zeros_f32(OP, n)?, self.zeros_f32(OP, n)?);
        let k = rows.iter().filter_map(|r| r.top_logprobs).max().unwrap_or(0);
        let mut top = self.stream.alloc_zeros::<u32>((n * k as usize).max(1)).map_err(device_err(OP))?;
        if want_logprobs {
            let mut l = self.stream.launch_builder(&self.k.row_max_lse);
            l.arg(&raw).arg(&v).arg(&mut maxes).arg(&mut lses);
            launch(&mut l, per_row(n, ROW_THREADS), OP)?;
            if k > 0 {
                let mut l = self.stream.launch_builder(&self.k.row_topk);
                l.arg(&raw).arg(&v).arg(&k).arg(&mut top);
                launch(&mut l, per_row(n, ROW_THREADS), OP)?;
            }
        }
        let penalised = rows.iter().any(|r| !r.history.is_empty() || !r.logit_bias.is_empty());
        let work = if penalised { Some(self.penalise(OP, &raw, v, rows)?) } else { None };
        let mut tokens = self.stream.alloc_zeros::<u32>(n).map_err(device_err(OP))?;
        let mut l = self.stream.launch_builder(&self.k.row_argmax);
        l.arg(work.as_ref().unwrap_or(&raw)).arg(&v).arg(&mut tokens);
        launch(&mut l, per_row(n, ROW_THREADS), OP)?;
        if rows.iter().any(|r| r.draw.is_some()) {
            // Greedy rows carry temperature 0, and the kernel leaves their argmax as it is.
            let draw = |f: fn(&Draw) -> f32, off: f32| -> Vec<f32> {
                rows.iter().map(|r| r.draw.as_ref().map_or(off, f)).collect()
            };
            let temperature = self.htod(OP, &draw(|d| d.temperature, 0.0))?;
            let top_k: Vec<u32> = rows.iter().map(|r| r.draw.map_or(0, |d| d.top_k)).collect();
            let top_k = self.htod(OP, &top_k)?;
            let top_p = self.htod(OP, &draw(|d| d.top_p, 1.0))?;
            let min_p = self.htod(OP, &draw(|d| d.min_p, 0.0))?;
            let uniform = self.htod(OP, &draw(|d| d.uniform, 0.0))?;
            let mut l = self.stream.launch_builder(&self.k.row_sample);
            l.arg(work.as_ref().unwrap_or(&raw)).arg(&v).arg(&temperature).arg(&top_k).arg(&top_p);
            l.arg(&min_p).arg(&uniform).arg(&mut tokens);
            launch(&mut l, per_row(n, ROW_THREADS), OP)?;
        }

        let tokens = self.stream.clone_dtoh(&tokens).map_err(device_err(OP))?;
        let (maxes, lses, top) = if want_logprobs {
            (
                self.stream.clone_dtoh(&maxes).map_err(device_err(OP))?,
                self.stream.clone_dtoh(&lses).map_err(device_err(OP))?,
                self.stream.clone_dtoh(&top).map_err(device_err(OP))?,
            )
        } else {
            (Vec::new(), Vec::new(), Vec::new())
        };
        // The raw logits of the picked and the top tokens, gathered on the host side
        // from a small download rather than the whole matrix.
        let mut wanted: Vec<u32> = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            if let Some(kr) = r.top_logprobs {
                wanted.push((i * vocab) as u32 + tokens[i]);
                wanted.extend(top[i * k as usize..][..kr as usize].iter().map(|&t| (i * vocab) as u32 + t));
            }
        }
        let values = self.gather_f32(OP, &raw, &wanted)?;
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

    fn zeros_f32(&self, op: &'static str, n: usize) -> Result<CudaSlice<f32>> {
        self.stream.alloc_zeros::<f32>(n.max(1)).map_err(device_err(op))
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
        let mut out = self.stream.alloc_zeros::<f32>(at.len()).map_err(device_err(op))?;
        let n = at.len() as u64;
        let mut l = self.stream.launch_builder(&self.k.gather_f32);
        l.arg(&mut out).arg(src).arg(&idx).arg(&n);
        launch(&mut l, flat(at.len()), op)?;
        self.stream.clone_dtoh(&out).map_err(device_err(op))
    }
}
