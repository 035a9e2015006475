//! Chat messages as the API takes them (content as a string or parts, images as URLs)
//! checked and reduced to what chat templates read: role and text content, plus tool
//! calls and tool-call ids passed through.

use crate::api::error::ApiError;
use crate::catalog::Capabilities;
use serde_json::{Map, Value, json};

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// The messages for the template, or the first problem found.
pub fn for_template(messages: &Value, caps: &Capabilities, model: &str) -> Result<Vec<Value>, ApiError> {
    let Value::Array(list) = messages else {
        return Err(ApiError::invalid_type("messages", "an array"));
    };
    if list.is_empty() {
        return Err(ApiError::OutOfRange {
            param: "messages".into(),
            code: "empty_array",
            message: "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.".into(),
        });
    }
    let out: Vec<Value> = list.iter().enumerate().map(|(i, m)| message(i, m, caps, model)).collect::<Result<_, _>>()?;
    answered_calls(&out)?;
    Ok(out)
}

/// Each tool message answers a call of the assistant message before it, as OpenAI
/// requires.
fn answered_calls(messages: &[Value]) -> Result<(), ApiError> {
    let mut open: Vec<&str> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        match m["role"].as_str() {
            Some("assistant") => {
                open = m["tool_calls"]
                    .as_array()
                    .map_or(Vec::new(), |c| c.iter().filter_map(|c| c["id"].as_str()).collect())
            }
            Some("tool") => {
                let id = m["tool_call_id"].as_str().unwrap_or_default();
                if !open.contains(&id) {
                    return Err(ApiError::invalid_value(
                        format!("messages[{i}].tool_call_id"),
                        format!(
                            "Invalid parameter: messages with role 'tool' must be a response to a preceding message with \
                             'tool_calls'; no call has the id '{id}'."
                        ),
                    ));
                }
            }
            _ => open.clear(),
        }
    }
    Ok(())
}

/// An assistant message's `tool_calls`: each with an id and a function whose
/// arguments are JSON text.
fn check_tool_calls(at: &str, calls: &Value) -> Result<(), ApiError> {
    let Value::Array(calls) = calls else {
        return Err(ApiError::invalid_type(format!("{at}.tool_calls"), "an array"));
    };
    for (j, c) in calls.iter().enumerate() {
        let at = format!("{at}.tool_calls[{j}]");
        let string = |v: &Value, field: &str| match v.get(field) {
            Some(Value::String(_)) => Ok(()),
            None => Err(ApiError::MissingParam(format!("{at}.{field}"))),
            Some(_) => Err(ApiError::invalid_type(format!("{at}.{field}"), "a string")),
        };
        string(c, "id")?;
        let Some(f) = c.get("function").filter(|f| f.is_object()) else {
            return Err(ApiError::MissingParam(format!("{at}.function")));
        };
        string(f, "name").map_err(|e| rename(e, "function.name"))?;
        string(f, "arguments").map_err(|e| rename(e, "function.arguments"))?;
    }
    Ok(())
}

/// The path of a field checked through its parent object.
fn rename(e: ApiError, path: &str) -> ApiError {
    let field = path.rsplit('.').next().unwrap_or(path);
    let fix = |p: String| match p.strip_suffix(field) {
        Some(head) => format!("{head}{path}"),
        None => p,
    };
    match e {
        ApiError::MissingParam(p) => ApiError::MissingParam(fix(p)),
        ApiError::InvalidType { param, expected, got } => ApiError::InvalidType { param: fix(param), expected, got },
        other => other,
    }
}

fn message(i: usize, m: &Value, caps: &Capabilities, model: &str) -> Result<Value, ApiError> {
    let at = format!("messages[{i}]");
    let Value::Object(m) = m else {
        return Err(ApiError::invalid_type(at, "an object"));
    };
    let role = match m.get("role") {
        Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.as_str(),
        Some(Value::String(r)) => {
            return Err(ApiError::invalid_value(
                format!("{at}.role"),
                format!(
                    "Invalid value: '{r}'. Supported values are: 'system', 'developer', 'user', 'assistant' and 'tool'."
                ),
            ));
        }
        _ => return Err(ApiError::MissingParam(format!("{at}.role"))),
    };
    if role == "tool" {
        match m.get("tool_call_id") {
            Some(Value::String(_)) => {}
            None | Some(Value::Null) => return Err(ApiError::MissingParam(format!("{at}.tool_call_id"))),
            Some(_) => {
                return Err(ApiError::invalid_type(format!("{at}.tool_call_id"), "a string"));
            }
        }
    }
    if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
        if role != "assistant" {
            return Err(ApiError::UnknownParam(format!("{at}.tool_calls")));
        }
        check_tool_calls(&at, calls)?;
    }
    let content = match m.get("content") {
        None | Some(Value::Null) if role == "assistant" => String::new(),
        None | Some(Value::Null) => return Err(ApiError::MissingParam(format!("{at}.content"))),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_of_parts(&at, parts, caps, model)?,
        Some(_) => {
            return Err(ApiError::invalid_type(format!("{at}.content"), "a string or array of parts"));
        }
    };
    // Developer messages are system messages to templates that predate them.
    let mut out = Map::new();
    out.insert("role".into(), json!(if role == "developer" { "system" } else { role }));
    out.insert("content".into(), json!(content));
    for passed in ["tool_calls", "tool_call_id", "name"] {
        if let Some(v) = m.get(passed).filter(|v| !v.is_null()) {
            out.insert(passed.into(), v.clone());
        }
    }
    // Templates written for Hugging Face render a call's arguments with `tojson`, which
    // expects an object: arguments sent as JSON text (as OpenAI's API has them) are
    // handed over parsed, as vLLM does, or a model sees its own call as an escaped string.
    if let Some(Value::Array(calls)) = out.get_mut("tool_calls") {
        for call in calls {
            let args = &mut call["function"]["arguments"];
            if let Some(parsed) =
                args.as_str().and_then(|t| serde_json::from_str::<Value>(t).ok()).filter(Value::is_object)
            {
                *args = parsed;
            }
        }
    }
    // Earlier reasoning, under either name clients send it back with; templates decide
    // whether to show it again.
    if role == "assistant"
        && let Some(r) = m.get("reasoning").or_else(|| m.get("reasoning_content")).and_then(Value::as_str)
    {
        out.insert("reasoning".into(), json!(r));
    }
    Ok(Value::Object(out))
}

fn text_of_parts(at: &str, parts: &[Value], caps: &Capabilities, model: &str) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match part.get("type").and_then(Value::as_str) {
            Some("text") | Some("input_text") | Some("output_text") => match part.get("text") {
                Some(Value::String(t)) => text.push_str(t),
                _ => return Err(ApiError::MissingParam(format!("{at}.text"))),
            },
            Some("image_url") | Some("input_image") => image(&at, part, caps, model)?,
            Some(other) => {
                return Err(ApiError::invalid_value(
                    format!("{at}.type"),
                    format!("Invalid value: '{other}'. Supported values are: 'text' and 'image_url'."),
                ));
            }
            None => return Err(ApiError::MissingParam(format!("{at}.type"))),
        }
    }
    Ok(text)
}

/// Checks an image part's shape: images are refused on models without image input; on
/// models with it, the image itself is fetched and read after parsing
/// (`image_parts`, `crate::images`).
fn image(at: &str, part: &Value, caps: &Capabilities, model: &str) -> Result<(), ApiError> {
    if !caps.image_input {
        return Err(ApiError::Unsupported {
            param: at.to_string(),
            message: format!("Invalid content type: {model} does not accept image input; send text parts only."),
        });
    }
    let Some((url, detail)) = image_url(part) else {
        let field = if matches!(part.get("image_url"), Some(Value::Object(_))) { "image_url.url" } else { "image_url" };
        return Err(ApiError::MissingParam(format!("{at}.{field}")));
    };
    if url.is_empty() {
        return Err(ApiError::invalid_value(format!("{at}.image_url"), "Invalid image: the URL is empty."));
    }
    match detail {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(d)) if matches!(d.as_str(), "auto" | "low" | "high") => Ok(()),
        Some(other) => Err(ApiError::invalid_value(
            // Chat nests `detail` in `image_url`; the responses endpoint puts it beside.
            if part.get("detail").is_some() { format!("{at}.detail") } else { format!("{at}.image_url.detail") },
            format!("Invalid value: {other}. Supported values are: 'auto', 'low' and 'high'."),
        )),
    }
}

/// An image part's URL and `detail`: chat's `image_url: {url, detail}`, or the responses
/// endpoint's `image_url: "…"` with `detail` beside it.
fn image_url(part: &Value) -> Option<(&str, Option<&Value>)> {
    match part.get("image_url")? {
        Value::String(u) => Some((u.as_str(), part.get("detail"))),
        Value::Object(o) => Some((o.get("url")?.as_str()?, o.get("detail"))),
        _ => None,
    }
}

/// Every image part of the request's list `name` (`messages`, or the responses
/// endpoint's `input`; already checked by `for_template`), in order: where it is
/// (`messages[0].content[1].image_url`) and its URL. Parts are looked for in `content`
/// and in a tool result's `output` (the responses endpoint's function_call_output).
pub fn image_parts(messages: &Value, name: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for (i, m) in messages.as_array().into_iter().flatten().enumerate() {
        for field in ["content", "output"] {
            for (j, part) in m.get(field).and_then(Value::as_array).into_iter().flatten().enumerate() {
                if !matches!(part.get("type").and_then(Value::as_str), Some("image_url" | "input_image")) {
                    continue;
                }
                if let Some((url, _)) = image_url(part) {
                    found.push((format!("{name}[{i}].{field}[{j}].image_url"), url.to_string()));
                }
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT_ONLY: Capabilities =
        Capabilities { image_input: false, video_input: false, tool_calling: true, structured_output: true };
    const VISION: Capabilities = Capabilities { image_input: true, ..TEXT_ONLY };

    fn code(e: ApiError) -> (String, String) {
        let b = e.body();
        (b["error"]["code"].as_str().unwrap_or("null").into(), b["error"]["param"].as_str().unwrap_or("null").into())
    }

    #[test]
    fn text_parts_are_joined_and_roles_checked() {
        let m = json!([{"role": "developer", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": null}]);
        let out = for_template(&m, &TEXT_ONLY, "v/m").unwrap();
        assert_eq!(out[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(out[1]["content"], "ab");
        assert_eq!(out[2]["content"], "");
        let bad = for_template(&json!([{"role": "wizard", "content": "x"}]), &TEXT_ONLY, "v/m").unwrap_err();
        assert_eq!(code(bad), ("invalid_value".into(), "messages[0].role".into()));
        let bad = for_template(&json!([{"role": "user"}]), &TEXT_ONLY, "v/m").unwrap_err();
        assert_eq!(code(bad), ("missing_required_parameter".into(), "messages[0].content".into()));
        assert!(for_template(&json!([]), &TEXT_ONLY, "v/m").is_err());
    }

    #[test]
    fn tool_calls_and_their_answers_are_checked() {
        let call = json!({"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}});
        let ok = json!([{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": null, "tool_calls": [call], "reasoning_content": "hmm"},
                        {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]);
        let out = for_template(&ok, &TEXT_ONLY, "v/m").unwrap();
        assert_eq!(out[1]["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(out[1]["reasoning"], "hmm");
        assert_eq!(out[2]["tool_call_id"], "call_1");
        let wrong_id = json!([{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]);
        assert_eq!(
            code(for_template(&wrong_id, &TEXT_ONLY, "v/m").unwrap_err()),
            ("invalid_value".into(), "messages[1].tool_call_id".into())
        );
        let no_id = json!([{"role": "tool", "content": "x"}]);
        assert_eq!(code(for_template(&no_id, &TEXT_ONLY, "v/m").unwrap_err()).1, "messages[0].tool_call_id");
        let bad_args =
            json!([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}]);
        assert_eq!(
            code(for_template(&bad_args, &TEXT_ONLY, "v/m").unwrap_err()),
            ("invalid_type".into(), "messages[0].tool_calls[0].function.arguments".into())
        );
    }

    #[test]
    fn images_are_refused_on_text_models_and_listed_on_vision_models() {
        let img = |part: Value| json!([{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]);
        let chat = |url: &str| json!({"type": "image_url", "image_url": {"url": url, "detail": "low"}});
        let e = for_template(&img(chat("https://example.com/cat.png")), &TEXT_ONLY, "v/m").unwrap_err();
        assert!(e.body()["error"]["message"].as_str().unwrap().contains("does not accept image input"));
        let ok = img(chat("https://example.com/cat.png"));
        assert_eq!(for_template(&ok, &VISION, "v/m").unwrap()[0]["content"], "see");
        assert_eq!(
            image_parts(&ok, "messages"),
            [("messages[0].content[1].image_url".into(), "https://example.com/cat.png".into())]
        );
        let responses = img(json!({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}));
        assert_eq!(image_parts(&responses, "input")[0].1, "data:image/png;base64,AAAA");
        let bad = img(json!({"type": "input_image", "image_url": "https://x/y.png", "detail": "huge"}));
        assert_eq!(code(for_template(&bad, &VISION, "v/m").unwrap_err()).1, "messages[0].content[1].detail");
        // A tool result's output carries images too (the responses endpoint's shape).
        let output = json!([{"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_text", "text": "chart"}, {"type": "input_image", "image_url": "https://x/c.png"}]}]);
        assert_eq!(image_parts(&output, "input"), [("input[0].output[1].image_url".into(), "https://x/c.png".into())]);
        let bad_detail = img(json!({"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "huge"}}));
        assert_eq!(
            code(for_template(&bad_detail, &VISION, "v/m").unwrap_err()).1,
            "messages[0].content[1].image_url.detail"
        );
        let no_url = img(json!({"type": "image_url", "image_url": {}}));
        assert_eq!(code(for_template(&no_url, &VISION, "v/m").unwrap_err()).1, "messages[0].content[1].image_url.url");
        assert!(image_parts(&json!([{"role": "user", "content": "text"}]), "messages").is_empty());
    }
}
