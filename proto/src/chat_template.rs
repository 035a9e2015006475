//! Rendering a model's Jinja chat template (the ModelCard's `chat_template`) with
//! minijinja, with the Python string methods (`.strip()`, `.startswith()`) real
//! templates call. It lives with the contracts because both sides render it: the
//! control plane for API requests, the worker for its command line.

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::{Map, Value as Json};

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// The top-level template variable in which a family's template says where the
/// model's output begins, once its thinking toggles are read: `open` (the prompt
/// opened a reasoning block), `off` (thinking is off) or `optional` (the model may
/// open one). Templates that do not set it leave the server to read the prompt.
pub const REASONING_START: &str = "reasoning_start";

/// A rendered prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub text: String,
    /// The template's `reasoning_start`, when it sets one.
    pub reasoning_start: Option<String>,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, Error> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.to_string())?;
        Ok(Self { env, bos_token: bos_token.into(), eos_token: eos_token.into() })
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, Error> {
        let messages =
            serde_json::to_value(messages).map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
        Ok(self.render_json(&messages, None, add_generation_prompt, &Map::new())?.text)
    }

    /// Renders messages (and tools) as the API gives them, with `kwargs` as further
    /// template variables (`enable_thinking`, …). The template's own variables
    /// (`messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`) cannot be
    /// overridden by `kwargs`.
    pub fn render_json(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Json>,
    ) -> Result<Rendered, Error> {
        let mut context = kwargs.clone();
        context.insert("messages".into(), messages.clone());
        if let Some(tools) = tools {
            context.insert("tools".into(), tools.clone());
        } else {
            context.remove("tools");
        }
        context.insert("add_generation_prompt".into(), add_generation_prompt.into());
        context.insert("bos_token".into(), self.bos_token.clone().into());
        context.insert("eos_token".into(), self.eos_token.clone().into());
        let captured =
            self.env.get_template("chat")?.render_captured(Value::from(minijinja::value::Serde(&context)))?;
        let reasoning_start = captured.state().lookup(REASONING_START).and_then(|v| v.as_str().map(String::from));
        Ok(Rendered { text: captured.into_output(), reasoning_start })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml_with_python_string_methods() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{% endfor %}\
             {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "",
            "<|im_end|>",
        )
        .unwrap();
        let out = t.render(&[Message::new("user", "  hi  ")], true).unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn kwargs_reach_the_template_but_cannot_replace_its_own_variables() {
        let t = ChatTemplate::new(
            "{% if enable_thinking is defined and enable_thinking %}think {% endif %}\
             {% for m in messages %}{{ m.role }}:{{ m.content }} {% endfor %}{{ tools | length if tools else 0 }}",
            "",
            "",
        )
        .unwrap();
        let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
        let kwargs = serde_json::json!({"enable_thinking": true, "messages": "spoofed"});
        let out = t.render_json(&messages, None, true, kwargs.as_object().unwrap()).unwrap();
        assert_eq!(out.text, "think user:hi 0");
        let tools = serde_json::json!([{"type": "function"}]);
        let out = t.render_json(&messages, Some(&tools), true, &Map::new()).unwrap();
        assert_eq!(out, Rendered { text: "user:hi 1".into(), reasoning_start: None });
    }

    #[test]
    fn the_template_can_say_where_the_output_begins() {
        let t = ChatTemplate::new(
            "{%- set reasoning_start = 'open' if thinking else 'off' -%}x{% if thinking %}<think>{% endif %}",
            "",
            "",
        )
        .unwrap();
        let on = serde_json::json!({"thinking": true});
        let out = t.render_json(&serde_json::json!([]), None, true, on.as_object().unwrap()).unwrap();
        assert_eq!(out, Rendered { text: "x<think>".into(), reasoning_start: Some("open".into()) });
        let out = t.render_json(&serde_json::json!([]), None, true, &Map::new()).unwrap();
        assert_eq!(out.reasoning_start.as_deref(), Some("off"));
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = t.render(&[], false).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }
}
