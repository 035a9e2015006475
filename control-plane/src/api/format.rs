//! Structured output requested through the API — chat's `response_format`, the
//! responses endpoint's `text.format` — as the grammar the worker enforces while it
//! decodes. The shapes are OpenAI's: `{"type": "json_object"}`, and `json_schema`
//! with a `name` and a `schema` (nested under `json_schema` in chat, flat in
//! responses).

use super::error::ApiError;
use crate::chat::schema::closed;
use serde_json::Value;
use tessera_proto::worker as pb;

/// Which API shape the format came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `response_format`, the schema under `json_schema`.
    Chat,
    /// `text.format`, flat.
    Responses,
}

impl Shape {
    /// The parameter a format's errors name.
    pub fn param(self) -> &'static str {
        match self {
            Shape::Chat => "response_format",
            Shape::Responses => "text.format",
        }
    }
}

/// The grammar for `format`, None for plain text.
pub fn grammar(
    format: Option<&Value>,
    shape: Shape,
    structured_output: bool,
    model: &str,
) -> Result<Option<pb::Grammar>, ApiError> {
    let Some(format) = format else { return Ok(None) };
    let param = shape.param();
    let Some(object) = format.as_object() else {
        return Err(ApiError::invalid_type(param, "an object"));
    };
    let kind = match object.get("type") {
        None => return Err(ApiError::MissingParam(format!("{param}.type"))),
        Some(Value::String(kind)) => kind.as_str(),
        Some(_) => {
            return Err(ApiError::invalid_type(format!("{param}.type"), "a string"));
        }
    };
    let kind = match kind {
        "text" => return Ok(None),
        "json_object" => pb::grammar::Kind::JsonObject(true),
        "json_schema" => {
            let (spec, spec_param) = match shape {
                Shape::Chat => match object.get("json_schema") {
                    Some(Value::Object(s)) => (s, format!("{param}.json_schema")),
                    Some(_) => {
                        return Err(ApiError::invalid_type(format!("{param}.json_schema"), "an object"));
                    }
                    None => return Err(ApiError::MissingParam(format!("{param}.json_schema"))),
                },
                Shape::Responses => (object, param.to_string()),
            };
            check_name(spec.get("name"), &format!("{spec_param}.name"))?;
            let schema = match spec.get("schema") {
                None => Value::Object(Default::default()),
                Some(s @ Value::Object(_)) => s.clone(),
                Some(_) => {
                    return Err(ApiError::invalid_type(format!("{spec_param}.schema"), "an object"));
                }
            };
            pb::grammar::Kind::JsonSchema(closed(&schema).to_string())
        }
        other => {
            return Err(ApiError::invalid_value(
                format!("{param}.type"),
                format!("Invalid value: '{other}'. Supported values are: 'text', 'json_object' and 'json_schema'."),
            ));
        }
    };
    if !structured_output {
        return Err(ApiError::invalid_value(param, format!("{model} does not support structured output.")));
    }
    Ok(Some(pb::Grammar { kind: Some(kind) }))
}

/// OpenAI's rule for a schema's name: 1 to 64 of `a-z A-Z 0-9 _ -`.
fn check_name(name: Option<&Value>, param: &str) -> Result<(), ApiError> {
    match name {
        None => Err(ApiError::MissingParam(param.into())),
        Some(Value::String(n)) if valid_name(n) => Ok(()),
        Some(Value::String(n)) => Err(ApiError::invalid_value(
            param,
            format!("Invalid '{param}': string '{n}' does not match pattern '^[a-zA-Z0-9_-]{{1,64}}$'."),
        )),
        Some(_) => Err(ApiError::invalid_type(param, "a string")),
    }
}

/// `^[a-zA-Z0-9_-]{1,64}$`, as tool and schema names must be.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(v: Value) -> Result<Option<pb::Grammar>, ApiError> {
        grammar(Some(&v), Shape::Chat, true, "m")
    }

    #[test]
    fn formats_become_grammars() {
        use pb::grammar::Kind;
        assert_eq!(chat(json!({"type": "text"})).unwrap(), None);
        assert_eq!(grammar(None, Shape::Chat, true, "m").unwrap(), None);
        assert_eq!(chat(json!({"type": "json_object"})).unwrap().unwrap().kind, Some(Kind::JsonObject(true)));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let g =
            chat(json!({"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": true}}));
        // Closed: the object takes only the properties it declares.
        let closed = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": false});
        assert_eq!(g.unwrap().unwrap().kind, Some(Kind::JsonSchema(closed.to_string())));
        let flat = json!({"type": "json_schema", "name": "thing", "schema": schema});
        let g = grammar(Some(&flat), Shape::Responses, true, "m").unwrap().unwrap();
        assert_eq!(g.kind, Some(Kind::JsonSchema(closed.to_string())));
        let open = json!({"type": "object", "properties": {"a": {}}, "additionalProperties": true});
        let g = chat(json!({"type": "json_schema", "json_schema": {"name": "open", "schema": open}}));
        assert_eq!(g.unwrap().unwrap().kind, Some(Kind::JsonSchema(open.to_string())));
    }

    #[test]
    fn bad_formats_name_the_parameter() {
        let param = |r: Result<Option<pb::Grammar>, ApiError>| r.unwrap_err().object()["param"].clone();
        assert_eq!(param(chat(json!({"type": "yaml"}))), "response_format.type");
        assert_eq!(param(chat(json!({"type": "json_schema"}))), "response_format.json_schema");
        assert_eq!(
            param(chat(json!({"type": "json_schema", "json_schema": {"schema": {}}}))),
            "response_format.json_schema.name"
        );
        assert_eq!(
            param(chat(json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}))),
            "response_format.json_schema.name"
        );
        assert_eq!(
            param(chat(json!({"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}))),
            "response_format.json_schema.schema"
        );
        let flat = json!({"type": "json_schema", "schema": {}});
        assert_eq!(param(grammar(Some(&flat), Shape::Responses, true, "m")), "text.format.name");
        assert_eq!(param(grammar(Some(&json!({"type": "json_object"})), Shape::Chat, false, "m")), "response_format");
        assert!(valid_name("get_weather-2") && !valid_name("") && !valid_name(&"x".repeat(65)) && !valid_name("é"));
    }
}
