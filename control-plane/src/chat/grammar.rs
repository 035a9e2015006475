//! The grammar a chat output is decoded under, when anything constrains it: the
//! structured-output format, tool calls that `tool_choice` forces (`required`, or one
//! named function), or both, after the chain-of-thought the family's markers allow.
//!
//! Reasoning stays free text up to its closing marker; what follows it is enforced
//! from its first token. A plain JSON format with nothing before it goes to the worker
//! as the JSON schema itself; anything more is composed as an llguidance Lark grammar
//! with the schemas inlined (`%json`).

use super::output::{Markers, ToolFormat};
use super::reasoning::Thinking;
use super::schema::closed;
use super::tools::{ToolChoice, Tools};
use serde_json::{Value, json};
use tessera_proto::worker::{self as pb, grammar::Kind};

/// The grammar and the parameter its compile errors are reported against; None when
/// the output is free.
pub fn compose(
    thinking: Thinking,
    markers: Markers,
    tool_format: ToolFormat,
    tools: Option<&Tools>,
    format: Option<(pb::Grammar, &'static str)>,
) -> Option<(pb::Grammar, &'static str)> {
    let forced = tools.filter(|t| matches!(t.choice, ToolChoice::Required | ToolChoice::Named(_)));
    let optional = tools.filter(|t| t.choice == ToolChoice::Auto);
    let prefix = match (thinking, markers.open(), markers.close()) {
        (Thinking::Open, _, Some(close)) => Some(format!("start: thought body\nthought[lazy]: {}\n", upto(close))),
        (Thinking::Optional, Some(open), Some(close)) => Some(format!(
            "start: thought? body\nthought: {} thought_end\nthought_end[lazy]: {}\n",
            literal(open),
            upto(close)
        )),
        _ => None,
    };
    let (body, param) = match (forced, &format) {
        (Some(t), _) => (format!("body: GAP? calls\n{}", calls(t, tool_format)), "tools"),
        (None, Some((g, param))) => {
            let json = format!("json: %json {}\n", schema_of(g));
            match (optional, &prefix) {
                (None, None) => return format,
                (None, Some(_)) => (format!("body: GAP? json\n{json}"), *param),
                (Some(t), _) => (format!("body: GAP? (calls | json)\n{}{json}", calls(t, tool_format)), *param),
            }
        }
        (None, None) => return None,
    };
    let start = prefix.unwrap_or_else(|| "start: body\n".into());
    let lark = format!("{start}{body}GAP: /[ \\t\\n]{{1,4}}/\n");
    Some((pb::Grammar { kind: Some(Kind::Lark(lark)) }, param))
}

/// One call of any offered function (exactly the named one when a name is forced),
/// repeated when parallel calls are allowed, in the family's format.
fn calls(tools: &Tools, format: ToolFormat) -> String {
    let offered: Vec<Value> = tools
        .list
        .iter()
        .filter(|t| match &tools.choice {
            ToolChoice::Named(n) => &t.name == n,
            _ => true,
        })
        .map(|t| {
            json!({"type": "object", "properties": {"name": {"const": t.name}, "arguments": closed(&t.parameters)},
                   "required": ["name", "arguments"], "additionalProperties": false})
        })
        .collect();
    let many = tools.parallel && !matches!(tools.choice, ToolChoice::Named(_));
    let one = json!({"anyOf": offered});
    let open = literal(format.open());
    match format.close() {
        Some(close) => {
            let repeat = if many { "(GAP? call)*" } else { "" };
            let close = literal(close);
            format!("calls: call {repeat}\ncall: {open} \"\\n\" call_json \"\\n\" {close}\ncall_json: %json {one}\n")
        }
        None => {
            let mut list = json!({"type": "array", "items": one, "minItems": 1});
            if !many {
                list["maxItems"] = json!(1);
            }
            format!("calls: {open} call_list\ncall_list: %json {list}\n")
        }
    }
}

/// The JSON schema a structured-output grammar stands for.
fn schema_of(g: &pb::Grammar) -> String {
    match &g.kind {
        Some(Kind::JsonSchema(s)) => s.clone(),
        _ => json!({"type": "object"}).to_string(),
    }
}

/// A Lark string literal.
fn literal(s: &str) -> String {
    serde_json::to_string(s).expect("a string serialises")
}

/// A regex for any text up to and including the first `marker`.
fn upto(marker: &str) -> String {
    let mut escaped = String::new();
    for c in marker.chars() {
        if "\\/.+*?()|[]{}^$-".contains(c) {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    format!("/(?s:.*){escaped}/")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::tools::Tool;

    fn tools(choice: ToolChoice, parallel: bool) -> Tools {
        let tool = |name: &str| Tool {
            name: name.into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            strict: None,
        };
        Tools { list: vec![tool("get_weather"), tool("get_time")], choice, parallel }
    }

    fn schema() -> (pb::Grammar, &'static str) {
        (pb::Grammar { kind: Some(Kind::JsonSchema(r#"{"type":"object"}"#.into())) }, "response_format")
    }

    fn lark(g: Option<(pb::Grammar, &'static str)>) -> (String, &'static str) {
        match g {
            Some((pb::Grammar { kind: Some(Kind::Lark(l)) }, p)) => (l, p),
            other => panic!("expected a Lark grammar, got {other:?}"),
        }
    }

    #[test]
    fn free_output_has_no_grammar_and_plain_json_stays_a_schema() {
        let h = ToolFormat::Hermes;
        assert_eq!(compose(Thinking::Off, Markers::Think, h, None, None), None);
        assert_eq!(compose(Thinking::Open, Markers::Think, h, Some(&tools(ToolChoice::Auto, true)), None), None);
        assert_eq!(compose(Thinking::Off, Markers::Think, h, None, Some(schema())), Some(schema()));
        assert_eq!(compose(Thinking::Optional, Markers::Plain, h, None, Some(schema())), Some(schema()));
    }

    #[test]
    fn reasoning_comes_first_then_the_enforced_part() {
        let h = ToolFormat::Hermes;
        let (g, p) = lark(compose(Thinking::Open, Markers::Think, h, None, Some(schema())));
        assert!(g.starts_with("start: thought body\nthought[lazy]: /(?s:.*)<\\/think>/\n"), "{g}");
        assert!(g.contains("json: %json {\"type\":\"object\"}"), "{g}");
        assert_eq!(p, "response_format");
        let (g, _) = lark(compose(Thinking::Optional, Markers::Channel, h, None, Some(schema())));
        assert!(g.contains("start: thought? body\nthought: \"<|channel|>thought\" thought_end\n"), "{g}");
        assert!(g.contains(r"thought_end[lazy]: /(?s:.*)<\|channel\|>/"), "{g}");
    }

    #[test]
    fn forced_calls_name_their_functions() {
        let h = ToolFormat::Hermes;
        let (g, p) = lark(compose(Thinking::Off, Markers::Think, h, Some(&tools(ToolChoice::Required, true)), None));
        assert_eq!(p, "tools");
        assert!(g.starts_with("start: body\nbody: GAP? calls\ncalls: call (GAP? call)*\n"), "{g}");
        assert!(g.contains(r#"{"const":"get_weather"}"#) && g.contains(r#"{"const":"get_time"}"#), "{g}");
        // Each call object and each function's arguments are closed.
        assert_eq!(g.matches(r#""additionalProperties":false"#).count(), 4, "{g}");
        let named = tools(ToolChoice::Named("get_time".into()), true);
        let (g, _) = lark(compose(Thinking::Off, Markers::Think, h, Some(&named), Some(schema())));
        assert!(g.contains("calls: call \n") && !g.contains("get_weather"), "one call of the named function: {g}");
        let (g, _) =
            lark(compose(Thinking::Off, Markers::Think, h, Some(&tools(ToolChoice::Auto, false)), Some(schema())));
        assert!(g.contains("body: GAP? (calls | json)") && g.contains("calls: call \n"), "{g}");
    }
}
