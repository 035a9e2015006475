//! The tools a request offers, parsed: `tools`, `tool_choice` and `parallel_tool_calls`,
//! in chat's nested shape or the responses endpoint's flat one, checked as OpenAI
//! checks them, into `chat::tools::Tools`.

use super::error::ApiError;
use super::fields::Fields;
use super::format::{Shape, valid_name};
use crate::chat::tools::{Tool, ToolChoice, Tools};
use serde_json::{Value, json};

/// `tools`, `tool_choice` and `parallel_tool_calls`; None when no tools are offered.
pub fn parse<'a>(f: &mut Fields<'a>, shape: Shape, tool_calling: bool, model: &str) -> Result<Option<Tools>, ApiError> {
    let list = match f.raw("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => {
            items.iter().enumerate().map(|(i, t)| tool(i, t, shape)).collect::<Result<_, _>>()?
        }
        Some(_) => {
            return Err(ApiError::invalid_type("tools", "an array"));
        }
    };
    for (i, t) in list.iter().enumerate() {
        if list[..i].iter().any(|u: &Tool| u.name == t.name) {
            return Err(ApiError::invalid_value(
                name_param(i, shape),
                format!("Invalid 'tools': the function name '{}' is used twice.", t.name),
            ));
        }
    }
    let choice = choice(f.raw("tool_choice"), shape, &list)?;
    let parallel = match f.raw("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(_) if list.is_empty() => {
            return Err(ApiError::invalid_value(
                "parallel_tool_calls",
                "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed when 'tools' are specified.",
            ));
        }
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid_type("parallel_tool_calls", "a boolean"));
        }
    };
    if list.is_empty() {
        return Ok(None);
    }
    if !tool_calling {
        return Err(ApiError::Unsupported {
            param: "tools".into(),
            message: format!("{model} does not support tool calling."),
        });
    }
    Ok(Some(Tools { list, choice, parallel }))
}

fn name_param(i: usize, shape: Shape) -> String {
    match shape {
        Shape::Chat => format!("tools[{i}].function.name"),
        Shape::Responses => format!("tools[{i}].name"),
    }
}

fn tool(i: usize, t: &Value, shape: Shape) -> Result<Tool, ApiError> {
    let at = format!("tools[{i}]");
    let Value::Object(t) = t else {
        return Err(ApiError::invalid_type(at, "an object"));
    };
    match t.get("type") {
        Some(Value::String(k)) if k == "function" => {}
        Some(Value::String(k)) => {
            return Err(ApiError::invalid_value(
                format!("{at}.type"),
                format!("Invalid value: '{k}'. Supported values are: 'function'."),
            ));
        }
        _ => return Err(ApiError::MissingParam(format!("{at}.type"))),
    }
    let (f, at) = match shape {
        Shape::Chat => match t.get("function") {
            Some(Value::Object(f)) => (f, format!("{at}.function")),
            Some(_) => {
                return Err(ApiError::invalid_type(format!("{at}.function"), "an object"));
            }
            None => return Err(ApiError::MissingParam(format!("{at}.function"))),
        },
        Shape::Responses => (t, at),
    };
    let name = match f.get("name") {
        Some(Value::String(n)) if valid_name(n) => n.clone(),
        Some(Value::String(n)) if n.len() > 64 => {
            return Err(ApiError::OutOfRange {
                param: format!("{at}.name"),
                code: "string_above_max_length",
                message: format!(
                    "Invalid '{at}.name': string too long. Expected a string with maximum length 64, but got a string with length {} instead.",
                    n.len()
                ),
            });
        }
        Some(Value::String(n)) => {
            return Err(ApiError::invalid_value(
                format!("{at}.name"),
                format!("Invalid '{at}.name': string '{n}' does not match pattern '^[a-zA-Z0-9_-]{{1,64}}$'."),
            ));
        }
        Some(_) => {
            return Err(ApiError::invalid_type(format!("{at}.name"), "a string"));
        }
        None => return Err(ApiError::MissingParam(format!("{at}.name"))),
    };
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(_) => {
            return Err(ApiError::invalid_type(format!("{at}.description"), "a string"));
        }
    };
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(ApiError::invalid_type(format!("{at}.parameters"), "an object"));
        }
    };
    let strict = f.get("strict").and_then(Value::as_bool);
    Ok(Tool { name, description, parameters, strict })
}

fn choice(v: Option<&Value>, shape: Shape, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let default = if tools.is_empty() { ToolChoice::None } else { ToolChoice::Auto };
    let choice = match v {
        None | Some(Value::Null) => return Ok(default),
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid_value(
                    "tool_choice",
                    format!("Invalid value: '{other}'. Supported values are: 'none', 'auto' and 'required'."),
                ));
            }
        },
        Some(Value::Object(o)) => {
            match o.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(ApiError::invalid_value(
                        "tool_choice.type",
                        format!("Invalid value: '{other}'. Supported values are: 'function'."),
                    ));
                }
                None => return Err(ApiError::MissingParam("tool_choice.type".into())),
            }
            let (name, param) = match shape {
                Shape::Chat => (o.get("function").and_then(|f| f.get("name")), "tool_choice.function.name"),
                Shape::Responses => (o.get("name"), "tool_choice.name"),
            };
            match name {
                Some(Value::String(n)) => ToolChoice::Named(n.clone()),
                Some(_) => {
                    return Err(ApiError::invalid_type(param, "a string"));
                }
                None => return Err(ApiError::MissingParam(param.into())),
            }
        }
        Some(_) => {
            return Err(ApiError::invalid_type("tool_choice", "a string or object"));
        }
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => Err(ApiError::invalid_value(
            "tool_choice",
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
        )),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(ApiError::invalid_value(
            "tool_choice",
            format!("Invalid value for 'tool_choice': no function named '{n}' was specified in the 'tools' parameter."),
        )),
        _ => Ok(choice),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_chat(body: Value) -> Result<Option<Tools>, ApiError> {
        let mut f = Fields::new(&body).unwrap();
        parse(&mut f, Shape::Chat, true, "v/m")
    }

    fn param(r: Result<Option<Tools>, ApiError>) -> (String, String) {
        let e = r.unwrap_err().object();
        (e["param"].as_str().unwrap_or("null").into(), e["code"].as_str().unwrap_or("null").into())
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn tools_and_choices_of_both_shapes() {
        assert_eq!(parse_chat(json!({})).unwrap(), None);
        assert_eq!(parse_chat(json!({"tools": [], "tool_choice": "none"})).unwrap(), None);
        let t = parse_chat(json!({"tools": [weather()]})).unwrap().unwrap();
        assert_eq!((t.choice.clone(), t.parallel), (ToolChoice::Auto, true));
        assert_eq!(t.list[0].parameters["required"], json!(["city"]));
        assert_eq!(t.for_template()[0], weather());
        let t = parse_chat(json!({"tools": [weather()], "tool_choice": "required", "parallel_tool_calls": false}))
            .unwrap()
            .unwrap();
        assert_eq!((t.choice, t.parallel), (ToolChoice::Required, false));
        let named =
            json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
        assert_eq!(parse_chat(named).unwrap().unwrap().choice, ToolChoice::Named("get_weather".into()));
        let flat =
            json!({"tools": [{"type": "function", "name": "now"}], "tool_choice": {"type": "function", "name": "now"}});
        let mut f = Fields::new(&flat).unwrap();
        let t = parse(&mut f, Shape::Responses, true, "v/m").unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Named("now".into()));
        assert_eq!(t.list[0].parameters, json!({"type": "object", "properties": {}}));
        assert_eq!(t.flat()[0]["strict"], true);
    }

    #[test]
    fn bad_tools_are_400s_naming_the_param() {
        let named = |name: &str| json!({"tools": [{"type": "function", "function": {"name": name}}]});
        assert_eq!(param(parse_chat(named("get weather"))), ("tools[0].function.name".into(), "invalid_value".into()));
        assert_eq!(
            param(parse_chat(named(&"x".repeat(65)))),
            ("tools[0].function.name".into(), "string_above_max_length".into())
        );
        assert_eq!(param(parse_chat(json!({"tools": [{"type": "function"}]}))).0, "tools[0].function");
        assert_eq!(param(parse_chat(json!({"tools": [{"type": "web_search"}]}))).0, "tools[0].type");
        assert_eq!(param(parse_chat(json!({"tools": [weather(), weather()]}))).0, "tools[1].function.name");
        let other =
            json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "get_time"}}});
        assert_eq!(param(parse_chat(other)), ("tool_choice".into(), "invalid_value".into()));
        assert_eq!(param(parse_chat(json!({"tool_choice": "required"}))).0, "tool_choice");
        assert_eq!(param(parse_chat(json!({"tools": [weather()], "tool_choice": "sometimes"}))).0, "tool_choice");
        assert_eq!(param(parse_chat(json!({"parallel_tool_calls": true}))).0, "parallel_tool_calls");
        let body = json!({"tools": [weather()]});
        let mut f = Fields::new(&body).unwrap();
        assert_eq!(param(parse(&mut f, Shape::Chat, false, "v/m")), ("tools".into(), "unsupported_value".into()));
    }
}
