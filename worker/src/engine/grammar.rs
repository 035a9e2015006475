//! Constrained decoding: a request's grammar (a JSON schema, any JSON object, or a Lark
//! grammar) compiled by llguidance against the model's tokenizer, and a matcher per
//! sequence that masks the logits at every step to the tokens the grammar allows.
//!
//! The tokenizer's token trie and the parser factory are built once per model; compiled
//! grammars are cached by their text, so a schema sent again starts from a clone.

use llguidance::api::TopLevelGrammar;
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

/// Compiled grammars cached beyond this many are dropped, oldest first.
const CACHE_CAPACITY: usize = 256;

pub struct Grammars {
    factory: ParserFactory,
    eos: Vec<u32>,
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
    pub fn new(tokenizer_json: &str, eos: &[u32], vocab: usize) -> Result<Self, String> {
        let mut bytes = toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(tokenizer_json.as_bytes())
            .map_err(|e| format!("the tokenizer cannot drive constrained decoding: {e}"))?;
        if !eos.is_empty() {
            bytes.set_eos_tokens(eos);
        }
        let env = bytes.into_tok_env(Some(vocab)).map_err(|e| format!("token trie: {e}"))?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| format!("grammar factory: {e}"))?;
        factory.quiet();
        Ok(Self { factory, eos: eos.to_vec(), cache: Mutex::new(Cache::default()) })
    }

    /// A fresh matcher for `spec`, or why the grammar does not compile.
    pub fn matcher(&self, spec: &GrammarSpec) -> Result<Constraint, String> {
        let cached = self.cache.lock().expect("grammar cache").parsers.get(spec).map(|p| p.deep_clone());
        let parser = match cached {
            Some(p) => p,
            None => {
                let parser = self.factory.create_parser(top_level(spec)?).map_err(|e| e.to_string())?;
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
            Some(e) => Err(e),
            None => Ok(Constraint { matcher: Arc::new(Mutex::new(matcher)), eos: self.eos.clone() }),
        }
    }
}

/// `Grammars` for a model, built on first use: the token trie of a large vocabulary
/// takes a moment, which requests without a grammar never pay.
pub struct GrammarSource {
    tokenizer_json: String,
    eos: Vec<u32>,
    vocab: usize,
    built: OnceLock<Result<Grammars, String>>,
}

impl GrammarSource {
    pub fn new(tokenizer_json: String, eos: Vec<u32>, vocab: usize) -> Self {
        Self { tokenizer_json, eos, vocab, built: OnceLock::new() }
    }

    /// A matcher for `spec` (blocking: call it off the async threads).
    pub fn matcher(&self, spec: &GrammarSpec) -> Result<Constraint, String> {
        let grammars = self.built.get_or_init(|| Grammars::new(&self.tokenizer_json, &self.eos, self.vocab));
        grammars.as_ref().map_err(Clone::clone)?.matcher(spec)
    }
}

fn top_level(spec: &GrammarSpec) -> Result<TopLevelGrammar, String> {
    Ok(match spec {
        GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
        GrammarSpec::JsonSchema(text) => {
            let schema: serde_json::Value =
                serde_json::from_str(text).map_err(|e| format!("the JSON schema is not JSON: {e}"))?;
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
        Self { matcher: Arc::new(Mutex::new(m)), eos: self.eos.clone() }
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

    /// Advances past a sampled token (one `mask` allowed). A matcher that refuses it
    /// keeps its error, and the next `mask` ends the output.
    pub fn accept(&self, token: u32) {
        let mut m = self.matcher.lock().expect("matcher");
        if !m.is_stopped() {
            let _ = m.consume_token(token);
        }
    }
}
