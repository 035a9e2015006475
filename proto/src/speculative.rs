//! Speculative decoding's settings, as a catalog entry states them and as they travel
//! to the worker that serves the model (its command line, or its assignment in etcd).

use serde::{Deserialize, Serialize};

/// Most tokens a configuration may propose per step.
pub const MAX_SPEC_TOKENS: usize = 16;
/// Tokens proposed per step unless configured.
pub const DEFAULT_SPEC_TOKENS: usize = 8;

/// How a model speculates: `speculative = { method = "ngram", max_tokens = 8 }`, or
/// `{ method = "draft", draft = "qwen2.5-coder-0.5b-instruct", max_tokens = 4 }`. Read
/// leniently (a field a newer control plane adds does not fail an older worker's
/// assignment); the catalog refuses unknown keys itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecConfig {
    pub method: SpecMethod,
    /// Most tokens proposed for one sequence in one step.
    #[serde(default = "default_tokens")]
    pub max_tokens: usize,
    /// The draft model of `method = "draft"`: a known model's name or a path on the
    /// worker, with the target's tokenizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft: Option<String>,
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
    /// A smaller model with the same tokenizer, run ahead of the target.
    Draft,
}

/// Why speculative settings cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("speculative max_tokens is {0}; it must be 1 to {MAX_SPEC_TOKENS}")]
    MaxTokens(usize),
    #[error("speculative method \"draft\" needs its draft model: draft = \"<model>\"")]
    NoDraft,
    #[error("speculative method {0:?} takes no draft model (only \"draft\" does)")]
    DraftNotTaken(&'static str),
}

impl SpecConfig {
    /// Why the settings cannot work, if they cannot.
    pub fn check(&self) -> Result<(), SpecError> {
        if !(1..=MAX_SPEC_TOKENS).contains(&self.max_tokens) {
            return Err(SpecError::MaxTokens(self.max_tokens));
        }
        match (self.method, self.draft.as_deref()) {
            (SpecMethod::Draft, None | Some("")) => Err(SpecError::NoDraft),
            (SpecMethod::Draft, Some(_)) | (_, None) => Ok(()),
            (method, Some(_)) => Err(SpecError::DraftNotTaken(method.as_str())),
        }
    }
}

impl SpecMethod {
    pub const ALL: [SpecMethod; 3] = [SpecMethod::Ngram, SpecMethod::Suffix, SpecMethod::Draft];

    pub fn as_str(self) -> &'static str {
        match self {
            SpecMethod::Ngram => "ngram",
            SpecMethod::Suffix => "suffix",
            SpecMethod::Draft => "draft",
        }
    }
}

impl std::str::FromStr for SpecMethod {
    type Err = crate::UnknownName;

    fn from_str(s: &str) -> Result<Self, crate::UnknownName> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| crate::UnknownName::new("speculative method", s, Self::ALL.map(Self::as_str)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_and_methods_named() {
        let ngram = |max_tokens| SpecConfig { method: SpecMethod::Ngram, max_tokens, draft: None };
        assert!(ngram(0).check().is_err());
        assert!(ngram(17).check().is_err());
        assert!(ngram(4).check().is_ok());
        let draft =
            |draft: Option<&str>| SpecConfig { method: SpecMethod::Draft, max_tokens: 4, draft: draft.map(Into::into) };
        assert!(draft(Some("small")).check().is_ok());
        assert_eq!(draft(None).check(), Err(SpecError::NoDraft));
        assert!(SpecError::NoDraft.to_string().contains("needs its draft model"));
        assert!(draft(Some("")).check().is_err());
        let stray = SpecConfig { draft: Some("small".into()), ..ngram(4) };
        assert!(stray.check().unwrap_err().to_string().contains("takes no draft model"));
        assert_eq!("ngram".parse::<SpecMethod>(), Ok(SpecMethod::Ngram));
        assert!("medusa".parse::<SpecMethod>().unwrap_err().to_string().contains("known: ngram, suffix, draft"));
        assert_eq!("suffix".parse::<SpecMethod>(), Ok(SpecMethod::Suffix));
        assert_eq!("draft".parse::<SpecMethod>(), Ok(SpecMethod::Draft));
        let c: SpecConfig = serde_json::from_str(r#"{"method": "ngram"}"#).unwrap();
        assert_eq!(c, ngram(DEFAULT_SPEC_TOKENS));
        assert!(!serde_json::to_string(&c).unwrap().contains("draft"), "no draft field unless there is one");
        let d: SpecConfig = serde_json::from_str(r#"{"method": "draft", "draft": "small"}"#).unwrap();
        assert_eq!(d.draft.as_deref(), Some("small"));
        let later: SpecConfig = serde_json::from_str(r#"{"method": "ngram", "max_tokens": 3, "later": 1}"#).unwrap();
        assert_eq!(later.max_tokens, 3, "fields of later versions are ignored");
    }
}
