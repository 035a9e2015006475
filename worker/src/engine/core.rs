//! The engine loop's body, synchronous: admit requests, run one step (schedule →
//! forward → sample → detokenize → finish), report what each sequence produced.
//! A thread that owns an `EngineCore` and talks to the async world through channels
//! is all a server needs around it.

use super::detokenizer::Detokenizer;
use super::executor::Executor;
use super::grammar::Constraint;
use super::pacing::Pacer;
use super::sampler::{PromptScore, Sampled, SamplerState, SamplingParams, sample_batch, score_rows};
use super::scheduler::{Scheduler, SchedulerConfig, Step};
use super::sequence::{SeqId, Sequence};
use super::thinking::{Thinking, ThinkingBudget};
use crate::model::{Embeds, Forwarded, Model, ModelConfig, ModelError, SeqInput};
use crate::tokenizer::ModelTokenizer;
use crate::vision::placement::PlacedImages;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tessera_kernels::Backend;
use tessera_kernels::pick::PickRow;
use tessera_proto::block_hash::BlockHasher;

/// Most alternatives a token's log-probabilities may list (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;
/// Most completions one request may ask for (OpenAI's limit).
pub const MAX_N: usize = 128;
/// A constrained output this close to its limit is steered to finish in time.
const FINISH_WATCH: usize = 128;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    /// KV-cache blocks of `BLOCK_TOKENS` tokens.
    pub num_blocks: usize,
    /// Decode batch sizes captured as graphs at start-up where the backend can (CUDA);
    /// a decode batch runs padded to the nearest one at or above it.
    pub graph_batch_sizes: Vec<usize>,
    /// While others decode, a step with prompt chunks takes at most this percentage of
    /// a decode step's time (measured; `pacing`); 0: only `max_num_batched_tokens`.
    pub prompt_step_percent: u32,
}

/// A step with prompt chunks takes at most two and a half decode steps' time: the gap
/// between two tokens of a stream stays within 4× its median (issue 25's bound) with
/// room for the noise of step times (at 300 % the 99th percentile reached 3.5-4.6× on
/// this project's 2-core machines). Prompts beside decodes lose little by it: their
/// share of such a step goes from 2/3 to 3/5.
pub const DEFAULT_PROMPT_STEP_PERCENT: u32 = 250;

/// vLLM's default capture sizes, up to 256.
pub const DEFAULT_GRAPH_BATCH_SIZES: [usize; 11] = [1, 2, 4, 8, 16, 24, 32, 64, 128, 192, 256];

impl EngineConfig {
    /// The graph sizes worth capturing: none above `max_num_seqs`.
    fn graph_sizes(&self) -> Vec<usize> {
        self.graph_batch_sizes.iter().copied().filter(|&s| s <= self.max_num_seqs).collect()
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            num_blocks: 2048,
            graph_batch_sizes: DEFAULT_GRAPH_BATCH_SIZES.to_vec(),
            prompt_step_percent: DEFAULT_PROMPT_STEP_PERCENT,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub id: SeqId,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub stop: Vec<String>,
    /// Keep going past the model's end-of-sequence token.
    pub ignore_eos: bool,
    /// End tokens and stop strings take effect only after this many output tokens.
    pub min_tokens: usize,
    /// A matched stop string stays at the end of the text.
    pub include_stop_str_in_output: bool,
    /// Special tokens' text is left out of the output.
    pub skip_special_tokens: bool,
    /// Completions of the same prompt; they share the prompt's KV blocks.
    pub n: usize,
    /// The grammar the output must match, compiled (`Grammars::matcher`); each of the
    /// `n` completions follows its own copy.
    pub grammar: Option<Constraint>,
    /// Reasoning is watched and ended when its budget is spent.
    pub thinking: Option<ThinkingBudget>,
    /// Score the prompt's tokens too, with this many top alternatives each (0..=20).
    /// `max_tokens` may then be 0: the prompt is scored and nothing generated.
    pub prompt_logprobs: Option<u32>,
    /// The prompt's images, encoded and placed over their placeholder tokens.
    pub images: Option<Arc<PlacedImages>>,
}

impl Request {
    pub fn greedy(id: SeqId, prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            id,
            prompt,
            params: SamplingParams::greedy(),
            max_tokens,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            n: 1,
            grammar: None,
            thinking: None,
            prompt_logprobs: None,
            images: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End of sequence, a stop token or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
    Abort,
}

impl FinishReason {
    /// As the metrics label it (vLLM's `finished_reason`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// What one step produced for one completion of a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// The request's id.
    pub id: SeqId,
    /// Which of the request's `n` completions.
    pub index: usize,
    /// The request's last output: every completion has finished.
    pub last: bool,
    /// The token sampled this step (none for an abort).
    pub token: Option<Sampled>,
    /// Text completed this step.
    pub text: String,
    pub finish: Option<FinishReason>,
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_prompt_tokens: usize,
    /// The prompt's tokens after its first, scored: on the request's first output, when
    /// it asked for them.
    pub prompt_logprobs: Vec<PromptScore>,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    InvalidRequest(String),
    /// Prompt and `max_tokens` do not fit the usable context (`EngineCore::max_model_len`).
    #[error("{0}")]
    ContextLength(String),
    #[error("request {0} already exists")]
    DuplicateId(SeqId),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Detokenize(#[from] super::detokenizer::DetokenizeError),
    #[error("the engine has stopped")]
    Stopped,
}

/// One completion's state; the scheduler knows it by its own sequence id.
struct RequestState {
    request: SeqId,
    index: usize,
    sampler: SamplerState,
    detok: Detokenizer,
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    /// End tokens are banned, and stop strings not looked for, before this many tokens.
    min_tokens: usize,
    thinking: Option<Thinking>,
    /// Alternatives per scored prompt token, for the completion that scores the prompt.
    prompt_logprobs: Option<u32>,
    /// Scores by prompt position (position 0 has none), filled chunk by chunk.
    prompt_scores: Vec<Option<PromptScore>>,
}

/// Counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub steps: u64,
    pub preemptions: u64,
    pub prompt_tokens_computed: u64,
    pub output_tokens: u64,
}

pub struct EngineCore<B: Backend> {
    exec: Executor<B>,
    tokenizer: ModelTokenizer,
    scheduler: Scheduler,
    /// By sequence id.
    requests: HashMap<SeqId, RequestState>,
    /// Request id → its live sequences.
    families: HashMap<SeqId, Vec<SeqId>>,
    next_seq: SeqId,
    eos: Vec<u32>,
    stats: EngineStats,
    last_step: StepSummary,
    /// How many prompt tokens a step may take while others decode.
    pacer: Pacer,
}

/// What the last step computed, for the engine's metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepSummary {
    /// Tokens computed: prompt chunks and decodes.
    pub tokens: usize,
    /// The requests it computed part of (each once).
    pub requests: Vec<SeqId>,
}

impl<B: Backend + 'static> EngineCore<B> {
    pub fn new(
        model: Model<B>,
        tokenizer: ModelTokenizer,
        config: EngineConfig,
        model_name: &str,
    ) -> Result<Self, EngineError> {
        let exec = Executor::single(model, config.num_blocks, &config.graph_sizes())?;
        Self::with_executor(exec, tokenizer, config, model_name)
    }

    /// An engine over the ranks of a tensor-parallel group (rank 0 first).
    pub fn tensor_parallel(
        ranks: Vec<Model<B>>,
        tokenizer: ModelTokenizer,
        config: EngineConfig,
        model_name: &str,
    ) -> Result<Self, EngineError> {
        let exec = Executor::parallel(ranks, config.num_blocks, &config.graph_sizes())?;
        Self::with_executor(exec, tokenizer, config, model_name)
    }
}

impl<B: Backend> EngineCore<B> {
    fn with_executor(
        exec: Executor<B>,
        tokenizer: ModelTokenizer,
        config: EngineConfig,
        model_name: &str,
    ) -> Result<Self, EngineError> {
        let scheduler = Scheduler::new(
            SchedulerConfig {
                max_num_batched_tokens: config.max_num_batched_tokens,
                max_num_seqs: config.max_num_seqs,
                num_blocks: config.num_blocks,
            },
            BlockHasher::new(model_name),
        );
        let eos = tokenizer.eos.iter().map(|t| t.id).collect();
        Ok(Self {
            exec,
            tokenizer,
            scheduler,
            requests: HashMap::new(),
            families: HashMap::new(),
            next_seq: 0,
            eos,
            stats: EngineStats::default(),
            last_step: StepSummary::default(),
            pacer: Pacer::new(config.prompt_step_percent),
        })
    }

    /// The longest sequence (prompt and output) a request may reach: the model's
    /// context, or what the KV cache holds if less. Every admitted sequence then fits
    /// the cache alone, which the scheduler's progress guarantee rests on (as vLLM
    /// refuses a `max_model_len` its cache cannot hold; here the context is capped).
    pub fn max_model_len(&self) -> usize {
        self.exec.config().context_length.min(self.scheduler.capacity_tokens())
    }

    /// The usable context, and why when it is less than the model's.
    fn context_note(&self) -> String {
        let (limit, model) = (self.max_model_len(), self.exec.config().context_length);
        if limit < model {
            format!("the context is {limit} tokens, all this replica's KV cache holds (the model's own is {model})")
        } else {
            format!("the model's context is {limit} tokens")
        }
    }

    /// The model's shape (with tensor parallelism, one rank's heads and MLP).
    pub fn config(&self) -> &ModelConfig {
        self.exec.config()
    }

    pub fn tokenizer(&self) -> &ModelTokenizer {
        &self.tokenizer
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// What the last `step` computed (nothing if it had no work).
    pub fn last_step(&self) -> &StepSummary {
        &self.last_step
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Prefix-cache changes since the last call.
    pub fn take_kv_events(&mut self) -> super::block_pool::KvEvents {
        self.scheduler.take_kv_events()
    }

    /// Checks a request and queues its `n` sequences; the second and later wait until
    /// the first has computed the prompt, then start from its cached blocks.
    pub fn add_request(&mut self, req: Request) -> Result<(), EngineError> {
        self.validate(&req)?;
        if self.families.contains_key(&req.id) {
            return Err(EngineError::DuplicateId(req.id));
        }
        let mut members = Vec::with_capacity(req.n);
        for index in 0..req.n {
            let seq_id = self.next_seq;
            self.next_seq += 1;
            // Each completion draws its own numbers from the request's seed.
            let params =
                SamplingParams { seed: req.params.seed.map(|s| s.wrapping_add(index as u64)), ..req.params.clone() };
            let mut sampler = SamplerState::new(params, &req.prompt);
            sampler.constraint = req.grammar.as_ref().map(Constraint::fork);
            sampler.ends = req.stop_token_ids.clone();
            if !req.ignore_eos {
                sampler.ends.extend(&self.eos);
            }
            self.requests.insert(
                seq_id,
                RequestState {
                    request: req.id,
                    index,
                    sampler,
                    detok: Detokenizer::new(&req.prompt, req.stop.clone())
                        .stops_after(req.min_tokens)
                        .keeping_stop(req.include_stop_str_in_output)
                        .skipping_special(req.skip_special_tokens),
                    max_tokens: req.max_tokens,
                    stop_token_ids: req.stop_token_ids.clone(),
                    ignore_eos: req.ignore_eos,
                    min_tokens: req.min_tokens,
                    thinking: req.thinking.clone().map(Thinking::new),
                    // The first completion scores the prompt; the others find it cached.
                    prompt_logprobs: req.prompt_logprobs.filter(|_| index == 0),
                    prompt_scores: Vec::new(),
                },
            );
            let after = members.first().copied();
            let score_prompt = index == 0 && req.prompt_logprobs.is_some();
            let images = req.images.clone();
            self.scheduler.add(Sequence { after, score_prompt, images, ..Sequence::new(seq_id, req.prompt.clone()) });
            members.push(seq_id);
        }
        self.families.insert(req.id, members);
        Ok(())
    }

    fn validate(&self, req: &Request) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        let too_long = |m: String| Err(EngineError::ContextLength(m));
        let (context, vocab) = (self.max_model_len(), self.exec.config().vocab_size);
        if req.prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        if req.prompt.len() >= context {
            return too_long(format!("the prompt has {} tokens; {}", req.prompt.len(), self.context_note()));
        }
        if req.n == 0 || req.n > MAX_N {
            return bad(format!("n is {}; it must be between 1 and {MAX_N}", req.n));
        }
        if req.max_tokens == 0 && req.prompt_logprobs.is_none() {
            return bad("max_tokens must be at least 1 (or 0 with prompt log-probabilities)".into());
        }
        if let Some(k) = req.prompt_logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return bad(format!("prompt_logprobs is {k}; at most {MAX_TOP_LOGPROBS}"));
        }
        // Each of the `n` completions must fit on its own, no more: they share the
        // prompt's blocks, and under pressure they run one after another.
        if req.prompt.len() + req.max_tokens > context {
            return too_long(format!(
                "max_tokens {} plus the prompt's {} tokens exceed the context: {}",
                req.max_tokens,
                req.prompt.len(),
                self.context_note()
            ));
        }
        if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return bad(format!("prompt token id {t} is outside the vocabulary of {vocab}"));
        }
        if let Some((t, _)) = req.params.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
            return bad(format!("logit_bias token id {t} is outside the vocabulary of {vocab}"));
        }
        if let Some((t, b)) = req.params.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return bad(format!("logit_bias for token {t} is {b}; it must be between -100 and 100"));
        }
        if let Some(k) = req.params.logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return bad(format!("top_logprobs is {k}; at most {MAX_TOP_LOGPROBS}"));
        }
        if req.stop.len() > MAX_STOP_STRINGS {
            return bad(format!("{} stop strings; at most {MAX_STOP_STRINGS}", req.stop.len()));
        }
        if let Some(t) = &req.thinking {
            t.check().or_else(bad)?;
            if let Some(id) = t.close_tokens.iter().find(|&&id| id as usize >= vocab) {
                return bad(format!("thinking close token id {id} is outside the vocabulary of {vocab}"));
            }
        }
        let p = &req.params;
        if !(p.temperature >= 0.0 && p.temperature.is_finite()) {
            return bad(format!("temperature {} must be 0 or more", p.temperature));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return bad(format!("top_p {} must be in (0, 1]", p.top_p));
        }
        if !(0.0..=1.0).contains(&p.min_p) {
            return bad(format!("min_p {} must be in [0, 1]", p.min_p));
        }
        if !(p.repetition_penalty > 0.0 && p.repetition_penalty.is_finite()) {
            return bad(format!("repetition_penalty {} must be positive", p.repetition_penalty));
        }
        Ok(())
    }

    /// Ends a request now, every completion of it; their blocks return to the pool at
    /// once. Returns one output per completion still running (none if it was unknown).
    pub fn abort(&mut self, id: SeqId) -> Vec<Output> {
        let members = self.families.remove(&id).unwrap_or_default();
        let count = members.len();
        members
            .into_iter()
            .enumerate()
            .filter_map(|(i, seq_id)| {
                let state = self.requests.remove(&seq_id)?;
                let seq = self.scheduler.remove(seq_id)?;
                Some(Output {
                    id,
                    index: state.index,
                    last: i + 1 == count,
                    token: None,
                    text: String::new(),
                    finish: Some(FinishReason::Abort),
                    prompt_tokens: seq.prompt_len,
                    cached_prompt_tokens: seq.num_cached_prompt,
                    prompt_logprobs: Vec::new(),
                })
            })
            .collect()
    }

    /// Runs one forward over the scheduled batch and returns each sampled sequence's
    /// output. Returns nothing when there is no work.
    pub fn step(&mut self) -> Result<Vec<Output>, EngineError> {
        let step = self.scheduler.schedule_paced(self.pacer.prompt_tokens(self.scheduler.decoding()));
        self.stats.preemptions += step.preempted.len() as u64;
        let mut requests: Vec<SeqId> =
            step.scheduled.iter().filter_map(|s| self.requests.get(&s.id).map(|r| r.request)).collect();
        requests.sort_unstable();
        requests.dedup();
        self.last_step = StepSummary { tokens: step.scheduled.iter().map(|s| s.len).sum(), requests };
        let mut outputs = self.end_exhausted(&step.exhausted);
        if step.scheduled.is_empty() {
            return Ok(outputs);
        }
        self.stats.steps += 1;
        // Each sampled sequence's rule for this step: its thinking budget's, and near
        // its limit, a grammar's output must finish in time.
        let context = self.max_model_len();
        for s in step.scheduled.iter().filter(|s| s.sample) {
            let (Some(r), Some(seq)) = (self.requests.get_mut(&s.id), self.scheduler.get(s.id)) else { continue };
            let mut rule = r.thinking.as_mut().map(Thinking::rule).unwrap_or_default();
            rule.ends_banned |= seq.num_output() < r.min_tokens;
            let answering = !r.thinking.as_ref().is_some_and(Thinking::inside);
            let remaining = r.max_tokens.saturating_sub(seq.num_output()).min(context - seq.tokens.len());
            if r.sampler.constraint.is_some() && answering && remaining <= FINISH_WATCH {
                rule.finish_within = Some(remaining);
            }
            r.sampler.rule = rule;
        }
        // Chunks of a prompt being scored return the logits of every row.
        let scoring: Vec<bool> = step
            .scheduled
            .iter()
            .map(|s| {
                let scores = self.requests.get(&s.id).is_some_and(|r| r.prompt_logprobs.is_some());
                scores && self.scheduler.get(s.id).is_some_and(|q| s.start < q.prompt_len)
            })
            .collect();
        let scoring_any = scoring.contains(&true);
        // When no sampled row follows a grammar (or is forced) the device may pick the
        // tokens itself.
        let device_rows: Option<Vec<PickRow>> = if scoring_any {
            None
        } else {
            step.scheduled
                .iter()
                .filter(|s| s.sample)
                .map(|s| self.requests.get_mut(&s.id).and_then(|r| r.sampler.device_row()))
                .collect()
        };
        let started = Instant::now();
        let forwarded = {
            // Image rows for the chunks that cover placeholders (none past the prompt).
            let embeds: Vec<Vec<Embeds<'_>>> = step
                .scheduled
                .iter()
                .map(|s| {
                    let seq = self.scheduler.get(s.id).expect("scheduled sequences exist");
                    match &seq.images {
                        Some(images) if s.start < seq.prompt_len => images.chunk(s.start, s.start + s.len),
                        _ => Vec::new(),
                    }
                })
                .collect();
            let inputs: Vec<SeqInput<'_>> = step
                .scheduled
                .iter()
                .zip(&embeds)
                .map(|(s, embeds)| {
                    let seq = self.scheduler.get(s.id).expect("scheduled sequences exist");
                    SeqInput {
                        tokens: &seq.tokens[s.start..s.start + s.len],
                        cached: s.start,
                        block_table: &seq.block_table,
                        logits: s.sample,
                        embeds,
                    }
                })
                .collect();
            match &device_rows {
                Some(rows) => self.exec.forward_picking(&inputs, rows)?,
                None if scoring_any => Forwarded::Logits(self.exec.forward_scoring(&inputs, &scoring)?),
                None => Forwarded::Logits(self.exec.forward(&inputs)?),
            }
        };
        // A decode runs the one token sampled last; a prompt's last chunk may be one
        // token too, and costs like a prompt token (it is timed with them).
        let (mut decodes, mut prompt_tokens) = (0, 0);
        for s in &step.scheduled {
            match s.len == 1 && self.scheduler.get(s.id).is_some_and(|q| s.start >= q.prompt_len) {
                true => decodes += 1,
                false => prompt_tokens += s.len,
            }
        }
        self.pacer.observe(started.elapsed(), decodes, prompt_tokens);
        let forwarded = match forwarded {
            Forwarded::Logits(all) if scoring_any => Forwarded::Logits(self.score_prompts(&step, &scoring, all)),
            other => other,
        };
        for s in &step.scheduled {
            let seq = self.scheduler.get(s.id).expect("scheduled sequences exist");
            self.stats.prompt_tokens_computed += (s.start + s.len).min(seq.prompt_len).saturating_sub(s.start) as u64;
        }
        self.scheduler.complete(&step);

        let ids: Vec<SeqId> = step.scheduled.iter().filter(|s| s.sample).map(|s| s.id).collect();
        let mut taken: Vec<(SeqId, RequestState)> =
            ids.iter().map(|id| (*id, self.requests.remove(id).expect("scheduled requests exist"))).collect();
        let sampled = match forwarded {
            Forwarded::Picked(picks) => picks
                .into_iter()
                .zip(&mut taken)
                .map(|(p, (_, r))| Sampled {
                    // An end the step's rule turns into a close (no log-probability was
                    // asked for: such rows are sampled on the host).
                    token: r.sampler.redirect_end(p.token),
                    logprob: p.logprob,
                    top_logprobs: p.top_logprobs,
                })
                .collect(),
            Forwarded::Logits(mut logits) => {
                let mut states: Vec<&mut SamplerState> = taken.iter_mut().map(|(_, r)| &mut r.sampler).collect();
                sample_batch(&mut logits, self.exec.config().vocab_size, &mut states)
            }
        };
        outputs.reserve(taken.len());
        let mut pending = taken.into_iter().zip(sampled);
        while let Some(((seq_id, mut state), s)) = pending.next() {
            let mut output = match self.advance(seq_id, &mut state, s) {
                Ok(output) => output,
                Err(e) => {
                    // The sequences stay scheduled: their states go back with them, so
                    // that a later step or abort finds them.
                    self.requests.insert(seq_id, state);
                    self.requests.extend(pending.map(|(taken, _)| taken));
                    return Err(e);
                }
            };
            if output.finish.is_none() {
                self.requests.insert(seq_id, state);
            } else {
                self.scheduler.remove(seq_id);
                output.last = self.leave_family(output.id, seq_id);
            }
            outputs.push(output);
        }
        Ok(outputs)
    }

    /// Scores the prompt tokens of the chunks `scoring` marks from their rows of `all`
    /// (each chunk's row `j` predicts its token `j + 1`), keeping them by position, and
    /// returns the sampled rows alone, as a forward without scoring would.
    fn score_prompts(&mut self, step: &Step, scoring: &[bool], all: Vec<f32>) -> Vec<f32> {
        let vocab = self.exec.config().vocab_size;
        let mut sampled = Vec::new();
        let mut row = 0;
        for (s, &scored) in step.scheduled.iter().zip(scoring) {
            let rows = if scored { s.len } else { usize::from(s.sample) };
            if scored && let (Some(r), Some(seq)) = (self.requests.get_mut(&s.id), self.scheduler.get(s.id)) {
                // Rows whose next token is still in the prompt.
                let m = s.len.min(seq.prompt_len.saturating_sub(s.start + 1));
                let next = &seq.tokens[s.start + 1..s.start + 1 + m];
                let k = r.prompt_logprobs.unwrap_or(0);
                let scores = score_rows(&all[row * vocab..(row + m) * vocab], vocab, next, k);
                r.prompt_scores.resize(seq.prompt_len, None);
                for (j, score) in scores.into_iter().enumerate() {
                    r.prompt_scores[s.start + 1 + j] = Some(score);
                }
            }
            if s.sample {
                let last = row + rows - 1;
                sampled.extend_from_slice(&all[last * vocab..(last + 1) * vocab]);
            }
            row += rows;
        }
        sampled
    }

    /// Takes an ended sequence out of its request's family; true if it was the last.
    fn leave_family(&mut self, request: SeqId, seq_id: SeqId) -> bool {
        let members = self.families.get_mut(&request).expect("live requests have a family");
        members.retain(|&m| m != seq_id);
        let last = members.is_empty();
        if last {
            self.families.remove(&request);
        }
        last
    }

    /// Ends the sequences the scheduler could find no room for even alone (which
    /// `validate` rules out: see `Scheduler`), as having filled their context.
    fn end_exhausted(&mut self, ids: &[SeqId]) -> Vec<Output> {
        ids.iter()
            .filter_map(|&seq_id| {
                let mut state = self.requests.remove(&seq_id)?;
                let seq = self.scheduler.remove(seq_id)?;
                let last = self.leave_family(state.request, seq_id);
                Some(Output {
                    id: state.request,
                    index: state.index,
                    last,
                    token: None,
                    text: state.detok.finish(),
                    finish: Some(FinishReason::Length),
                    prompt_tokens: seq.prompt_len,
                    cached_prompt_tokens: seq.num_cached_prompt,
                    prompt_logprobs: Vec::new(),
                })
            })
            .collect()
    }

    /// Appends a sampled token to its sequence and decides whether it ends there.
    fn advance(&mut self, seq_id: SeqId, state: &mut RequestState, s: Sampled) -> Result<Output, EngineError> {
        // The prompt is complete: its scores go out with this first output, once.
        let prompt_logprobs = match state.prompt_logprobs.take() {
            Some(_) => std::mem::take(&mut state.prompt_scores).into_iter().skip(1).flatten().collect(),
            None => Vec::new(),
        };
        if state.max_tokens == 0 {
            // Only the prompt was to be scored.
            let seq = self.scheduler.get(seq_id).expect("sampled sequences exist");
            return Ok(Output {
                id: state.request,
                index: state.index,
                last: false,
                token: None,
                text: String::new(),
                finish: Some(FinishReason::Length),
                prompt_tokens: seq.prompt_len,
                cached_prompt_tokens: seq.num_cached_prompt,
                prompt_logprobs,
            });
        }
        let token = s.token;
        if state.sampler.redirected()
            && let Some(t) = &mut state.thinking
        {
            t.close_begun();
        }
        state.sampler.push(token);
        self.scheduler.append(seq_id, token);
        self.stats.output_tokens += 1;
        let seq = self.scheduler.get(seq_id).expect("sampled sequences exist");
        let (num_output, total) = (seq.num_output(), seq.tokens.len());
        let (prompt_tokens, cached_prompt_tokens) = (seq.prompt_len, seq.num_cached_prompt);

        let mut finish = None;
        let mut text = String::new();
        if (!state.ignore_eos && self.eos.contains(&token)) || state.stop_token_ids.contains(&token) {
            finish = Some(FinishReason::Stop);
        } else {
            let delta = state.detok.push(self.tokenizer.inner(), token)?;
            if let Some(t) = &mut state.thinking {
                t.observe(&delta.text);
            }
            text = delta.text;
            if delta.stopped_on.is_some() {
                finish = Some(FinishReason::Stop);
            }
        }
        if finish.is_none() && (num_output >= state.max_tokens || total >= self.max_model_len()) {
            finish = Some(FinishReason::Length);
        }
        if finish.is_some() {
            text.push_str(&state.detok.finish());
        }
        let (id, index) = (state.request, state.index);
        Ok(Output {
            id,
            index,
            last: false,
            token: Some(s),
            text,
            finish,
            prompt_tokens,
            cached_prompt_tokens,
            prompt_logprobs,
        })
    }
}
