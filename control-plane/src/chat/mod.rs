//! Turning API messages into a prompt: the message list the model's chat template
//! reads, the template rendered with the request's and the catalog's kwargs, tokens.

pub mod budget;
pub mod grammar;
pub mod output;
pub mod reasoning;
pub mod schema;
pub mod shortest;
pub mod tools;
pub mod vision;

use crate::images::Visual;
use crate::router::ServedModel;
use output::Reading;
use reasoning::Thinking;
use serde_json::{Map, Value};
use std::sync::Arc;
use tessera_proto::block_hash::{ImageSpan, image_spans};
use tessera_proto::chat_template::Rendered;
use tessera_proto::worker as pb;
use tools::Tools;
use vision::{ExpandError, Expanded};

/// Why a chat-shaped request cannot be made ready. The API answers each (`api::error`);
/// all but `Internal` are the request's doing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChatError {
    #[error("{model} has no chat template; use /v1/completions")]
    NoTemplate { model: String },
    /// A template's `raise_exception`: about the request's messages or its kwargs.
    #[error("The chat template refused this request: {0}")]
    TemplateRefused(String),
    #[error("Invalid content: the text contains {token}, the model's image placeholder; send images as image parts.")]
    TextHasImageToken { param: &'static str, token: String },
    #[error("Invalid content: {model}'s chat template does not show images where this request puts them.")]
    ImagesNotShown { param: &'static str, model: String },
    /// A constrained output whose shortest valid answer cannot fit `max_tokens`.
    #[error(
        "'{param}' is {max_tokens}, too few for any valid answer: the shortest the requested format allows takes \
         {floor} tokens{}.",
        if *must_close > 0 { format!(", after the {must_close} that end the reasoning") } else { String::new() }
    )]
    TooFewTokens { param: &'static str, max_tokens: u32, floor: usize, must_close: usize },
    /// Our own failure (a tokenizer error, images that do not add up).
    #[error("{0}")]
    Internal(String),
}

/// A chat-shaped request made ready for a worker: its prompt, the grammar its output
/// is decoded under, and how that output is read back.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub grammar: Option<(pb::Grammar, &'static str)>,
    pub reading: Reading,
    /// Where the output begins: in reasoning, with thinking off, or free to think.
    pub thinking: Thinking,
    /// With a constrained output, the shortest answer it allows (`shortest::answer`).
    pub shortest: Option<String>,
    /// The images the prompt's placeholders stand for, as the worker takes them, and
    /// the tokens each takes (for the prefix-block hashes it is routed by).
    pub images: Vec<pb::ImageInput>,
    pub image_spans: Vec<ImageSpan>,
    /// A video's frames: how many the prompt kept of how many were sent, when the
    /// request had any.
    pub frames: Option<(usize, usize)>,
}

/// What a request shows the model, and the room its output needs after the prompt
/// (frames are sampled down until prompt and room fit the context).
#[derive(Debug, Clone, Copy)]
pub struct Shown<'a> {
    pub visuals: &'a [Visual],
    pub room: usize,
    /// The parameter holding the messages (`messages`, `input`), named in errors.
    pub param: &'static str,
}

/// Renders the prompt with the tools the model may call, and decides from the family's
/// markers and the template's thinking state how the output is constrained and read.
pub fn prepare(
    model: &ServedModel,
    messages: &[Value],
    tools: Option<&Tools>,
    kwargs: &Map<String, Value>,
    format: Option<(pb::Grammar, &'static str)>,
    shown: Shown<'_>,
) -> Result<Prepared, ChatError> {
    let callable = tools.filter(|t| t.callable());
    let rendered = render(model, messages, callable.map(Tools::for_template).as_ref(), kwargs)?;
    let (prompt, images, image_spans, frames) = with_visuals(model, &rendered.text, shown)?;
    let reasoning = &model.entry.reasoning;
    let thinking = Thinking::of(&rendered, reasoning.markers);
    let tool_format = model.entry.tool_format;
    let shortest = shortest::answer(callable, format.as_ref().map(|(g, _)| g), tool_format);
    let grammar = grammar::compose(thinking, reasoning.markers, tool_format, callable, format);
    let reading = Reading {
        markers: reasoning.markers,
        start: thinking.start(reasoning.bare_close, grammar.is_some()),
        tools: callable.map(|_| tool_format),
        bare_calls: grammar.is_none(),
        declared: callable.map(|t| Arc::new(t.declared())),
    };
    let shortest = shortest.filter(|_| grammar.is_some());
    Ok(Prepared { prompt, grammar, reading, thinking, shortest, images, image_spans, frames })
}

/// The rendered prompt's tokens with each visual's placeholder expanded, and the images
/// the worker fills them with. Videos whose frames do not fit the context are sampled
/// down, all to the same most frames that fit (docs/api.md, Video).
fn with_visuals(model: &ServedModel, text: &str, shown: Shown<'_>) -> Result<WithVisuals, ChatError> {
    if shown.visuals.is_empty() {
        return Ok((tokenize(model, text)?, Vec::new(), Vec::new(), None));
    }
    let Some(vision) = model.vision() else {
        return Err(ChatError::Internal(format!("{} was handed images but reads none", model.entry.id)));
    };
    let frames: Vec<usize> = shown
        .visuals
        .iter()
        .filter_map(|v| match v {
            Visual::Video { frames } => Some(frames.len()),
            Visual::Image { .. } => None,
        })
        .collect();
    let sent: usize = frames.iter().sum();
    let expand = |most: usize| -> Result<(Vec<u32>, Expanded), ChatError> {
        let keep: Vec<Vec<usize>> = frames.iter().map(|&n| vision::sample(n, most)).collect();
        let expanded = vision.expand(text, shown.visuals, &keep).map_err(|e| match e {
            ExpandError::TextHasToken => {
                ChatError::TextHasImageToken { param: shown.param, token: vision.image_token().to_string() }
            }
            ExpandError::TemplateDrops => {
                ChatError::ImagesNotShown { param: shown.param, model: model.entry.id.clone() }
            }
        })?;
        Ok((tokenize(model, &expanded.text)?, expanded))
    };
    let context = model.context_length() as usize;
    let fits = |prompt: &[u32]| prompt.len() + shown.room <= context;
    let longest = frames.iter().copied().max().unwrap_or(0).min(vision.max_frames().max(1));
    let (mut prompt, mut expanded) = expand(longest)?;
    if !frames.is_empty() && !fits(&prompt) {
        // The most frames that fit, by bisection: the prompt grows with every frame.
        let (mut lo, mut hi) = (1, longest);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if fits(&expand(mid)?.0) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        (prompt, expanded) = expand(lo)?;
    }
    let counted: Vec<(usize, [u8; 32])> = expanded
        .tokens
        .iter()
        .zip(&expanded.images)
        .map(|(&n, i)| (n, i.sha256.as_slice().try_into().unwrap_or([0; 32])))
        .collect();
    let spans = image_spans(&prompt, vision.image_token_id(), &counted).ok_or_else(|| {
        ChatError::Internal(format!("{}: the prompt's image tokens do not match its images", model.entry.id))
    })?;
    let kept = expanded.images.iter().filter(|i| i.frame).count();
    Ok((prompt, expanded.images, spans, (!frames.is_empty()).then_some((kept, sent))))
}

/// A prompt's tokens, its images, where they sit, and its video frames kept of sent.
type WithVisuals = (Vec<u32>, Vec<pb::ImageInput>, Vec<ImageSpan>, Option<(usize, usize)>);

/// The catalog's `chat_template_kwargs` for the model with the request's merged over
/// them (unknown keys are passed along and ignored by templates that do not read them).
pub fn template_kwargs(model: &ServedModel, request: Option<&Map<String, Value>>) -> Map<String, Value> {
    let mut kwargs = model.entry.chat_template_kwargs.clone();
    if let Some(r) = request {
        for (k, v) in r {
            kwargs.insert(k.clone(), v.clone());
        }
    }
    kwargs
}

/// The template rendered over the messages, tools and kwargs (special tokens in the
/// text are parsed as such when it is tokenized; none are added).
fn render(
    model: &ServedModel,
    messages: &[Value],
    tools: Option<&Value>,
    kwargs: &Map<String, Value>,
) -> Result<Rendered, ChatError> {
    let template = model.template.as_ref().ok_or_else(|| ChatError::NoTemplate { model: model.entry.id.clone() })?;
    template
        .render_json(&Value::Array(messages.to_vec()), tools, true, kwargs)
        .map_err(|e| ChatError::TemplateRefused(e.to_string()))
}

pub fn tokenize(model: &ServedModel, text: &str) -> Result<Vec<u32>, ChatError> {
    let encoding =
        model.replica.tokenizer.encode(text, false).map_err(|e| ChatError::Internal(format!("tokenizing: {e}")))?;
    Ok(encoding.get_ids().to_vec())
}

#[cfg(test)]
mod tests {
    use super::reasoning::Thinking;
    use crate::catalog::Catalog;
    use serde_json::{Map, Value, json};
    use tessera_proto::chat_template::{ChatTemplate, Rendered};

    /// The model's catalog template rendered with its catalog kwargs and `request`'s over them.
    fn render(
        model: &str,
        request: Value,
        messages: Value,
        tools: Option<Value>,
    ) -> Result<(Rendered, Thinking), String> {
        let catalog = Catalog::load(None).unwrap();
        let entry = catalog.get(model).unwrap();
        let t = ChatTemplate::new(entry.chat_template_source.as_deref().unwrap(), "", "<|im_end|>").unwrap();
        let mut kwargs: Map<String, Value> = entry.chat_template_kwargs.clone();
        kwargs.extend(request.as_object().unwrap().clone());
        let r = t.render_json(&messages, tools.as_ref(), true, &kwargs).map_err(|e| e.to_string())?;
        let thinking = Thinking::of(&r, entry.reasoning.markers);
        Ok((r, thinking))
    }

    fn thinking(model: &str, request: Value) -> Thinking {
        render(model, request, json!([{"role": "user", "content": "hi"}]), None).unwrap().1
    }

    #[test]
    fn each_family_turns_thinking_with_its_own_controls_and_defaults() {
        use Thinking::*;
        let cases = [
            ("vendor-a/model-a", json!({}), Open),
            ("vendor-a/model-a", json!({"thinking": false}), Off),
            ("vendor-a/model-a", json!({"enable_thinking": false}), Open),
            ("vendor-b/model-b", json!({}), Open),
            ("vendor-b/model-b", json!({"enable_thinking": false}), Off),
            ("vendor-b/model-b", json!({"reasoning_effort": "max"}), Open),
            ("vendor-b/model-b", json!({"reasoning_effort": "none"}), Off),
            ("vendor-c/model-c", json!({}), Off),
            ("vendor-c/model-c", json!({"enable_thinking": true}), Optional),
            ("vendor-c/model-c", json!({"thinking": true}), Off),
            ("vendor-d/model-d", json!({}), Optional),
            ("vendor-d/model-d", json!({"thinking_mode": "enabled"}), Open),
            ("vendor-d/model-d", json!({"thinking_mode": "disabled"}), Off),
        ];
        for (model, request, want) in cases {
            assert_eq!(thinking(model, request.clone()), want, "{model} {request}");
        }
        // Rule 4: both keys together turn it off on every model that has a switch.
        for model in ["vendor-a/model-a", "vendor-b/model-b", "vendor-c/model-c"] {
            assert_eq!(thinking(model, json!({"thinking": false, "enable_thinking": false})), Off, "{model}");
        }
        let e = render(
            "vendor-d/model-d",
            json!({"thinking_mode": "sometimes"}),
            json!([{"role": "user", "content": "x"}]),
            None,
        );
        assert!(e.unwrap_err().contains("thinking_mode"));
    }

    #[test]
    fn model_b_effort_and_earlier_thinking() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let (max, _) = render("vendor-b/model-b", json!({"reasoning_effort": "max"}), user.clone(), None).unwrap();
        assert!(max.text.contains("Reasoning effort: max"), "{}", max.text);
        let (off, _) =
            render("vendor-b/model-b", json!({"reasoning_effort": "max", "enable_thinking": false}), user, None)
                .unwrap();
        assert!(!off.text.contains("Reasoning effort"), "no effect with thinking off: {}", off.text);
        let history = json!([{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "Hello.", "reasoning": "greet back"},
                             {"role": "user", "content": "again"}]);
        let (cleared, _) = render("vendor-b/model-b", json!({}), history.clone(), None).unwrap();
        assert!(!cleared.text.contains("greet back"), "cleared by default");
        let (kept, _) = render("vendor-b/model-b", json!({"clear_thinking": false}), history, None).unwrap();
        assert!(kept.text.contains("<think>\ngreet back\n</think>"), "{}", kept.text);
    }

    #[test]
    fn tools_calls_and_results_reach_every_family_prompt() {
        let tools =
            json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        let history = json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
        ]);
        let hermes = [
            ("<tools>\n", "</tools>"),
            ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", ""),
            ("<tool_response>\n22C\n</tool_response>", ""),
        ];
        let mistral = [
            ("[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"),
            ("[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]", ""),
            ("[TOOL_RESULTS]{\"call_id\": \"call_1\", \"content\": \"22C\"}[/TOOL_RESULTS]", ""),
        ];
        let families = [
            ("vendor-a/model-a", hermes),
            ("vendor-b/model-b", hermes),
            ("vendor-c/model-c", hermes),
            ("vendor-d/model-d", mistral),
        ];
        for (model, [(offer, offer_end), (call, _), (result, _)]) in families {
            let catalog = Catalog::load(None).unwrap();
            assert!(
                catalog.get(model).unwrap().tool_format.open().starts_with(&call[..1]),
                "{model}'s parser reads its template's calls"
            );
            let (r, _) = render(model, json!({}), history.clone(), Some(tools.clone())).unwrap();
            let offered = r.text.split(offer).nth(1).and_then(|t| t.split(offer_end).next()).unwrap_or_default();
            assert!(offered.contains("\"name\": \"get_weather\""), "{model}: {}", r.text);
            assert!(r.text.contains(call), "{model}: {}", r.text);
            assert!(r.text.contains(result), "{model}: {}", r.text);
            assert!(r.text.contains("<|im_start|>assistant\n"), "{model}");
            let (plain, _) = render(model, json!({}), history.clone(), None).unwrap();
            assert!(!plain.text.contains(offer), "{model}: no tools, no tool block");
        }
    }
}
