//! Picking tokens where the logits are: what a row asks for and what it gets. A
//! backend that can pick on its device (CUDA) saves downloading the `[rows, vocab]`
//! logits; the others leave it to the engine's sampler.

/// How one row is picked: greedily (the engine's sampling parameters at temperature 0),
/// or by a draw.
#[derive(Debug, Clone)]
pub struct PickRow {
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// The sequence's history, each token once: (token, times in the output, whether
    /// the repetition penalty applies to it, i.e. it is in the prompt or the output).
    pub history: Vec<(u32, u32, bool)>,
    pub logit_bias: Vec<(u32, f32)>,
    /// How many alternatives to return with log-probabilities (0..=20); None for no
    /// log-probabilities at all.
    pub top_logprobs: Option<u32>,
    /// None picks the most likely token after penalties and bias.
    pub draw: Option<Draw>,
}

/// A sampled pick: temperature, then top-k, the top-p share of what is left and min-p,
/// then the token at which the kept probabilities, walked from the most likely, pass
/// `uniform` of their sum (the engine's CPU sampler's order, so the same draw picks
/// the same token up to rounding at the boundaries).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    /// Above 0.
    pub temperature: f32,
    /// 0 is off.
    pub top_k: u32,
    /// 1 is off.
    pub top_p: f32,
    /// 0 is off.
    pub min_p: f32,
    /// The sequence's random draw for this step, in [0, 1).
    pub uniform: f32,
}

impl Default for PickRow {
    /// Greedy, no penalty, no bias, no log-probabilities.
    fn default() -> Self {
        Self {
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            history: Vec::new(),
            logit_bias: Vec::new(),
            top_logprobs: None,
            draw: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Picked {
    pub token: u32,
    /// log P(token) under the raw logits, before penalties and bias.
    pub logprob: Option<f32>,
    /// The most likely tokens with their log-probabilities, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Most alternatives `top_logprobs` may ask for (TOPK_MAX in cuda/sampling.cu).
pub const MAX_TOP_LOGPROBS: u32 = 20;
