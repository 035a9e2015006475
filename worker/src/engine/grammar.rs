//! Constrained decoding: a request's grammar (a JSON schema, any JSON object, or a Lark
//! grammar) compiled by llguidance against the model's tokenizer, and a matcher per
//! sequence that masks the logits at every step to the tokens the grammar allows.
//!
//! The tokenizer's token trie and the parser factory are built once per model; compiled
//! grammars are cached by their text, so a schema sent again starts from a clone.

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::TokTrie;
use llguidance::{Matcher, ParserFactory, TokenParser};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// A JSON schema, as JSON text.
    JsonSchema(String),
    /// A Lark grammar (llguidance's dialect).
    Lark(String),
}

/// Why a grammar cannot constrain a request's output.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The model's tokenizer cannot drive constrained decoding: the worker's failing,
    /// whatever the grammar.
    #[error("the tokenizer cannot drive constrained decoding: {0}")]
    Tokenizer(String),
    /// The request's grammar does not compile.
    #[error("{0}")]
    Refused(String),
}

/// Compiled grammars cached beyond this many are dropped, oldest first.
const CACHE_CAPACITY: usize = 256;

pub struct Grammars {
    factory: ParserFactory,
    eos: Vec<u32>,
    /// Single-character tokens a finish is spelled with (`Constraint::finish`).
    finishers: Arc<Finishers>,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    parsers: HashMap<GrammarSpec, TokenParser>,
    order: std::collections::VecDeque<GrammarSpec>,
}

impl Grammars {
    /// The model's tokenizer (Hugging Face JSON), its end-of-sequence ids, and the
    /// width of its logits.
    pub fn new(tokenizer_json: &str, eos: &[u32], vocab: usize) -> Result<Self, GrammarError> {
        let mut bytes = toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(tokenizer_json.as_bytes())
            .map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        if !eos.is_empty() {
            bytes.set_eos_tokens(eos);
        }
        let env = bytes.into_tok_env(Some(vocab)).map_err(|e| GrammarError::Tokenizer(format!("token trie: {e}")))?;
        let finishers = Arc::new(Finishers::new(env.tok_trie()));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(format!("grammar factory: {e}")))?;
        factory.quiet();
        Ok(Self { factory, eos: eos.to_vec(), finishers, cache: Mutex::new(Cache::default()) })
    }

    /// A fresh matcher for `spec`, or why the grammar does not compile.
    pub fn matcher(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        let cached = self.cache.lock().expect("grammar cache").parsers.get(spec).map(|p| p.deep_clone());
        let parser = match cached {
            Some(p) => p,
            None => {
                let parser =
                    self.factory.create_parser(top_level(spec)?).map_err(|e| GrammarError::Refused(e.to_string()))?;
                let mut cache = self.cache.lock().expect("grammar cache");
                if cache.parsers.insert(spec.clone(), parser.deep_clone()).is_none() {
                    cache.order.push_back(spec.clone());
                    if cache.order.len() > CACHE_CAPACITY {
                        let oldest = cache.order.pop_front().expect("non-empty");
                        cache.parsers.remove(&oldest);
                    }
                }
                parser
            }
        };
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(GrammarError::Refused(e)),
            None => Ok(Constraint {
                matcher: Arc::new(Mutex::new(matcher)),
                eos: self.eos.clone(),
                finishers: self.finishers.clone(),
                finish: Arc::default(),
            }),
        }
    }
}

/// `Grammars` for a model, built on first use: the token trie of a large vocabulary
/// takes a moment, which requests without a grammar never pay.
pub struct GrammarSource {
    tokenizer_json: String,
    eos: Vec<u32>,
    vocab: usize,
    built: OnceLock<Result<Grammars, GrammarError>>,
}

impl GrammarSource {
    pub fn new(tokenizer_json: String, eos: Vec<u32>, vocab: usize) -> Self {
        Self { tokenizer_json, eos, vocab, built: OnceLock::new() }
    }

    /// A matcher for `spec` (blocking: call it off the async threads).
    pub fn matcher(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        let grammars = self.built.get_or_init(|| Grammars::new(&self.tokenizer_json, &self.eos, self.vocab));
        grammars.as_ref().map_err(Clone::clone)?.matcher(spec)
    }
}

fn top_level(spec: &GrammarSpec) -> Result<TopLevelGrammar, GrammarError> {
    Ok(match spec {
        GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
        GrammarSpec::JsonSchema(text) => {
            let schema: serde_json::Value = serde_json::from_str(text)
                .map_err(|e| GrammarError::Refused(format!("the JSON schema is not JSON: {e}")))?;
            TopLevelGrammar::from_json_schema(schema)
        }
        GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
    })
}

/// One sequence's position in its grammar. (Behind a mutex only so that the sampler's
/// state stays `Clone` and `Sync`; one thread uses it at a time.)
#[derive(Clone)]
pub struct Constraint {
    matcher: Arc<Mutex<Matcher>>,
    eos: Vec<u32>,
    finishers: Arc<Finishers>,
    /// The shortest finish from the current position, once looked for.
    finish: Arc<Mutex<Option<Vec<u32>>>>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

/// The same matcher, not merely the same position.
impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.matcher, &other.matcher)
    }
}

impl Constraint {
    /// An independent copy at the same position.
    pub fn fork(&self) -> Self {
        let m = self.matcher.lock().expect("matcher").deep_clone();
        Self {
            matcher: Arc::new(Mutex::new(m)),
            eos: self.eos.clone(),
            finishers: self.finishers.clone(),
            finish: Arc::default(),
        }
    }

    /// Sets every logit the grammar forbids now to −∞ (all but end-of-sequence once the
    /// grammar is complete, or if the matcher has failed: the output then ends rather
    /// than leaves its grammar).
    pub fn mask(&self, logits: &mut [f32]) {
        let mut m = self.matcher.lock().expect("matcher");
        match m.compute_mask_or_eos() {
            Ok(allowed) => {
                for (t, l) in logits.iter_mut().enumerate() {
                    if !allowed.is_allowed(t as u32) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            Err(_) => {
                for (t, l) in logits.iter_mut().enumerate() {
                    if !self.eos.contains(&(t as u32)) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    /// How many of `tokens`, in order, the grammar allows from here (the matcher does
    /// not move).
    pub fn valid_prefix(&self, tokens: &[u32]) -> usize {
        let mut m = self.matcher.lock().expect("matcher");
        if tokens.is_empty() || m.is_stopped() {
            return 0;
        }
        m.validate_tokens(tokens).unwrap_or(0)
    }

    /// Advances past a sampled token (one `mask` allowed). A matcher that refuses it
    /// keeps its error, and the next `mask` ends the output.
    pub fn accept(&self, token: u32) {
        // The finish looked for from here goes on from its first token (the search is
        // deterministic); after any other token it is looked for again.
        let mut finish = self.finish.lock().expect("finish");
        *finish = finish.take().filter(|f| f.first() == Some(&token)).map(|f| f[1..].to_vec());
        let mut m = self.matcher.lock().expect("matcher");
        if !m.is_stopped() {
            let _ = m.consume_token(token);
        }
    }

    /// The token to take when `remaining` tokens (this one included) are all that is
    /// left: `picked` if the output can still finish after it (and end), else the first
    /// token of the shortest finish from here. A model that would run on past its
    /// limit (a JSON object nesting for ever) still ends inside its grammar.
    pub fn finish_in_time(&self, picked: u32, remaining: usize) -> u32 {
        if self.eos.contains(&picked) {
            return picked;
        }
        let m = self.matcher.lock().expect("matcher");
        let mut cached = self.finish.lock().expect("finish");
        if cached.is_none() {
            *cached = self.finishers.finish(&m, None);
        }
        // No finish found (a format the search cannot spell): the model's pick.
        let Some(now) = cached.as_ref() else { return picked };
        // One token more, its finish, and the end of output must all fit.
        let fits = |after: usize| after + 2 <= remaining;
        let keep = match now.first() {
            Some(&first) if first == picked => fits(now.len() - 1),
            _ => self.finishers.finish(&m, Some(picked)).is_some_and(|after| fits(after.len())),
        };
        match (keep, now.first()) {
            (true, _) => picked,
            (false, Some(&first)) => first,
            // Already complete: end here.
            (false, None) => self.eos.first().copied().unwrap_or(picked),
        }
    }
}

/// Finishes longer than this are not looked for.
const MAX_FINISH: usize = 96;

/// The single-character tokens a shortest finish is spelled with, in the order they
/// are tried: closing a string, then structures, then the smallest value, then any
/// other (a literal the grammar forces: a key's name, a tool call's closing tag).
pub struct Finishers {
    quote: Option<u32>,
    /// A letter: allowed only inside a string (or a literal), which tells a string's
    /// end from an object's next key.
    letter: Option<u32>,
    preferred: Vec<u32>,
    others: Vec<u32>,
}

impl Finishers {
    fn new(trie: &TokTrie) -> Self {
        let id = |c: u8| trie.token_id(&[c]);
        let preferred: Vec<u32> = b"}]0:,".iter().filter_map(|&c| id(c)).collect();
        let others = (0x21u8..0x7f).chain(*b"\n ").filter(|c| !b"}]0:,\"".contains(c)).filter_map(id).collect();
        Self { quote: id(b'"'), letter: id(b'a'), preferred, others }
    }

    /// The tokens of a short finish from `m`'s state (after `first`, if given), found
    /// greedily: a string closes first, then structures, then the smallest value.
    /// None if none is found within `MAX_FINISH` tokens (or `first` is refused).
    fn finish(&self, m: &Matcher, first: Option<u32>) -> Option<Vec<u32>> {
        let mut m = m.deep_clone();
        if let Some(t) = first {
            m.try_consume_tokens(&[t]).ok().filter(|&n| n == 1)?;
        }
        let mut out = Vec::new();
        let ok = |m: &mut Matcher, t: u32| m.validate_tokens(&[t]).is_ok_and(|n| n == 1);
        while !(m.is_stopped() || m.is_accepting().unwrap_or(false)) {
            if out.len() >= MAX_FINISH {
                return None;
            }
            let in_string = self.letter.is_some_and(|a| ok(&mut m, a));
            let quote = self.quote.filter(|&q| in_string && ok(&mut m, q));
            let next = quote
                .or_else(|| self.preferred.iter().copied().find(|&t| ok(&mut m, t)))
                .or_else(|| self.quote.filter(|&q| ok(&mut m, q)))
                .or_else(|| self.others.iter().copied().find(|&t| ok(&mut m, t)))?;
            m.consume_token(next).ok()?;
            out.push(next);
        }
        Some(out)
    }
}
