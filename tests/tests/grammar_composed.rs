//! The grammars the control plane composes for tools and reasoning, compiled by the
//! worker against the real model's tokenizer and walked token by token: chain-of-thought
//! stays free up to its closing marker, and what follows can only be a valid call or
//! valid JSON, after which only end-of-sequence is allowed.

use serde_json::json;
use tessera_control_plane::api::format::{Shape, grammar};
use tessera_control_plane::chat::grammar::compose;
use tessera_control_plane::chat::output::{Markers, ToolFormat};
use tessera_control_plane::chat::reasoning::Thinking;
use tessera_control_plane::chat::tools::{Tool, ToolChoice, Tools};
use tessera_proto::worker::{self as pb, grammar::Kind};
use tessera_worker::engine::grammar::{Constraint, GrammarSource, GrammarSpec};
use tessera_worker::model_cache;
use tessera_worker::tokenizer::ModelTokenizer;

struct Model {
    tokenizer: ModelTokenizer,
    grammars: GrammarSource,
    vocab: usize,
}

fn model() -> Model {
    let path = model_cache::ensure(&model_cache::SMOLLM2_135M_INSTRUCT).unwrap_or_else(|e| panic!("{e}"));
    let (config, tokenizer, _) = tessera_worker::load::open(&path).unwrap();
    let eos: Vec<u32> = tokenizer.eos.iter().map(|t| t.id).collect();
    let grammars = GrammarSource::new(tokenizer.json.clone(), eos, config.vocab_size);
    Model { tokenizer, grammars, vocab: config.vocab_size }
}

impl Model {
    fn matcher(&self, g: Option<(pb::Grammar, &'static str)>) -> Constraint {
        let spec = match g.and_then(|(g, _)| g.kind) {
            Some(Kind::Lark(l)) => GrammarSpec::Lark(l),
            Some(Kind::JsonSchema(s)) => GrammarSpec::JsonSchema(s),
            other => panic!("expected a grammar, got {other:?}"),
        };
        self.grammars.matcher(&spec).unwrap_or_else(|e| panic!("the composed grammar does not compile: {e}"))
    }

    fn allowed(&self, c: &Constraint, token: u32) -> bool {
        let mut logits = vec![0.0f32; self.vocab];
        c.mask(&mut logits);
        logits[token as usize].is_finite()
    }

    /// Feeds `text`, checking that every token of it is allowed.
    fn walk(&self, c: &Constraint, text: &str) {
        for t in self.tokenizer.encode(text).unwrap() {
            assert!(self.allowed(c, t), "token {t} of {text:?} was refused");
            c.accept(t);
        }
    }

    fn only_eos_left(&self, c: &Constraint) -> bool {
        let mut logits = vec![0.0f32; self.vocab];
        c.mask(&mut logits);
        let eos: Vec<u32> = self.tokenizer.eos.iter().map(|t| t.id).collect();
        logits.iter().enumerate().all(|(t, l)| l.is_finite() == eos.contains(&(t as u32)))
    }

    /// Whether some token of `text` is refused (on a copy: `c` does not move).
    fn refuses(&self, c: &Constraint, text: &str) -> bool {
        let c = c.fork();
        self.tokenizer.encode(text).unwrap().into_iter().any(|t| {
            let ok = self.allowed(&c, t);
            c.accept(t);
            !ok
        })
    }
}

fn weather_tools(choice: ToolChoice, parallel: bool) -> Tools {
    let tool = |name: &str| Tool {
        name: name.into(),
        description: None,
        parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        strict: None,
    };
    Tools { list: vec![tool("get_weather"), tool("get_time")], choice, parallel }
}

#[test]
fn a_forced_call_follows_free_reasoning_and_ends_the_output() {
    let m = model();
    let tools = weather_tools(ToolChoice::Required, true);
    let g = compose(Thinking::Open, Markers::Think, ToolFormat::Hermes, Some(&tools), None);
    let c = m.matcher(g);
    m.walk(&c, "The user wants weather. Any text, even {braces} and <tags>, until");
    m.walk(&c, "</think>\n");
    assert!(m.refuses(&c, "Sure"), "after the reasoning only a call may come");
    m.walk(&c, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
    // Parallel calls allowed: another may follow, or the end.
    m.walk(&c, "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"city\": \"Tokyo\"}}\n</tool_call>");
    let c2 = m.matcher(compose(Thinking::Open, Markers::Think, ToolFormat::Hermes, Some(&tools), None));
    m.walk(&c2, "x</think><tool_call>\n");
    assert!(m.refuses(&c2, "{\"name\": \"book_flight\""), "only offered functions");
}

#[test]
fn a_named_call_is_that_function_once_then_only_the_end() {
    let m = model();
    let tools = weather_tools(ToolChoice::Named("get_time".into()), true);
    for format in [ToolFormat::Hermes, ToolFormat::Mistral] {
        let c = m.matcher(compose(Thinking::Off, Markers::Think, format, Some(&tools), None));
        let call = match format {
            ToolFormat::Hermes => {
                "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"
            }
            ToolFormat::Mistral => "[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {\"city\": \"Oslo\"}}]",
        };
        m.walk(&c, call);
        assert!(m.only_eos_left(&c), "{format:?}: one call and then the end");
        let other = m.matcher(compose(Thinking::Off, Markers::Think, format, Some(&tools), None));
        m.walk(&other, &call[..call.find("get_").unwrap()]);
        assert!(m.refuses(&other, "get_weather"), "{format:?}: only the named function");
    }
}

#[test]
fn json_after_optional_thought_on_a_channel_model() {
    let m = model();
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let format = || Some((pb::Grammar { kind: Some(Kind::JsonSchema(schema.to_string())) }, "response_format"));
    let with_thought = m.matcher(compose(Thinking::Optional, Markers::Channel, ToolFormat::Hermes, None, format()));
    m.walk(&with_thought, "<|channel|>thought weigh it<|channel|>{\"a\": 1}");
    assert!(m.only_eos_left(&with_thought));
    let straight = m.matcher(compose(Thinking::Optional, Markers::Channel, ToolFormat::Hermes, None, format()));
    assert!(m.refuses(&straight, "Hello"), "no free text outside the thought");
    m.walk(&straight, "{\"a\": 2}");
    assert!(m.only_eos_left(&straight));
}

/// What LangChain's `bind_tools` sends for `def get_weather(city: str, unit: str =
/// "celsius")`: no `additionalProperties`, which JSON Schema reads as "any other key".
fn langchain_weather(extra: Option<serde_json::Value>) -> Tools {
    let mut parameters = json!({"type": "object", "properties": {"city": {"type": "string"},
        "unit": {"default": "celsius", "type": "string"}}, "required": ["city"]});
    if let Some(extra) = extra {
        parameters["additionalProperties"] = extra;
    }
    let tool = Tool { name: "get_weather".into(), description: None, parameters, strict: None };
    Tools { list: vec![tool], choice: ToolChoice::Named("get_weather".into()), parallel: true }
}

#[test]
fn forced_arguments_and_json_formats_take_only_declared_keys_unless_they_allow_more() {
    let m = model();
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"";
    let closed =
        m.matcher(compose(Thinking::Off, Markers::Think, ToolFormat::Hermes, Some(&langchain_weather(None)), None));
    m.walk(&closed, call);
    assert!(m.refuses(&closed, ", \"properties\""), "a key get_weather does not declare");
    m.walk(&closed, "}}\n</tool_call>");
    for allows in [json!(true), json!({"type": "object"})] {
        let tools = langchain_weather(Some(allows.clone()));
        let open = m.matcher(compose(Thinking::Off, Markers::Think, ToolFormat::Hermes, Some(&tools), None));
        m.walk(&open, call);
        m.walk(&open, ", \"properties\": {}}}\n</tool_call>");
        assert!(m.only_eos_left(&open), "additionalProperties {allows}");
    }
    // The same default for response_format's json_schema.
    let format = json!({"type": "json_schema", "json_schema": {"name": "weather",
        "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let g = grammar(Some(&format), Shape::Chat, true, "m").unwrap().map(|g| (g, "response_format"));
    let c = m.matcher(g);
    m.walk(&c, "{\"city\": \"Paris\"");
    assert!(m.refuses(&c, ", \"country\""));
}
