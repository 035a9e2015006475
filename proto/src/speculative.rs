//! Speculative decoding's settings, as a catalog entry states them and as they travel
//! to the worker that serves the model (its command line, or its assignment in etcd).

use serde::{Deserialize, Serialize};

/// Most tokens a configuration may propose per step.
pub const MAX_SPEC_TOKENS: usize = 16;
/// Tokens proposed per step unless configured.
pub const DEFAULT_SPEC_TOKENS: usize = 8;

/// How a model speculates: `speculative = { method = "ngram", max_tokens = 8 }`. Read
/// leniently (a field a newer control plane adds does not fail an older worker's
/// assignment); the catalog refuses unknown keys itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecConfig {
    pub method: SpecMethod,
    /// Most tokens proposed for one sequence in one step.
    #[serde(default = "default_tokens")]
    pub max_tokens: usize,
}

pub fn default_tokens() -> usize {
    DEFAULT_SPEC_TOKENS
}

/// Where proposed tokens come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecMethod {
    /// The sequence's own prompt and output (prompt-lookup decoding).
    Ngram,
    /// Those, and the recent prompts and outputs of the same tenant's requests.
    Suffix,
}

impl SpecConfig {
    /// Why the settings cannot work, if they cannot.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_SPEC_TOKENS).contains(&self.max_tokens) {
            return Err(format!("speculative max_tokens is {}; it must be 1 to {MAX_SPEC_TOKENS}", self.max_tokens));
        }
        Ok(())
    }
}

impl SpecMethod {
    pub const ALL: [SpecMethod; 2] = [SpecMethod::Ngram, SpecMethod::Suffix];

    pub fn as_str(self) -> &'static str {
        match self {
            SpecMethod::Ngram => "ngram",
            SpecMethod::Suffix => "suffix",
        }
    }
}

impl std::str::FromStr for SpecMethod {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| {
            let known: Vec<&str> = Self::ALL.iter().map(|m| m.as_str()).collect();
            format!("unknown speculative method {s:?} (known: {})", known.join(", "))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_and_methods_named() {
        assert!(SpecConfig { method: SpecMethod::Ngram, max_tokens: 0 }.check().is_err());
        assert!(SpecConfig { method: SpecMethod::Ngram, max_tokens: 17 }.check().is_err());
        assert!(SpecConfig { method: SpecMethod::Ngram, max_tokens: 4 }.check().is_ok());
        assert_eq!("ngram".parse::<SpecMethod>(), Ok(SpecMethod::Ngram));
        assert!("medusa".parse::<SpecMethod>().unwrap_err().contains("known: ngram, suffix"));
        assert_eq!("suffix".parse::<SpecMethod>(), Ok(SpecMethod::Suffix));
        let c: SpecConfig = serde_json::from_str(r#"{"method": "ngram"}"#).unwrap();
        assert_eq!(c, SpecConfig { method: SpecMethod::Ngram, max_tokens: DEFAULT_SPEC_TOKENS });
        let later: SpecConfig = serde_json::from_str(r#"{"method": "ngram", "max_tokens": 3, "later": 1}"#).unwrap();
        assert_eq!(later.max_tokens, 3, "fields of later versions are ignored");
    }
}
