//! The engine loop's body, synchronous: admit requests, run one step (schedule →
//! forward → sample → detokenize → finish), report what each sequence produced.
//! A thread that owns an `EngineCore` and talks to the async world through channels
//! is all a server needs around it.

use super::detokenizer::Detokenizer;
use super::executor::Executor;
use super::grammar::Constraint;
use super::kv_tier::{KvTiers, TierConfig};
use super::pacing::Pacer;
use super::sampler::{PromptScore, Sampled, SamplerState, SamplingParams, StepRule, sample, sample_batch, score_rows};
use super::scheduler::{Scheduler, SchedulerConfig, Step};
use super::sequence::{SeqId, Sequence};
use super::speculate::draft::DraftProposer;
use super::speculate::{Proposal, SpecConfig, SpecMethod, SpecStats, Speculator, StepCosts};
use super::thinking::{Thinking, ThinkingBudget};
use crate::model::{Embeds, Forwarded, Model, ModelConfig, ModelError, SeqInput};
use crate::tokenizer::ModelTokenizer;
use crate::vision::placement::PlacedImages;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tessera_kernels::Backend;
use tessera_kernels::pick::PickRow;
use tessera_kernels::pick::Picked;
use tessera_proto::block_hash::{BLOCK_TOKENS, BlockHasher};

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
    /// Speculative decoding (`speculate`); None: one token per sequence per step.
    pub speculative: Option<SpecConfig>,
    /// Rows a step runs while tenants contend, split among them by weight (`fair`).
    pub contended_batch: usize,
    /// The second KV tier (`kv_tier`): off unless it has bytes.
    pub kv_tiers: TierConfig,
}

/// `contended_batch` on a CPU, where a step's time grows with its rows (about a
/// millisecond a row for SmolLM2-135M on two cores): steps of 8 rows keep another
/// tenant's wait for a step short, and 8 rows already give most of what 48 do in tokens
/// per second. On a GPU rows are nearly free up to the batch limit, which is the default
/// there.
pub const CPU_CONTENDED_BATCH: usize = 8;

/// A step with prompt chunks takes at most two and a half decode steps' time: the gap
/// between two tokens of a stream stays within 4× its median (issue 25's bound) with
/// room for the noise of step times (at 300 % the 99th percentile reached 3.5-4.6× on
/// this project's 2-core machines). Prompts beside decodes lose little by it: their
/// share of such a step goes from 2/3 to 3/5.
pub const DEFAULT_PROMPT_STEP_PERCENT: u32 = 250;
/// A decode replica's (disaggregated serving): long prompts come computed from prefill
/// replicas, so the prompt chunks it runs are short ones' and its gaps matter most.
pub const DECODE_PROMPT_STEP_PERCENT: u32 = 100;

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
            speculative: None,
            contended_batch: CPU_CONTENDED_BATCH,
            kv_tiers: TierConfig::default(),
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
    /// Who the request is for: text seen in one tenant's requests speeds up only that
    /// tenant's (`speculate::suffix`), and tenants share the replica by weight (`fair`).
    pub tenant: String,
    /// The tenant's weight (at least 1).
    pub weight: u32,
    /// Lower runs sooner among the tenant's requests.
    pub priority: i32,
    /// Tokens already generated for this request on another replica (disaggregated
    /// serving): the output goes on after them as if they had been sampled here.
    pub resume: Vec<u32>,
    /// Prefill only: after the first token (or, in the middle of a forced close of
    /// reasoning, after the close), the request ends (`FinishReason::Handoff`) and its
    /// prompt's full blocks, past the first `skip` (which the receiver holds), go out
    /// with that output (`Output::handoff`).
    pub handoff: Option<Handoff>,
}

/// `Request::handoff`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Handoff {
    pub skip_blocks: usize,
}

/// A prompt's KV blocks, by prefix hash, as `Backend::kv_save_blocks` copies them.
pub type KvBlocks = Vec<(u64, Vec<u8>)>;

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
            tenant: String::new(),
            weight: 1,
            priority: 0,
            resume: Vec::new(),
            handoff: None,
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
    /// The prompt was computed and the first token sampled here; the request goes on
    /// elsewhere (`Request::handoff`).
    Handoff,
}

impl FinishReason {
    /// As the metrics label it (vLLM's `finished_reason`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Handoff => "handoff",
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
    /// When the request reached each stage: on its last output, from the runner (which
    /// keeps the times).
    pub timeline: Option<Box<crate::metrics::Timeline>>,
    /// On a `FinishReason::Handoff` output: the prompt's blocks to send on.
    pub handoff: Option<Arc<KvBlocks>>,
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
    /// The engine's own configuration cannot work.
    #[error("{0}")]
    Config(String),
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
    /// `Request::tenant`.
    tenant: Arc<str>,
    /// `Request::handoff`.
    handoff: Option<Handoff>,
}

impl RequestState {
    /// The rule for the sequence's next token: its thinking budget's; no end before
    /// `min_tokens`; and near its limit, a grammar's output must finish in time. Asked
    /// once per token (a thinking budget's forced close advances with it).
    fn next_rule(&mut self, seq: &Sequence, context: usize) -> StepRule {
        let mut rule = self.thinking.as_mut().map(Thinking::rule).unwrap_or_default();
        rule.ends_banned |= seq.num_output() < self.min_tokens;
        let answering = !self.thinking.as_ref().is_some_and(Thinking::inside);
        let remaining = self.max_tokens.saturating_sub(seq.num_output()).min(context - seq.tokens.len());
        if self.sampler.constraint.is_some() && answering && remaining <= FINISH_WATCH {
            rule.finish_within = Some(remaining);
        }
        rule
    }
}

/// Which rows a step's forward returns (`EngineCore::prepare`).
struct Batch {
    /// By scheduled sequence: every row (a prompt being scored, a verification), or
    /// only the last of a sampled chunk.
    all_rows: Vec<bool>,
    /// The device's picks for the sampled rows, when it can make them all.
    device_rows: Option<Vec<PickRow>>,
}

/// A step's results by sampled sequence (`EngineCore::split_rows`).
enum Rows {
    Picked(Vec<Picked>),
    Logits {
        /// The last row of each sampled sequence without proposals, in step order.
        last: Vec<f32>,
        /// Every row of each verification.
        verify: HashMap<SeqId, Vec<f32>>,
    },
}

/// A step's tokens as pacing weighs them (`EngineCore::shape`).
#[derive(Debug, Default)]
struct StepShape {
    /// Sequences that ran one decoded token...
    decodes: usize,
    /// ...and these proposed tokens after them, in all.
    proposed: usize,
    /// Tokens of prompt chunks.
    prompt_tokens: usize,
}

/// Counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub steps: u64,
    pub preemptions: u64,
    /// Of `preemptions`, those that made room for another tenant (`fair`).
    pub fair_preemptions: u64,
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
    speculator: Option<Speculator>,
    /// Costs speculation weighs instead of measured ones (`pin_spec_costs`).
    pinned_costs: Option<StepCosts>,
}

/// What the last step computed, for the engine's metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepSummary {
    /// Tokens computed: prompt chunks and decodes.
    pub tokens: usize,
    /// The requests it computed part of (each once).
    pub requests: Vec<SeqId>,
    /// The requests it sent back to the queue to make room.
    pub preempted: Vec<SeqId>,
}

impl<B: Backend + 'static> EngineCore<B> {
    pub fn new(
        model: Model<B>,
        tokenizer: ModelTokenizer,
        config: EngineConfig,
        model_name: &str,
    ) -> Result<Self, EngineError> {
        let exec = Executor::single(model, config.num_blocks, &config.graph_sizes())?;
        Self::with_executor(exec, None, tokenizer, config, model_name)
    }

    /// An engine whose speculation (`speculative = draft`) drafts with `draft`, a model
    /// with the same tokenizer, beside a KV cache of its own of `config.num_blocks`.
    pub fn with_draft(
        model: Model<B>,
        draft: Model<B>,
        tokenizer: ModelTokenizer,
        config: EngineConfig,
        model_name: &str,
    ) -> Result<Self, EngineError> {
        let exec = Executor::single(model, config.num_blocks, &config.graph_sizes())?;
        Self::with_executor(exec, Some(draft), tokenizer, config, model_name)
    }

    /// An engine over the ranks of a tensor-parallel group (rank 0 first).
    pub fn tensor_parallel(
        ranks: Vec<Model<B>>,
        tokenizer: ModelTokenizer,
        config: EngineConfig,
        model_name: &str,
    ) -> Result<Self, EngineError> {
        let exec = Executor::parallel(ranks, config.num_blocks, &config.graph_sizes())?;
        Self::with_executor(exec, None, tokenizer, config, model_name)
    }

    fn with_executor(
        exec: Executor<B>,
        draft: Option<Model<B>>,
        tokenizer: ModelTokenizer,
        config: EngineConfig,
        model_name: &str,
    ) -> Result<Self, EngineError> {
        let speculator = speculator(&config, exec.config(), draft)?;
        let mut scheduler = Scheduler::new(
            SchedulerConfig {
                max_num_batched_tokens: config.max_num_batched_tokens,
                max_num_seqs: config.max_num_seqs,
                num_blocks: config.num_blocks,
                contended_batch: config.contended_batch,
            },
            BlockHasher::new(model_name),
        );
        if config.kv_tiers.enabled() {
            let tiers = KvTiers::open(&config.kv_tiers)
                .map_err(|e| EngineError::Config(format!("opening the KV cache's second tier: {e}")))?;
            scheduler = scheduler.with_tiers(tiers);
        }
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
            speculator,
            pinned_costs: None,
        })
    }
}

/// Speculation as `config` asks, proposing with `draft` where that is a draft model.
fn speculator<B: Backend + 'static>(
    config: &EngineConfig,
    target: &ModelConfig,
    draft: Option<Model<B>>,
) -> Result<Option<Speculator>, EngineError> {
    let bad = |m: String| Err(EngineError::Config(m));
    let Some(spec) = config.speculative.clone() else {
        return match draft {
            Some(_) => bad("a draft model was given, but speculation is off".into()),
            None => Ok(None),
        };
    };
    spec.check().map_err(|e| EngineError::Config(e.to_string()))?;
    match (spec.method, draft) {
        (SpecMethod::Draft, Some(draft)) => {
            // The draft's tokens go into the target as they are: the same vocabulary.
            if draft.config.vocab_size != target.vocab_size {
                return bad(format!(
                    "the draft model's vocabulary has {} tokens, the model's {}: a draft needs the model's tokenizer",
                    draft.config.vocab_size, target.vocab_size
                ));
            }
            let proposer = DraftProposer::new(draft, config.num_blocks, &config.graph_sizes())?;
            Ok(Some(Speculator::with_proposer(spec, Box::new(proposer))))
        }
        (SpecMethod::Draft, None) => bad("speculative method draft needs its draft model".into()),
        (method, Some(_)) => bad(format!("a draft model was given, but the speculative method is {}", method.as_str())),
        (_, None) => Ok(Speculator::new(spec)),
    }
}

impl<B: Backend> EngineCore<B> {
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

    /// The most bytes of disk-tier blocks read ahead of their prompts' steps (0: each
    /// read in its step, as a benchmark compares).
    pub fn set_kv_read_ahead(&mut self, bytes: u64) {
        if let Some(tiers) = self.scheduler.tiers_mut() {
            tiers.set_read_ahead(bytes);
        }
    }

    /// What the last `step` computed (nothing if it had no work).
    pub fn last_step(&self) -> &StepSummary {
        &self.last_step
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Has speculation weigh these costs instead of the step times it measures: what
    /// it verifies then no longer depends on timing (tests compare runs; benchmarks
    /// find crossovers). A row that costs nothing makes it verify every proposal.
    pub fn pin_spec_costs(&mut self, costs: Option<StepCosts>) {
        self.pinned_costs = costs;
    }

    /// Speculative decoding's counts, when it is on.
    pub fn spec_stats(&self) -> Option<&SpecStats> {
        self.speculator.as_ref().map(Speculator::stats)
    }

    /// KV blocks speculation holds apart from the model's (a draft model's cache).
    pub fn spec_held_blocks(&self) -> usize {
        self.speculator.as_ref().map_or(0, Speculator::held_blocks)
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Prefix-cache changes since the last call (`Scheduler::take_kv_changes`).
    pub fn take_kv_changes(&mut self) -> Vec<(u64, super::scheduler::Place)> {
        self.scheduler.take_kv_changes()
    }

    /// Checks a request and queues its `n` sequences; the second and later wait until
    /// the first has computed the prompt, then start from its cached blocks.
    pub fn add_request(&mut self, req: Request) -> Result<(), EngineError> {
        self.validate(&req)?;
        if self.families.contains_key(&req.id) {
            return Err(EngineError::DuplicateId(req.id));
        }
        let mut members = Vec::with_capacity(req.n);
        let tenant: Arc<str> = req.tenant.as_str().into();
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
            let mut state = RequestState {
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
                tenant: tenant.clone(),
                handoff: req.handoff,
            };
            self.replay(&mut state, &req.resume)?;
            self.requests.insert(seq_id, state);
            let after = members.first().copied();
            let score_prompt = index == 0 && req.prompt_logprobs.is_some();
            let images = req.images.clone();
            self.scheduler.add(
                Sequence {
                    after,
                    score_prompt,
                    images,
                    tenant: tenant.clone(),
                    weight: req.weight.max(1),
                    priority: req.priority,
                    ..Sequence::new(seq_id, [&req.prompt[..], &req.resume].concat())
                }
                .with_prompt_len(req.prompt.len()),
            );
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
        if (!req.resume.is_empty() || req.handoff.is_some()) && (req.n != 1 || req.prompt_logprobs.is_some()) {
            return bad("a disaggregated request (resume_token_ids, handoff) has n = 1 and no prompt_logprobs".into());
        }
        if req.resume.len() >= req.max_tokens.max(1) {
            return bad(format!(
                "{} resumed tokens leave nothing to generate under max_tokens {}",
                req.resume.len(),
                req.max_tokens
            ));
        }
        if let Some(t) = req.resume.iter().find(|&&t| t as usize >= vocab) {
            return bad(format!("resumed token id {t} is outside the vocabulary of {vocab}"));
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
            t.check().or_else(|e| bad(e.to_string()))?;
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
                self.forget(&seq, &state.tenant);
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
                    timeline: None,
                    handoff: None,
                })
            })
            .collect()
    }

    /// Runs one forward over the scheduled batch and returns what each sampled
    /// sequence produced: one output per token, several for a sequence whose proposed
    /// tokens the model accepted. Returns nothing when there is no work.
    pub fn step(&mut self) -> Result<Vec<Output>, EngineError> {
        self.propose();
        let step = self.schedule();
        self.move_blocks(&step)?;
        let mut outputs = self.end_exhausted(&step.exhausted);
        if step.scheduled.is_empty() {
            return Ok(outputs);
        }
        self.stats.steps += 1;
        let batch = self.prepare(&step);
        // Timed through sampling: a verification's rows are sampled on the host one by
        // one, which is part of what its proposals cost.
        let started = Instant::now();
        let forwarded = self.forward(&step, &batch)?;
        let shape = self.shape(&step);
        for s in &step.scheduled {
            let seq = self.scheduler.get(s.id).expect("scheduled sequences exist");
            self.stats.prompt_tokens_computed += (s.start + s.len).min(seq.prompt_len).saturating_sub(s.start) as u64;
        }
        self.scheduler.complete(&step);
        self.sample_and_emit(&step, forwarded, &mut outputs)?;
        match shape.prompt_tokens {
            0 => self.pacer.observe_verification(started.elapsed(), shape.decodes, shape.proposed),
            n => self.pacer.observe(started.elapsed(), shape.decodes, n + shape.proposed),
        }
        Ok(outputs)
    }

    /// Copies the blocks this step evicts to the second tier, then fills the blocks it
    /// takes from there, before the forward writes or reads any of them. A block that
    /// cannot be copied out is only lost to the cache (computed again when asked for).
    fn move_blocks(&mut self, step: &Step) -> Result<(), EngineError> {
        let ids: Vec<u32> = step.offload.iter().map(|&(id, _)| id).collect();
        match self.exec.save_blocks(&ids) {
            Ok(saved) => {
                for (&(_, hash), data) in step.offload.iter().zip(saved) {
                    self.scheduler.offloaded(hash, Arc::new(data));
                }
            }
            Err(e) => tracing::warn!("{} KV blocks could not be copied to the second tier: {e}", ids.len()),
        }
        let (ids, data): (Vec<u32>, Vec<Arc<Vec<u8>>>) =
            step.onload.iter().map(|(id, data, _)| (*id, data.clone())).unzip();
        if let Err(e) = self.exec.load_blocks(&ids, &data) {
            self.scheduler.onload_failed(step);
            return Err(e.into());
        }
        Ok(())
    }

    /// At shutdown, with a disk tier: writes the host tier's blocks and every block of
    /// the prefix cache to disk (oldest first, so that the newest stay when it is
    /// full), for a restart to find — a warm restart. Returns how many were written.
    pub fn persist_kv(&mut self) -> usize {
        let Some(capacity) = self.scheduler.tiers().and_then(KvTiers::disk_capacity) else { return 0 };
        let cached = self.scheduler.pool().cached_by_age();
        let Some(&(newest, _)) = cached.last() else {
            let Some(tiers) = self.scheduler.tiers_mut() else { return 0 };
            let written = tiers.spill_host(capacity);
            tiers.flush();
            return written;
        };
        // Only the newest that fit: older ones would be written to be pushed out.
        let block = match self.exec.save_blocks(&[newest]) {
            Ok(data) => data.first().map_or(1, |d| d.len().max(1)) as u64,
            Err(e) => {
                tracing::warn!("the KV cache could not be copied to disk at shutdown: {e}");
                return 0;
            }
        };
        let fit = (capacity / block) as usize;
        let device = &cached[cached.len().saturating_sub(fit)..];
        let host_room = capacity.saturating_sub(device.len() as u64 * block);
        let mut written = self.scheduler.tiers_mut().map_or(0, |t| t.spill_host(host_room));
        // A few MB at a time: the whole cache copied at once could be most of memory.
        let per_copy = ((8 << 20) / block as usize).max(1);
        for part in device.chunks(per_copy) {
            let ids: Vec<u32> = part.iter().map(|&(id, _)| id).collect();
            match self.exec.save_blocks(&ids) {
                Ok(saved) => {
                    for (&(_, hash), data) in part.iter().zip(saved) {
                        written += self.scheduler.tiers_mut().is_some_and(|t| t.persist(hash, data)) as usize;
                    }
                }
                Err(e) => tracing::warn!("{} KV blocks could not be copied to disk at shutdown: {e}", ids.len()),
            }
        }
        if let Some(t) = self.scheduler.tiers_mut() {
            t.flush();
        }
        written
    }

    /// What a step ran, as pacing counts it. A decode runs the one token sampled
    /// last; a prompt's last chunk may be one token too, and costs like a prompt token
    /// (it is timed with them), as do proposals.
    fn shape(&self, step: &Step) -> StepShape {
        let mut shape = StepShape::default();
        for s in &step.scheduled {
            match s.len - s.draft == 1 && self.scheduler.get(s.id).is_some_and(|q| s.start >= q.prompt_len) {
                true => {
                    shape.decodes += 1;
                    shape.proposed += s.draft;
                }
                false => shape.prompt_tokens += s.len,
            }
        }
        shape
    }

    /// Asks the speculator for tokens to follow each decoding sequence (none when
    /// speculation is off, or not worth it this step).
    fn propose(&mut self) {
        let context = self.max_model_len();
        let Some(spec) = &mut self.speculator else { return };
        let seqs: Vec<Proposal<'_>> = self
            .scheduler
            .decoding_sequences()
            .map(|s| {
                let r = self.requests.get(&s.id);
                // Room for the proposals and the token after them: in the output's
                // limit, and in the context (a verification runs past the last token).
                let left = r.map_or(0, |r| r.max_tokens.saturating_sub(s.num_output()));
                let max = left.saturating_sub(1).min(context.saturating_sub(s.tokens.len()));
                Proposal { id: s.id, tenant: r.map_or("", |r| &r.tenant), tokens: &s.tokens, max }
            })
            .collect();
        // A step whose decode cost is not known lately runs without proposals, and
        // measures it.
        let costs = self.pinned_costs.clone().or_else(|| self.pacer.costs(seqs.len()));
        let mut proposals: HashMap<SeqId, Vec<u32>> = match costs {
            Some(costs) => spec.propose(&seqs, &costs).into_iter().collect(),
            None => HashMap::new(),
        };
        let ids: Vec<SeqId> = seqs.iter().map(|p| p.id).collect();
        for id in ids {
            let mut draft = proposals.remove(&id).unwrap_or_default();
            // A grammar's output: proposals past the first token it forbids are wasted.
            if let Some(c) = self.requests.get(&id).and_then(|r| r.sampler.constraint.as_ref()) {
                draft.truncate(c.valid_prefix(&draft));
            }
            self.scheduler.propose(id, draft);
        }
    }

    /// Plans the step and records what it computes.
    fn schedule(&mut self) -> Step {
        let step = self.scheduler.schedule_paced(self.pacer.prompt_tokens(self.scheduler.decoding()));
        self.stats.preemptions += step.preempted.len() as u64;
        self.stats.fair_preemptions += step.fair_preemptions as u64;
        let mut requests: Vec<SeqId> =
            step.scheduled.iter().filter_map(|s| self.requests.get(&s.id).map(|r| r.request)).collect();
        requests.sort_unstable();
        requests.dedup();
        let preempted = step.preempted.iter().filter_map(|id| self.requests.get(id).map(|r| r.request)).collect();
        self.last_step = StepSummary { tokens: step.scheduled.iter().map(|s| s.len).sum(), requests, preempted };
        step
    }

    /// Each sampled sequence's rule for its first token this step, and which rows the
    /// forward returns: every row of a prompt being scored or of a verification, the
    /// last of any other sampled chunk — or only the picks, when the device can make
    /// them all.
    fn prepare(&mut self, step: &Step) -> Batch {
        let context = self.max_model_len();
        for s in step.scheduled.iter().filter(|s| s.sample) {
            let (Some(r), Some(seq)) = (self.requests.get_mut(&s.id), self.scheduler.get(s.id)) else { continue };
            r.sampler.rule = r.next_rule(seq, context);
        }
        let all_rows: Vec<bool> = step
            .scheduled
            .iter()
            .map(|s| {
                let scores = self.requests.get(&s.id).is_some_and(|r| r.prompt_logprobs.is_some());
                s.draft > 0 || (scores && self.scheduler.get(s.id).is_some_and(|q| s.start < q.prompt_len))
            })
            .collect();
        // When no sampled row follows a grammar (or is forced) the device may pick the
        // tokens itself.
        let device_rows = match all_rows.contains(&true) {
            true => None,
            false => step
                .scheduled
                .iter()
                .filter(|s| s.sample)
                .map(|s| self.requests.get_mut(&s.id).and_then(|r| r.sampler.device_row()))
                .collect(),
        };
        Batch { all_rows, device_rows }
    }

    /// The forward itself: its logits or picks, split by sequence.
    fn forward(&mut self, step: &Step, batch: &Batch) -> Result<Rows, EngineError> {
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
            // A verification runs the sequence's last token and its proposals.
            let verified: Vec<Vec<u32>> = step
                .scheduled
                .iter()
                .map(|s| {
                    let seq = self.scheduler.get(s.id).expect("scheduled sequences exist");
                    match s.draft {
                        0 => Vec::new(),
                        _ => seq.tokens[s.start..].iter().chain(&seq.draft).copied().collect(),
                    }
                })
                .collect();
            let inputs: Vec<SeqInput<'_>> = step
                .scheduled
                .iter()
                .zip(&embeds)
                .zip(&verified)
                .map(|((s, embeds), verified)| {
                    let seq = self.scheduler.get(s.id).expect("scheduled sequences exist");
                    SeqInput {
                        tokens: if s.draft > 0 { verified } else { &seq.tokens[s.start..s.start + s.len] },
                        cached: s.start,
                        block_table: &seq.block_table,
                        logits: s.sample,
                        embeds,
                    }
                })
                .collect();
            match &batch.device_rows {
                Some(rows) => self.exec.forward_picking(&inputs, rows)?,
                None if batch.all_rows.contains(&true) => {
                    Forwarded::Logits(self.exec.forward_scoring(&inputs, &batch.all_rows)?)
                }
                None => Forwarded::Logits(self.exec.forward(&inputs)?),
            }
        };
        Ok(match forwarded {
            Forwarded::Picked(picks) => Rows::Picked(picks),
            Forwarded::Logits(all) => self.split_rows(step, &batch.all_rows, all),
        })
    }

    /// The forward's logits by sampled sequence: the last row of each, or every row of
    /// a verification. The rows of a prompt being scored are scored here and kept by
    /// position (each chunk's row `j` predicts its token `j + 1`).
    fn split_rows(&mut self, step: &Step, all_rows: &[bool], all: Vec<f32>) -> Rows {
        let vocab = self.exec.config().vocab_size;
        if !all_rows.contains(&true) {
            return Rows::Logits { last: all, verify: HashMap::new() };
        }
        let (mut last, mut verify) = (Vec::new(), HashMap::new());
        let mut row = 0;
        for (s, &every) in step.scheduled.iter().zip(all_rows) {
            let rows = if every { s.len } else { usize::from(s.sample) };
            let scored = every && s.draft == 0;
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
            if s.draft > 0 {
                verify.insert(s.id, all[row * vocab..(row + rows) * vocab].to_vec());
            } else if s.sample {
                let at = row + rows - 1;
                last.extend_from_slice(&all[at * vocab..(at + 1) * vocab]);
            }
            row += rows;
        }
        Rows::Logits { last, verify }
    }

    /// Samples each sampled sequence's token (verifying its proposals, if it had any)
    /// and appends what it produced, in the order the step ran them.
    fn sample_and_emit(&mut self, step: &Step, rows: Rows, outputs: &mut Vec<Output>) -> Result<(), EngineError> {
        let ids: Vec<SeqId> = step.scheduled.iter().filter(|s| s.sample).map(|s| s.id).collect();
        let mut taken: Vec<(SeqId, RequestState)> =
            ids.iter().map(|id| (*id, self.requests.remove(id).expect("scheduled requests exist"))).collect();
        let (plain, mut verify) = match rows {
            Rows::Picked(picks) => {
                let sampled = picks
                    .into_iter()
                    .zip(&mut taken)
                    .map(|(p, (_, r))| Sampled {
                        // An end the step's rule turns into a close (no log-probability
                        // was asked for: such rows are sampled on the host).
                        token: r.sampler.redirect_end(p.token),
                        logprob: p.logprob,
                        top_logprobs: p.top_logprobs,
                    })
                    .collect();
                (sampled, HashMap::new())
            }
            Rows::Logits { mut last, verify } => {
                let mut states: Vec<&mut SamplerState> =
                    taken.iter_mut().filter(|(id, _)| !verify.contains_key(id)).map(|(_, r)| &mut r.sampler).collect();
                (sample_batch(&mut last, self.exec.config().vocab_size, &mut states), verify)
            }
        };
        let mut plain = plain.into_iter();
        let mut pending = taken.into_iter();
        while let Some((seq_id, mut state)) = pending.next() {
            let emitted = match verify.remove(&seq_id) {
                Some(mut rows) => self.verify(seq_id, &mut state, &mut rows, outputs),
                None => {
                    let s = plain.next().expect("a sampled row per sequence");
                    self.advance(seq_id, &mut state, s).map(|out| {
                        let finished = out.finish.is_some();
                        outputs.push(out);
                        finished
                    })
                }
            };
            match emitted {
                Ok(false) => {
                    self.requests.insert(seq_id, state);
                }
                Ok(true) => {
                    if let Some(seq) = self.scheduler.remove(seq_id) {
                        self.forget(&seq, &state.tenant);
                    }
                    let last = self.leave_family(state.request, seq_id);
                    outputs.last_mut().expect("a finish is an output").last = last;
                }
                Err(e) => {
                    // The sequences stay scheduled: their states go back with them, so
                    // that a later step or abort finds them.
                    self.requests.insert(seq_id, state);
                    self.requests.extend(pending);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Samples a verification's rows in order, each as a step without proposals would
    /// sample it (its own rule, the tokens accepted before it counted), emitting every
    /// token, until one differs from the proposal (the model's own pick, emitted in its
    /// place), the proposals are used up (the row after them gives one more), or the
    /// sequence ends. True if it ended.
    fn verify(
        &mut self,
        seq_id: SeqId,
        state: &mut RequestState,
        rows: &mut [f32],
        outputs: &mut Vec<Output>,
    ) -> Result<bool, EngineError> {
        let vocab = self.exec.config().vocab_size;
        let context = self.max_model_len();
        let draft = self.scheduler.get(seq_id).expect("verified sequences exist").draft.clone();
        let mut accepted = 0;
        let mut finished = false;
        for (i, row) in rows.chunks_mut(vocab).enumerate() {
            if i > 0 {
                let seq = self.scheduler.get(seq_id).expect("verified sequences exist");
                state.sampler.rule = state.next_rule(seq, context);
            }
            let s = sample(row, &mut state.sampler);
            let agreed = draft.get(i) == Some(&s.token);
            let out = self.advance(seq_id, state, s)?;
            finished = out.finish.is_some();
            outputs.push(out);
            accepted += usize::from(agreed);
            if !agreed || finished {
                break;
            }
        }
        // Even when the sequence ends here: its accepted tokens' blocks join the prefix
        // cache, as they would have one step at a time.
        let kept = self.scheduler.settle(seq_id);
        debug_assert!(finished || kept == accepted, "the cache keeps exactly the accepted proposals");
        if let Some(spec) = &mut self.speculator {
            spec.verified(seq_id, draft.len(), accepted);
        }
        Ok(finished)
    }

    /// Tells speculation a sequence has ended (what it kept for it goes; what it
    /// learns from its text stays with its tenant).
    fn forget(&mut self, seq: &Sequence, tenant: &str) {
        if let Some(spec) = &mut self.speculator {
            spec.finished(seq.id, tenant, &seq.tokens, seq.num_output());
        }
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
                self.forget(&seq, &state.tenant);
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
                    timeline: None,
                    handoff: None,
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
                timeline: None,
                handoff: None,
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
        let mut handoff = None;
        // Not in the middle of a forced close: the receiver's replay would not know it.
        if finish.is_none()
            && let Some(h) = state.handoff
            && state.thinking.as_ref().is_none_or(Thinking::settled)
        {
            // The text held back (a possible stop string, a partial character) stays
            // held: the receiver's detokenizer, replaying the same tokens, holds it too.
            finish = Some(FinishReason::Handoff);
            handoff = Some(Arc::new(self.export_prompt(seq_id, h.skip_blocks)));
        } else if finish.is_some() {
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
            timeline: None,
            handoff,
        })
    }

    /// Copies the computed full blocks of a sequence's prompt, from block `skip` on,
    /// for a handoff (none if the copy fails: the receiver computes what it lacks).
    fn export_prompt(&mut self, seq_id: SeqId, skip: usize) -> KvBlocks {
        let seq = self.scheduler.get(seq_id).expect("sampled sequences exist");
        let full = (seq.num_computed.min(seq.prompt_len) / BLOCK_TOKENS).min(seq.block_hashes.len());
        let blocks: Vec<(u64, u32)> =
            (skip.min(full)..full).map(|i| (seq.block_hashes[i], seq.block_table[i])).collect();
        let ids: Vec<u32> = blocks.iter().map(|&(_, id)| id).collect();
        match self.exec.save_blocks(&ids) {
            Ok(saved) => blocks.iter().map(|&(hash, _)| hash).zip(saved).collect(),
            Err(e) => {
                // The receiver computes the prompt itself.
                tracing::warn!("the prompt's KV blocks could not be copied for a handoff: {e}");
                Vec::new()
            }
        }
    }

    /// Brings a completion's state to where it would be had it sampled `tokens` here:
    /// the seed's draws, the grammar, penalties, the detokenizer (whose text was sent
    /// by the replica that sampled them) and the thinking budget.
    fn replay(&self, state: &mut RequestState, tokens: &[u32]) -> Result<(), EngineError> {
        for &token in tokens {
            if (!state.ignore_eos && self.eos.contains(&token)) || state.stop_token_ids.contains(&token) {
                let why = format!("resumed token {token} ends the output: there is nothing to resume");
                return Err(EngineError::InvalidRequest(why));
            }
            // Each token's rule, as the step that sampled it asked (a forced close
            // advances with it).
            if let Some(t) = &mut state.thinking {
                t.rule();
            }
            state.sampler.replay(token);
            let delta = state.detok.push(self.tokenizer.inner(), token)?;
            if let Some(t) = &mut state.thinking {
                t.observe(&delta.text);
            }
        }
        Ok(())
    }

    /// Stores blocks another replica computed (a prefill replica's handoff) in the
    /// second tier, where admission finds them as it finds evicted ones. Returns how
    /// many were stored and how many were already held here.
    pub fn import_kv(&mut self, blocks: KvBlocks) -> Result<(usize, usize), EngineError> {
        if self.scheduler.tiers().is_none() {
            return Err(EngineError::Config("this replica has no second KV tier to take blocks into".into()));
        }
        let (mut stored, mut held) = (0, 0);
        for (hash, data) in blocks {
            if self.scheduler.place(hash) != super::scheduler::Place::Gone {
                held += 1;
                continue;
            }
            self.scheduler.tiers_mut().expect("checked above").put(hash, Arc::new(data));
            stored += 1;
        }
        Ok((stored, held))
    }
}
