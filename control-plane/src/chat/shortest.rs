//! The shortest text a constrained output may be: the smallest JSON instance of a
//! schema, or the smallest forced tool call. Its length in tokens is what a thinking
//! budget must leave for the answer (`budget`).
//!
//! It is an estimate for the common schema keywords (types, `required`, `enum`,
//! `const`, lengths, item counts, bounds, `anyOf`/`oneOf`/`allOf`, local `$ref`s), not
//! a solver: for a keyword it does not model (a `pattern`, a `format`) it takes the
//! plain value of the type, which may be shorter than any valid one by a few
//! characters. That errs towards the request being served. A schema it cannot read (an
//! unknown type, text that is not JSON) has no estimate: the worker's compiler then says
//! what is wrong with it.

use super::output::ToolFormat;
use super::tools::{ToolChoice, Tools};
use serde_json::{Map, Value, json};
use tessera_proto::worker::{self as pb, grammar::Kind};

/// `$ref` chains deeper than this stop at the smallest value, `null`.
const MAX_DEPTH: usize = 16;

/// The smallest JSON text valid under `schema` (compact, as the grammar allows).
pub fn instance(schema: &Value) -> Option<String> {
    Some(smallest(schema, schema, 0)?.to_string())
}

/// The shortest answer the output's grammar admits: one call when tools are forced,
/// else the format's smallest instance (or a call, if tools may be called and a call
/// is shorter). None when nothing constrains the output, or a schema has no estimate.
pub fn answer(tools: Option<&Tools>, format: Option<&pb::Grammar>, tool_format: ToolFormat) -> Option<String> {
    let callable = tools.filter(|t| t.callable());
    let call = match callable {
        Some(t) => Some(shortest_call(t, tool_format)?),
        None => None,
    };
    let forced = callable.is_some_and(|t| matches!(t.choice, ToolChoice::Required | ToolChoice::Named(_)));
    if forced {
        return call;
    }
    let json = match format?.kind.as_ref()? {
        Kind::JsonSchema(text) => instance(&serde_json::from_str(text).ok()?)?,
        Kind::JsonObject(_) => "{}".into(),
        // A grammar of the caller's own: no estimate.
        Kind::Lark(_) => return None,
    };
    Some(match call {
        Some(c) if c.len() < json.len() => c,
        _ => json,
    })
}

/// One call of the offered function whose smallest call is shortest, in the family's
/// format.
fn shortest_call(tools: &Tools, format: ToolFormat) -> Option<String> {
    let calls = tools
        .list
        .iter()
        .filter(|t| match &tools.choice {
            ToolChoice::Named(n) => &t.name == n,
            _ => true,
        })
        .map(|t| Some(json!({"name": t.name, "arguments": smallest(&t.parameters, &t.parameters, 0)?}).to_string()))
        .collect::<Option<Vec<String>>>()?;
    let body = calls.into_iter().min_by_key(String::len).unwrap_or_default();
    Some(match format.close() {
        Some(close) => format!("{}\n{body}\n{close}", format.open()),
        None => format!("{}[{body}]", format.open()),
    })
}

fn smallest(schema: &Value, root: &Value, depth: usize) -> Option<Value> {
    let Some(s) = schema.as_object() else {
        // `true` (anything) and `false` (nothing): the shortest JSON value.
        return Some(json!(0));
    };
    if depth > MAX_DEPTH {
        return Some(Value::Null);
    }
    if let Some(target) = s.get("$ref").and_then(Value::as_str) {
        return smallest(resolve(root, target)?, root, depth + 1);
    }
    if let Some(c) = s.get("const") {
        return Some(c.clone());
    }
    if let Some(Value::Array(options)) = s.get("enum") {
        return Some(shortest_of(options.iter().cloned()));
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(branches)) = s.get(key) {
            let each = branches.iter().map(|b| smallest(b, root, depth + 1)).collect::<Option<Vec<_>>>()?;
            return Some(shortest_of(each.into_iter()));
        }
    }
    if let Some(Value::Array(parts)) = s.get("allOf") {
        let mut merged = s.clone();
        merged.remove("allOf");
        for p in parts.iter().filter_map(Value::as_object) {
            merge(&mut merged, p);
        }
        return smallest(&Value::Object(merged), root, depth + 1);
    }
    let types: Vec<&str> = match s.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ if s.contains_key("properties") || s.contains_key("required") => vec!["object"],
        _ if s.contains_key("items") || s.contains_key("prefixItems") => vec!["array"],
        _ => vec!["null"],
    };
    let each = types.into_iter().map(|t| of_type(t, s, root, depth)).collect::<Option<Vec<_>>>()?;
    Some(shortest_of(each.into_iter()))
}

/// The smallest value of JSON type `t`; None for a type JSON Schema does not have.
fn of_type(t: &str, s: &Map<String, Value>, root: &Value, depth: usize) -> Option<Value> {
    let number = |k: &str| s.get(k).and_then(Value::as_f64);
    let count = |k: &str| s.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
    Some(match t {
        "object" => {
            let props = s.get("properties").and_then(Value::as_object);
            let required = s.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str);
            let object: Map<String, Value> = required
                .map(|name| {
                    let sub = props.and_then(|p| p.get(name)).unwrap_or(&Value::Bool(true));
                    Some((name.to_string(), smallest(sub, root, depth + 1)?))
                })
                .collect::<Option<_>>()?;
            Value::Object(object)
        }
        "array" => {
            let prefix = s.get("prefixItems").and_then(Value::as_array).cloned().unwrap_or_default();
            let items = s.get("items").cloned().unwrap_or(Value::Bool(true));
            let list = (0..count("minItems"))
                .map(|i| smallest(prefix.get(i).unwrap_or(&items), root, depth + 1))
                .collect::<Option<_>>()?;
            Value::Array(list)
        }
        "string" => Value::String("a".repeat(count("minLength"))),
        "integer" | "number" => {
            let low = number("minimum").or(number("exclusiveMinimum").map(|m| m.floor() + 1.0));
            let high = number("maximum").or(number("exclusiveMaximum").map(|m| m.ceil() - 1.0));
            let n = match (low, high) {
                (Some(l), _) if l > 0.0 => l.ceil(),
                (_, Some(h)) if h < 0.0 => h.floor(),
                _ => 0.0,
            };
            json!(n as i64)
        }
        "boolean" => json!(true),
        "null" => Value::Null,
        _ => return None,
    })
}

/// The value whose JSON text is shortest.
fn shortest_of(values: impl Iterator<Item = Value>) -> Value {
    values.min_by_key(|v| v.to_string().len()).unwrap_or(Value::Null)
}

/// A local reference: `#` or `#/a/b` (JSON pointer).
fn resolve<'a>(root: &'a Value, target: &str) -> Option<&'a Value> {
    target.strip_prefix('#').and_then(|pointer| root.pointer(pointer))
}

/// `allOf`: the parts' required properties and properties together, the rest first
/// come.
fn merge(into: &mut Map<String, Value>, part: &Map<String, Value>) {
    for (k, v) in part {
        match (k.as_str(), into.get_mut(k), v) {
            ("required", Some(Value::Array(have)), Value::Array(more)) => {
                have.extend(more.iter().filter(|m| !have.contains(m)).cloned().collect::<Vec<_>>())
            }
            ("properties", Some(Value::Object(have)), Value::Object(more)) => {
                for (name, p) in more {
                    have.entry(name.clone()).or_insert_with(|| p.clone());
                }
            }
            (_, None, _) => {
                into.insert(k.clone(), v.clone());
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::tools::Tool;

    #[test]
    fn the_smallest_instance_of_common_schemas() {
        let cases = [
            (json!({"type": "object"}), "{}"),
            (json!(true), "0"),
            (
                json!({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "tags": {"type": "array"}}, "required": ["name", "age"]}),
                r#"{"name":"","age":0}"#,
            ),
            (json!({"type": "string", "minLength": 3}), r#""aaa""#),
            (json!({"type": "integer", "minimum": 18}), "18"),
            (json!({"type": "number", "exclusiveMaximum": -2}), "-3"),
            (json!({"enum": ["medium", "low", "high"]}), r#""low""#),
            (json!({"type": ["string", "null"]}), r#""""#),
            (json!({"anyOf": [{"type": "object", "required": ["a"]}, {"type": "boolean"}]}), "true"),
            (json!({"type": "array", "minItems": 2, "items": {"const": 7}}), "[7,7]"),
            (
                json!({"$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
                       "type": "object", "properties": {"at": {"$ref": "#/$defs/p"}}, "required": ["at"]}),
                r#"{"at":{"x":0}}"#,
            ),
            (
                json!({"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                                 {"required": ["b"], "properties": {"b": {"type": "null"}}}]}),
                r#"{"a":true,"b":null}"#,
            ),
            (json!({"$ref": "#"}), "null"),
        ];
        for (schema, want) in cases {
            assert_eq!(instance(&schema).as_deref(), Some(want), "{schema}");
        }
        // A schema it cannot read has no estimate (the grammar compiler reports it).
        assert_eq!(instance(&json!({"type": "frobnicate"})), None);
        assert_eq!(instance(&json!({"anyOf": [{"type": "string"}, {"$ref": "#/$defs/missing"}]})), None);
    }

    fn tools(choice: ToolChoice) -> Tools {
        let tool =
            |name: &str, parameters: Value| Tool { name: name.into(), description: None, parameters, strict: None };
        Tools {
            list: vec![
                tool(
                    "get_weather",
                    json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
                ),
                tool("now", json!({"type": "object"})),
            ],
            choice,
            parallel: true,
        }
    }

    #[test]
    fn the_shortest_answer_is_a_call_when_calls_are_forced() {
        let h = ToolFormat::Hermes;
        let call = "<tool_call>\n{\"name\":\"now\",\"arguments\":{}}\n</tool_call>";
        assert_eq!(answer(Some(&tools(ToolChoice::Required)), None, h).as_deref(), Some(call));
        let named = answer(Some(&tools(ToolChoice::Named("get_weather".into()))), None, h).unwrap();
        assert!(named.contains("\"city\":\"\"") && named.contains("get_weather"), "{named}");
        let mistral = answer(Some(&tools(ToolChoice::Required)), None, ToolFormat::Mistral).unwrap();
        assert_eq!(mistral, "[TOOL_CALLS][{\"name\":\"now\",\"arguments\":{}}]");
        let schema = pb::Grammar { kind: Some(Kind::JsonSchema(r#"{"type": "object", "required": ["a"]}"#.into())) };
        assert_eq!(answer(Some(&tools(ToolChoice::Auto)), Some(&schema), h).as_deref(), Some(r#"{"a":0}"#));
        let object = pb::Grammar { kind: Some(Kind::JsonObject(true)) };
        assert_eq!(answer(None, Some(&object), h).as_deref(), Some("{}"));
        assert_eq!(answer(Some(&tools(ToolChoice::Auto)), None, h), None, "free output");
        assert_eq!(answer(Some(&tools(ToolChoice::None)), None, h), None);
    }
}
