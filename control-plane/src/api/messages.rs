//! Chat messages as the API takes them (content as a string or parts, images as URLs)
//! checked and reduced to what chat templates read: role and text content, plus tool
//! calls and tool-call ids passed through.

use super::error::ApiError;
use crate::catalog::Capabilities;
use crate::images::ImagePart;
use crate::router::ServedModel;
use serde_json::{Map, Value, json};

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// The request's messages as the model's template reads them: parts for a vision
/// model's, text for others.
pub fn for_model(model: &ServedModel, messages: &Value) -> Result<Vec<Value>, ApiError> {
    let (caps, id) = (&model.entry.capabilities, &model.entry.id);
    match model.vision() {
        Some(v) => for_vision_template(messages, caps, id, v.takes_video(caps)),
        None => for_template(messages, caps, id),
    }
}

/// The messages for the template, or the first problem found. A message with images
/// keeps its parts, as Hugging Face's vision templates read them (`{"type": "text"}`,
/// `{"type": "image"}`, and with `video` a run of image parts as one `{"type": "video"}`);
/// others have their text joined.
pub fn for_template(messages: &Value, caps: &Capabilities, model: &str) -> Result<Vec<Value>, ApiError> {
    checked(messages, caps, model, None)
}

/// `for_template` for a vision model's template, which reads every message's content
/// as parts (as Hugging Face's processors hand it over): a string becomes one text
/// part. Where the model takes `video`, runs of image parts are videos.
pub fn for_vision_template(
    messages: &Value,
    caps: &Capabilities,
    model: &str,
    video: bool,
) -> Result<Vec<Value>, ApiError> {
    checked(messages, caps, model, Some(video))
}

/// `parts`: None for text content, Some(video) for parts.
fn checked(messages: &Value, caps: &Capabilities, model: &str, parts: Option<bool>) -> Result<Vec<Value>, ApiError> {
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
    let out: Vec<Value> =
        list.iter().enumerate().map(|(i, m)| message(i, m, caps, model, parts)).collect::<Result<_, _>>()?;
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

fn message(i: usize, m: &Value, caps: &Capabilities, model: &str, parts: Option<bool>) -> Result<Value, ApiError> {
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
        None | Some(Value::Null) if role == "assistant" => json!(""),
        None | Some(Value::Null) => return Err(ApiError::MissingParam(format!("{at}.content"))),
        Some(Value::String(s)) => json!(s),
        Some(Value::Array(list)) => content_of_parts(&at, list, caps, model, parts)?,
        Some(_) => {
            return Err(ApiError::invalid_type(format!("{at}.content"), "a string or array of parts"));
        }
    };
    // A vision template reads parts everywhere.
    let content = match (parts, content) {
        (Some(_), Value::String(t)) => json!([{"type": "text", "text": t}]),
        (_, c) => c,
    };
    // Developer messages are system messages to templates that predate them.
    let mut out = Map::new();
    out.insert("role".into(), json!(if role == "developer" { "system" } else { role }));
    out.insert("content".into(), content);
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

/// The parts' text joined, or for a vision template (`shape` Some(video)) the parts.
fn content_of_parts(
    at: &str,
    parts: &[Value],
    caps: &Capabilities,
    model: &str,
    shape: Option<bool>,
) -> Result<Value, ApiError> {
    let video = shape == Some(true);
    let mut text = String::new();
    let mut out: Vec<Value> = Vec::new();
    let mut pending = String::new();
    let mut previous_image = false;
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match part.get("type").and_then(Value::as_str) {
            Some("text") | Some("input_text") | Some("output_text") => match part.get("text") {
                Some(Value::String(t)) => {
                    text.push_str(t);
                    pending.push_str(t);
                    previous_image = false;
                }
                _ => return Err(ApiError::MissingParam(format!("{at}.text"))),
            },
            Some("image_url") | Some("input_image") => {
                image(&at, part, caps, model)?;
                if !pending.is_empty() {
                    out.push(json!({"type": "text", "text": std::mem::take(&mut pending)}));
                }
                match out.last_mut() {
                    Some(last) if video && previous_image => last["type"] = json!("video"),
                    _ => out.push(json!({"type": "image"})),
                }
                previous_image = true;
            }
            Some(other) => {
                return Err(ApiError::invalid_value(
                    format!("{at}.type"),
                    format!("Invalid value: '{other}'. Supported values are: 'text' and 'image_url'."),
                ));
            }
            None => return Err(ApiError::MissingParam(format!("{at}.type"))),
        }
    }
    if shape.is_none() {
        return Ok(json!(text));
    }
    if !pending.is_empty() {
        out.push(json!({"type": "text", "text": pending}));
    }
    Ok(Value::Array(out))
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
/// endpoint's `input`; already checked by `for_template`), in order. Parts are looked
/// for in `content` and in a tool result's `output` (the responses endpoint's
/// function_call_output).
pub fn image_parts(messages: &Value, name: &str) -> Vec<ImagePart> {
    let mut found = Vec::new();
    for (i, m) in messages.as_array().into_iter().flatten().enumerate() {
        // Only what reaches the template: a message's content, a tool result's output
        // (the responses endpoint's); items it drops (reasoning) show no images.
        let fields: &[&str] = match m.get("type").and_then(Value::as_str) {
            None | Some("message") => &["content"],
            Some("function_call_output") => &["output"],
            Some(_) => &[],
        };
        for &field in fields {
            let mut previous_image = false;
            for (j, part) in m.get(field).and_then(Value::as_array).into_iter().flatten().enumerate() {
                if !matches!(part.get("type").and_then(Value::as_str), Some("image_url" | "input_image")) {
                    previous_image = false;
                    continue;
                }
                if let Some((url, detail)) = image_url(part) {
                    found.push(ImagePart {
                        param: format!("{name}[{i}].{field}[{j}].image_url"),
                        url: url.to_string(),
                        detail: detail.and_then(Value::as_str).map(str::to_string),
                        follows: previous_image,
                    });
                }
                previous_image = true;
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
            for_vision_template(&ok, &VISION, "v/m", false).unwrap()[0]["content"],
            json!([{"type": "text", "text": "see"}, {"type": "image"}])
        );
        let text = json!([{"role": "system", "content": "be brief"}]);
        assert_eq!(
            for_vision_template(&text, &VISION, "v/m", false).unwrap()[0]["content"],
            json!([{"type": "text", "text": "be brief"}])
        );
        assert_eq!(
            image_parts(&ok, "messages"),
            [ImagePart {
                param: "messages[0].content[1].image_url".into(),
                url: "https://example.com/cat.png".into(),
                detail: Some("low".into()),
                follows: false
            }]
        );
        let responses = img(json!({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}));
        assert_eq!(image_parts(&responses, "input")[0].url, "data:image/png;base64,AAAA");
        let bad = img(json!({"type": "input_image", "image_url": "https://x/y.png", "detail": "huge"}));
        assert_eq!(code(for_template(&bad, &VISION, "v/m").unwrap_err()).1, "messages[0].content[1].detail");
        // A tool result's output carries images too (the responses endpoint's shape).
        let output = json!([{"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_text", "text": "chart"}, {"type": "input_image", "image_url": "https://x/c.png"}]}]);
        let found = image_parts(&output, "input");
        assert_eq!(
            (found[0].param.as_str(), found[0].url.as_str()),
            ("input[0].output[1].image_url", "https://x/c.png")
        );
        let bad_detail = img(json!({"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "huge"}}));
        assert_eq!(
            code(for_template(&bad_detail, &VISION, "v/m").unwrap_err()).1,
            "messages[0].content[1].image_url.detail"
        );
        let no_url = img(json!({"type": "image_url", "image_url": {}}));
        assert_eq!(code(for_template(&no_url, &VISION, "v/m").unwrap_err()).1, "messages[0].content[1].image_url.url");
        assert!(image_parts(&json!([{"role": "user", "content": "text"}]), "messages").is_empty());
        // Fields and items the template never reads show no images.
        let unread = json!([{"role": "user", "content": "hi", "output": [{"type": "image_url", "image_url": "https://x/a.png"}]},
                            {"type": "reasoning", "content": [{"type": "input_image", "image_url": "https://x/b.png"}]}]);
        assert!(image_parts(&unread, "input").is_empty());
    }

    #[test]
    fn runs_of_image_parts_are_videos_on_models_that_take_video() {
        let part = |u: &str| json!({"type": "image_url", "image_url": {"url": u}});
        let m = json!([{"role": "user", "content": [
            {"type": "text", "text": "what happens"}, part("https://x/1.png"), part("https://x/2.png"),
            {"type": "text", "text": "and here"}, part("https://x/3.png")]}]);
        let video = for_vision_template(&m, &VISION, "v/m", true).unwrap();
        assert_eq!(
            video[0]["content"],
            json!([{"type": "text", "text": "what happens"}, {"type": "video"}, {"type": "text", "text": "and here"}, {"type": "image"}])
        );
        let images = for_vision_template(&m, &VISION, "v/m", false).unwrap();
        assert_eq!(images[0]["content"].as_array().unwrap().iter().filter(|p| p["type"] == "image").count(), 3);
        let follows: Vec<bool> = image_parts(&m, "messages").iter().map(|p| p.follows).collect();
        assert_eq!(follows, [false, true, false]);
    }
}
