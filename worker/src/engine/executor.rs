//! What runs the engine's batches: one model over its KV cache, or a tensor-parallel
//! group, one thread per rank, each with its shard of the weights and of the KV cache
//! (its KV heads of every block). The engine's thread hands every rank the same batch
//! and takes rank 0's logits; the ranks meet in their all-reduces.

use crate::model::{Embeds, Forwarded, KvCache, Model, ModelConfig, ModelError, SeqInput};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use tessera_kernels::Backend;
use tessera_kernels::pick::PickRow;
use tessera_proto::block_hash::BLOCK_TOKENS;

pub enum Executor<B: Backend> {
    Single { model: Model<B>, kv: KvCache<B> },
    Parallel(TensorParallel),
}

impl<B: Backend + 'static> Executor<B> {
    /// One model, its KV cache of `num_blocks` (plus a scratch block for padded graph
    /// rows) and its decode graphs.
    pub fn single(model: Model<B>, num_blocks: usize, graph_sizes: &[usize]) -> Result<Self, ModelError> {
        let kv = cache_with_graphs(&model, num_blocks, graph_sizes)?;
        Ok(Executor::Single { model, kv })
    }

    /// The ranks of a tensor-parallel group, rank 0 first.
    pub fn parallel(ranks: Vec<Model<B>>, num_blocks: usize, graph_sizes: &[usize]) -> Result<Self, ModelError> {
        Ok(Executor::Parallel(TensorParallel::spawn(ranks, num_blocks, graph_sizes)?))
    }
}

impl<B: Backend> Executor<B> {
    /// The model's shape (heads and MLP: rank 0's share).
    pub fn config(&self) -> &ModelConfig {
        match self {
            Executor::Single { model, .. } => &model.config,
            Executor::Parallel(tp) => &tp.config,
        }
    }

    pub fn forward(&mut self, seqs: &[SeqInput<'_>]) -> Result<Vec<f32>, ModelError> {
        match self {
            Executor::Single { model, kv } => model.forward(seqs, kv),
            Executor::Parallel(tp) => tp.forward(seqs, &[]),
        }
    }

    /// `forward` with every row of the sequences `all_rows` marks (`Model::forward_scoring`).
    pub fn forward_scoring(&mut self, seqs: &[SeqInput<'_>], all_rows: &[bool]) -> Result<Vec<f32>, ModelError> {
        match self {
            Executor::Single { model, kv } => model.forward_scoring(seqs, kv, all_rows),
            Executor::Parallel(tp) => tp.forward(seqs, all_rows),
        }
    }

    /// `forward` with each sampled row's pick: made on the device where the backend can (a
    /// tensor-parallel group hands back rank 0's logits instead).
    pub fn forward_picking(&mut self, seqs: &[SeqInput<'_>], rows: &[PickRow]) -> Result<Forwarded, ModelError> {
        match self {
            Executor::Single { model, kv } => model.forward_picking(seqs, kv, rows),
            Executor::Parallel(tp) => Ok(Forwarded::Logits(tp.forward(seqs, &[])?)),
        }
    }
}

impl<B: Backend> Executor<B> {
    /// Blocks `ids` of the KV cache as stored (each rank's share of a block, rank 0
    /// first): what the second KV tier keeps of a block the pool evicts.
    pub fn save_blocks(&mut self, ids: &[u32]) -> Result<Vec<Vec<u8>>, ModelError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        match self {
            Executor::Single { model, kv } => model.save_kv_blocks(kv, ids),
            Executor::Parallel(tp) => tp.save_blocks(ids),
        }
    }

    /// Writes blocks `save_blocks` gave back into blocks `ids`.
    pub fn load_blocks(&mut self, ids: &[u32], data: &[Arc<Vec<u8>>]) -> Result<(), ModelError> {
        if ids.is_empty() {
            return Ok(());
        }
        match self {
            Executor::Single { model, kv } => {
                let blocks: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
                model.load_kv_blocks(kv, ids, &blocks)
            }
            Executor::Parallel(tp) => tp.load_blocks(ids, data),
        }
    }
}

/// A KV cache of `num_blocks` for `model`, a scratch block past them for padded graph
/// rows, and its decode graphs of `graph_sizes` where the backend captures them.
pub(super) fn cache_with_graphs<B: Backend>(
    model: &Model<B>,
    num_blocks: usize,
    graph_sizes: &[usize],
) -> Result<KvCache<B>, ModelError> {
    let mut kv = model.new_kv_cache(num_blocks + 1, BLOCK_TOKENS)?;
    model.capture_decode_graphs(&mut kv, num_blocks as u32, graph_sizes)?;
    Ok(kv)
}

/// A batch as the rank threads receive it.
struct OwnedSeq {
    tokens: Vec<u32>,
    cached: usize,
    block_table: Vec<u32>,
    logits: bool,
    all_rows: bool,
    /// Image rows: where they go in `tokens`, and the rows.
    embeds: Vec<(usize, Vec<f32>)>,
}

/// What the engine's thread asks of every rank.
enum Job {
    Forward(Arc<Vec<OwnedSeq>>),
    /// Its share of KV blocks, as stored.
    Save(Vec<u32>),
    /// Saved blocks' bytes (every rank's share, each the same length, rank 0 first)
    /// into blocks.
    Load(Vec<u32>, Vec<Arc<Vec<u8>>>),
}

struct Rank {
    jobs: Option<Sender<Job>>,
    /// Logits of a forward (rank 0's count), or a saved share of a block.
    results: Receiver<Result<Vec<f32>, ModelError>>,
    saved: Receiver<Result<Vec<Vec<u8>>, ModelError>>,
    thread: Option<JoinHandle<()>>,
}

pub struct TensorParallel {
    config: ModelConfig,
    ranks: Vec<Rank>,
}

impl TensorParallel {
    fn spawn<B: Backend + 'static>(
        models: Vec<Model<B>>,
        num_blocks: usize,
        graph_sizes: &[usize],
    ) -> Result<Self, ModelError> {
        let config = models.first().ok_or_else(|| ModelError::Input("no ranks".into()))?.config.clone();
        let count = models.len();
        let ranks: Vec<Rank> = models
            .into_iter()
            .enumerate()
            .map(|(i, model)| {
                let (job_tx, job_rx) = channel::<Job>();
                let (result_tx, result_rx) = channel();
                let (saved_tx, saved_rx) = channel();
                let sizes = graph_sizes.to_vec();
                let (rank, ranks) = (i, count);
                let thread = std::thread::Builder::new()
                    .name(format!("tp-rank-{i}"))
                    .spawn(move || rank_loop(model, num_blocks, &sizes, job_rx, (result_tx, saved_tx), (rank, ranks)))
                    .map_err(|e| ModelError::Input(format!("starting rank {i}: {e}")))?;
                Ok(Rank { jobs: Some(job_tx), results: result_rx, saved: saved_rx, thread: Some(thread) })
            })
            .collect::<Result<_, ModelError>>()?;
        let tp = TensorParallel { config, ranks };
        // Each rank reports once its cache (and graphs, captured together) is ready.
        tp.collect()?;
        Ok(tp)
    }

    fn forward(&mut self, seqs: &[SeqInput<'_>], all_rows: &[bool]) -> Result<Vec<f32>, ModelError> {
        let batch: Arc<Vec<OwnedSeq>> = Arc::new(
            seqs.iter()
                .enumerate()
                .map(|(i, s)| OwnedSeq {
                    tokens: s.tokens.to_vec(),
                    cached: s.cached,
                    block_table: s.block_table.to_vec(),
                    logits: s.logits,
                    all_rows: all_rows.get(i).copied().unwrap_or(false),
                    embeds: s.embeds.iter().map(|e| (e.at, e.rows.to_vec())).collect(),
                })
                .collect(),
        );
        self.send(|| Job::Forward(batch.clone()))?;
        self.collect()
    }

    fn send(&self, job: impl Fn() -> Job) -> Result<(), ModelError> {
        for r in &self.ranks {
            let sent = r.jobs.as_ref().is_some_and(|tx| tx.send(job()).is_ok());
            if !sent {
                return Err(ModelError::Input("a tensor-parallel rank has stopped".into()));
            }
        }
        Ok(())
    }

    /// Every rank's share of each block, concatenated, rank 0 first.
    fn save_blocks(&mut self, ids: &[u32]) -> Result<Vec<Vec<u8>>, ModelError> {
        self.send(|| Job::Save(ids.to_vec()))?;
        let mut out = vec![Vec::new(); ids.len()];
        let mut error = None;
        for r in &self.ranks {
            match r.saved.recv() {
                Ok(Ok(shares)) => out.iter_mut().zip(shares).for_each(|(block, share)| block.extend_from_slice(&share)),
                Ok(Err(e)) => {
                    error.get_or_insert(e);
                }
                Err(_) => {
                    error.get_or_insert(ModelError::Input("a tensor-parallel rank has stopped".into()));
                }
            }
        }
        error.map_or(Ok(out), Err)
    }

    fn load_blocks(&mut self, ids: &[u32], data: &[Arc<Vec<u8>>]) -> Result<(), ModelError> {
        self.send(|| Job::Load(ids.to_vec(), data.to_vec()))?;
        self.collect().map(drop)
    }

    /// Every rank's answer; rank 0's logits, or the first error.
    fn collect(&self) -> Result<Vec<f32>, ModelError> {
        let mut first = None;
        let mut error = None;
        for r in &self.ranks {
            match r.results.recv() {
                Ok(Ok(logits)) => {
                    first.get_or_insert(logits);
                }
                Ok(Err(e)) => {
                    error.get_or_insert(e);
                }
                Err(_) => {
                    error.get_or_insert(ModelError::Input("a tensor-parallel rank has stopped".into()));
                }
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(first.unwrap_or_default()),
        }
    }
}

type RankAnswers = (Sender<Result<Vec<f32>, ModelError>>, Sender<Result<Vec<Vec<u8>>, ModelError>>);

fn rank_loop<B: Backend>(
    model: Model<B>,
    num_blocks: usize,
    graph_sizes: &[usize],
    jobs: Receiver<Job>,
    (results, saved): RankAnswers,
    (rank, ranks): (usize, usize),
) {
    let mut kv = match cache_with_graphs(&model, num_blocks, graph_sizes) {
        Ok(kv) => kv,
        Err(e) => {
            model.abort_group();
            let _ = results.send(Err(e));
            return;
        }
    };
    if results.send(Ok(Vec::new())).is_err() {
        return;
    }
    while let Ok(job) = jobs.recv() {
        let batch = match job {
            Job::Forward(batch) => batch,
            Job::Save(ids) => {
                if saved.send(model.save_kv_blocks(&kv, &ids)).is_err() {
                    return;
                }
                continue;
            }
            Job::Load(ids, data) => {
                let shares: Vec<&[u8]> = data
                    .iter()
                    .map(|d| {
                        let share = d.len() / ranks;
                        &d[rank * share..(rank + 1) * share]
                    })
                    .collect();
                let loaded = model.load_kv_blocks(&mut kv, &ids, &shares);
                if results.send(loaded.map(|()| Vec::new())).is_err() {
                    return;
                }
                continue;
            }
        };
        let embeds: Vec<Vec<Embeds<'_>>> =
            batch.iter().map(|s| s.embeds.iter().map(|(at, rows)| Embeds { at: *at, rows }).collect()).collect();
        let seqs: Vec<SeqInput<'_>> = batch
            .iter()
            .zip(&embeds)
            .map(|(s, embeds)| SeqInput {
                tokens: &s.tokens,
                cached: s.cached,
                block_table: &s.block_table,
                logits: s.logits,
                embeds,
            })
            .collect();
        let all_rows: Vec<bool> = batch.iter().map(|s| s.all_rows).collect();
        let out = if all_rows.contains(&true) {
            model.forward_scoring(&seqs, &mut kv, &all_rows)
        } else {
            model.forward(&seqs, &mut kv)
        };
        if out.is_err() {
            // The other ranks may be waiting for this one in an all-reduce.
            model.abort_group();
        }
        if results.send(out).is_err() {
            return;
        }
    }
}

impl Drop for TensorParallel {
    fn drop(&mut self) {
        for r in &mut self.ranks {
            r.jobs = None;
        }
        for r in &mut self.ranks {
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }
}
