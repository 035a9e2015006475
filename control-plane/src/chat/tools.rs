//! The tools a request offers and how it lets the model use them, as the template,
//! the grammar and the output's reader need them (`api::tools` parses them).

use crate::chat::schema::Declared;
use serde_json::{Map, Value, json};

#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON schema (an empty object schema when none was given).
    pub parameters: Value,
    pub strict: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    /// At least one call, forced through a grammar.
    Required,
    /// Exactly one call of this function, forced through a grammar.
    Named(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub list: Vec<Tool>,
    pub choice: ToolChoice,
    /// Whether the model may make more than one call.
    pub parallel: bool,
}

impl Tools {
    /// Whether the output is read for calls: not when the choice is `none`.
    pub fn callable(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The functions as chat templates read them (`{"type": "function", "function": …}`).
    pub fn for_template(&self) -> Value {
        let tools: Vec<Value> = self
            .list
            .iter()
            .map(|t| {
                let mut f = Map::new();
                f.insert("name".into(), json!(t.name));
                if let Some(d) = &t.description {
                    f.insert("description".into(), json!(d));
                }
                f.insert("parameters".into(), t.parameters.clone());
                json!({"type": "function", "function": f})
            })
            .collect();
        Value::Array(tools)
    }

    /// The functions' argument schemas, closed, that free calls are held to.
    pub fn declared(&self) -> Declared {
        Declared::new(self.list.iter().map(|t| (t.name.as_str(), &t.parameters)))
    }

    /// The tools as the responses object echoes them (flat; `strict` defaults to true).
    pub fn flat(&self) -> Value {
        let tools: Vec<Value> = self
            .list
            .iter()
            .map(|t| {
                json!({"type": "function", "name": t.name, "description": t.description,
                       "parameters": t.parameters, "strict": t.strict.unwrap_or(true)})
            })
            .collect();
        Value::Array(tools)
    }
}
