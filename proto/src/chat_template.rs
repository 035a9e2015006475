//! Rendering a model's Jinja chat template with minijinja, with the Python string
//! methods (`.strip()`, `.startswith()`) real templates call.

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

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
        self.env.get_template("chat")?.render(minijinja::context! {
            messages => Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
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
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = t.render(&[], false).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }
}
