//! The model catalog (`deploy/catalog.toml`): ids, prices, capabilities, reasoning
//! defaults, and the weights each model is served from.

use crate::chat::output::{Markers, ToolFormat};
use serde::Deserialize;
use std::collections::BTreeSet;
use std::path::Path;
use tessera_proto::speculative::SpecConfig;

/// The catalog shipped with the binary, used when no `--catalog` is given.
pub const DEFAULT: &str = include_str!("../../deploy/catalog.toml");

/// The chat templates the built-in catalog names, shipped with the binary too.
const BUILT_IN_TEMPLATES: [(&str, &str); 4] = [
    ("templates/model-a.jinja", include_str!("../../deploy/templates/model-a.jinja")),
    ("templates/model-b.jinja", include_str!("../../deploy/templates/model-b.jinja")),
    ("templates/model-c.jinja", include_str!("../../deploy/templates/model-c.jinja")),
    ("templates/model-d.jinja", include_str!("../../deploy/templates/model-d.jinja")),
];

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Catalog {
    pub models: Vec<CatalogModel>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogModel {
    /// `<vendor>/<model>`; requests must name it exactly.
    pub id: String,
    pub name: String,
    pub context_length: u32,
    pub quantization: String,
    /// A model name `tessera-worker` resolves (or a GGUF path / HF directory).
    pub weights: String,
    pub prices: Prices,
    pub capabilities: Capabilities,
    pub reasoning: Reasoning,
    /// Defaults that a request's `chat_template_kwargs` are merged over.
    #[serde(default)]
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// The model family's chat template, a path relative to the catalog's folder;
    /// without one, the template that came with the weights.
    #[serde(default)]
    pub chat_template: Option<String>,
    /// How the family's template asks for tool calls, and so how they are read back.
    #[serde(default)]
    pub tool_format: ToolFormat,
    /// Speculative decoding for the model's weights: `{ method = "ngram", max_tokens
    /// = 8 }`, or a draft model's `{ method = "draft", draft = "<weights>", max_tokens =
    /// 4 }`; off without it.
    #[serde(default, deserialize_with = "strict_spec")]
    pub speculative: Option<SpecConfig>,
    /// `chat_template`'s text, read when the catalog is loaded.
    #[serde(skip)]
    pub chat_template_source: Option<String>,
}

/// `speculative` as the catalog writes it: unknown keys refused (a misspelt
/// `max_tokens` must not pass silently), unlike the lenient copy workers read.
fn strict_spec<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<SpecConfig>, D::Error> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Strict {
        method: tessera_proto::speculative::SpecMethod,
        #[serde(default = "tessera_proto::speculative::default_tokens")]
        max_tokens: usize,
        #[serde(default)]
        draft: Option<String>,
    }
    let s = Strict::deserialize(d)?;
    Ok(Some(SpecConfig { method: s.method, max_tokens: s.max_tokens, draft: s.draft }))
}

/// Micro-dollars per million tokens.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    pub input: u64,
    pub cache_read: Option<u64>,
    pub output: u64,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capabilities {
    pub image_input: bool,
    pub video_input: bool,
    pub tool_calling: bool,
    pub structured_output: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reasoning {
    /// `on`, `off` or `adaptive`.
    pub default: String,
    /// Where a request turns it (documentation for operators and the console).
    pub control: String,
    /// The markers around the family's chain-of-thought.
    #[serde(default = "no_markers")]
    pub markers: Markers,
    /// With thinking off the model may still think and end with a bare closing
    /// marker (docs/api.md, Reasoning): the start of the output is held back until
    /// that marker or the end shows which it was.
    #[serde(default)]
    pub bare_close: bool,
    /// Reasoning tokens a completion may spend when the request names no budget;
    /// absent: `--thinking-budget`, else no limit.
    #[serde(default)]
    pub thinking_budget: Option<u32>,
}

fn no_markers() -> Markers {
    Markers::Plain
}

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("cannot read catalog {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("catalog {path}: {message}")]
    Invalid { path: String, message: String },
}

impl Catalog {
    /// Gives models whose entry names no thinking budget the server's default.
    pub fn default_thinking_budget(mut self, budget: Option<u32>) -> Self {
        for m in &mut self.models {
            m.reasoning.thinking_budget = m.reasoning.thinking_budget.or(budget);
        }
        self
    }

    pub fn load(path: Option<&Path>) -> Result<Self, CatalogError> {
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|source| CatalogError::Read { path: p.display().to_string(), source })
        };
        let mut catalog = match path {
            None => Self::parse(DEFAULT, "built-in catalog")?,
            Some(p) => Self::parse(&read(p)?, &p.display().to_string())?,
        };
        for m in &mut catalog.models {
            let Some(name) = &m.chat_template else { continue };
            m.chat_template_source = Some(match path {
                None => {
                    BUILT_IN_TEMPLATES.iter().find(|(n, _)| n == name).map(|(_, text)| text.to_string()).ok_or_else(
                        || CatalogError::Invalid {
                            path: "built-in catalog".into(),
                            message: format!("{}: no built-in template {name}", m.id),
                        },
                    )?
                }
                Some(p) => read(&p.parent().unwrap_or(Path::new(".")).join(name))?,
            });
        }
        Ok(catalog)
    }

    pub fn parse(text: &str, origin: &str) -> Result<Self, CatalogError> {
        let invalid = |message: String| CatalogError::Invalid { path: origin.to_string(), message };
        let catalog: Catalog = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let mut seen = BTreeSet::new();
        for m in &catalog.models {
            let valid_id =
                m.id.split_once('/').is_some_and(|(v, n)| !v.is_empty() && !n.is_empty() && !n.contains('/'));
            if !valid_id {
                return Err(invalid(format!("model id {:?} is not <vendor>/<model>", m.id)));
            }
            if !seen.insert(m.id.as_str()) {
                return Err(invalid(format!("model id {:?} is listed twice", m.id)));
            }
            if m.context_length == 0 {
                return Err(invalid(format!("{}: context_length must be positive", m.id)));
            }
            if !["on", "off", "adaptive"].contains(&m.reasoning.default.as_str()) {
                return Err(invalid(format!("{}: reasoning.default must be on, off or adaptive", m.id)));
            }
            if let Some(spec) = &m.speculative {
                spec.check().map_err(|e| invalid(format!("{}: {e}", m.id)))?;
            }
            // One worker serves each weights: the models on them must speculate alike.
            if let Some(other) =
                catalog.models.iter().find(|o| o.weights == m.weights && o.speculative != m.speculative)
            {
                return Err(invalid(format!(
                    "{} and {} share weights {} but not their speculative settings",
                    m.id, other.id, m.weights
                )));
            }
        }
        Ok(catalog)
    }

    pub fn get(&self, id: &str) -> Option<&CatalogModel> {
        self.models.iter().find(|m| m.id == id)
    }

    /// Speculative decoding for the worker serving `weights` (all its models agree).
    pub fn speculative(&self, weights: &str) -> Option<SpecConfig> {
        self.models.iter().find(|m| m.weights == weights).and_then(|m| m.speculative.clone())
    }

    /// The distinct weights the catalog needs, each served by one worker.
    pub fn weights(&self) -> Vec<String> {
        let set: BTreeSet<&str> = self.models.iter().map(|m| m.weights.as_str()).collect();
        set.into_iter().map(String::from).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_proto::speculative::SpecMethod;

    #[test]
    fn the_shipped_catalog_lists_the_four_models_of_the_spec() {
        let c = Catalog::load(None).unwrap();
        let ids: Vec<&str> = c.models.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["vendor-a/model-a", "vendor-b/model-b", "vendor-c/model-c", "vendor-d/model-d"]);
        let a = c.get("vendor-a/model-a").unwrap();
        assert_eq!((a.prices.input, a.prices.cache_read, a.prices.output), (700_000, Some(160_000), 3_500_000));
        assert_eq!(a.context_length, 262_144);
        assert!(a.capabilities.image_input);
        assert!(!c.get("vendor-b/model-b").unwrap().capabilities.image_input);
        assert_eq!(c.get("vendor-c/model-c").unwrap().prices.cache_read, None);
        assert_eq!(c.get("vendor-d/model-d").unwrap().chat_template_kwargs["thinking_mode"], "adaptive");
        assert_eq!(c.weights(), ["smollm2-135m-instruct"]);
        assert!(c.get("model-a").is_none(), "only the full id names a model");
    }

    #[test]
    fn bad_catalogs_are_refused_with_the_reason() {
        let one = |id: &str| {
            format!(
                "[[models]]\nid = \"{id}\"\nname = \"X\"\ncontext_length = 10\nquantization = \"Q\"\nweights = \"w\"\n\
                 prices = {{ input = 1, output = 2 }}\n\
                 capabilities = {{ image_input = false, video_input = false, tool_calling = true, structured_output = true }}\n\
                 reasoning = {{ default = \"off\", control = \"none\" }}\n"
            )
        };
        assert!(Catalog::parse(&one("v/m"), "t").is_ok());
        let err = Catalog::parse(&one("model-a"), "t").unwrap_err().to_string();
        assert!(err.contains("<vendor>/<model>"), "{err}");
        let err = Catalog::parse(&format!("{}{}", one("v/m"), one("v/m")), "t").unwrap_err().to_string();
        assert!(err.contains("twice"), "{err}");
        let err = Catalog::parse(&one("v/m").replace("prices", "price"), "t").unwrap_err().to_string();
        assert!(err.contains("price"), "{err}");
    }

    #[test]
    fn speculative_settings_are_read_checked_and_agree_per_weights() {
        let one = |id: &str, spec: &str| {
            format!(
                "[[models]]\nid = \"{id}\"\nname = \"X\"\ncontext_length = 10\nquantization = \"Q\"\nweights = \"w\"\n\
                 prices = {{ input = 1, output = 2 }}\n\
                 capabilities = {{ image_input = false, video_input = false, tool_calling = true, structured_output = true }}\n\
                 reasoning = {{ default = \"off\", control = \"none\" }}\n{spec}"
            )
        };
        let spec = "speculative = { method = \"ngram\", max_tokens = 4 }\n";
        let c = Catalog::parse(&format!("{}{}", one("v/a", spec), one("v/b", spec)), "t").unwrap();
        assert_eq!(c.speculative("w"), Some(SpecConfig { method: SpecMethod::Ngram, max_tokens: 4, draft: None }));
        let draft = "speculative = { method = \"draft\", draft = \"small\", max_tokens = 3 }\n";
        let d = Catalog::parse(&one("v/a", draft), "t").unwrap().speculative("w").unwrap();
        assert_eq!((d.method, d.draft.as_deref(), d.max_tokens), (SpecMethod::Draft, Some("small"), 3));
        let err = Catalog::parse(&one("v/a", "speculative = { method = \"draft\" }\n"), "t").unwrap_err().to_string();
        assert!(err.contains("needs its draft model"), "{err}");
        assert_eq!(Catalog::parse(&one("v/a", ""), "t").unwrap().speculative("w"), None);
        let err = Catalog::parse(&format!("{}{}", one("v/a", spec), one("v/b", "")), "t").unwrap_err().to_string();
        assert!(err.contains("share weights w"), "{err}");
        let err = Catalog::parse(&one("v/a", "speculative = { method = \"ngram\", max_tokens = 99 }\n"), "t")
            .unwrap_err()
            .to_string();
        assert!(err.contains("1 to 16"), "{err}");
        let err = Catalog::parse(&one("v/a", "speculative = { method = \"medusa\" }\n"), "t").unwrap_err().to_string();
        assert!(err.contains("medusa"), "{err}");
        let err = Catalog::parse(&one("v/a", "speculative = { method = \"ngram\", max_token = 4 }\n"), "t")
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_token"), "{err}");
    }
}
