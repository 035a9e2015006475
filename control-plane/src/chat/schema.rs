//! The JSON schemas an output follows, with objects closed by default: an object that
//! lists its `properties` takes only those unless it allows more explicitly.
//!
//! JSON Schema leaves every object open unless it says `additionalProperties: false`,
//! and most clients never say it (LangChain's `bind_tools`, Pydantic's
//! `model_json_schema`): decoded under an open schema, a model may add keys the function
//! does not take, and calling the function with them fails. xgrammar, the default in
//! vLLM and SGLang, closes such objects; so do we, for tool arguments and for
//! `response_format`'s `json_schema`. An object stays as the client wrote it when it
//! says anything about other properties (`additionalProperties`, `patternProperties`,
//! `unevaluatedProperties`), lists no properties (any object), or takes properties from
//! elsewhere (`allOf`, `anyOf`, `oneOf`, `$ref`, `if`, `dependentSchemas`): closing
//! those would refuse what the other parts declare.
//!
//! Calls the model makes freely, outside a grammar, are held to the same rule by
//! dropping the keys a closed schema would not have allowed.

use serde_json::{Map, Value};
use std::collections::{HashMap, HashSet};

/// `schema` with its objects closed (see the module's rule).
pub fn closed(schema: &Value) -> Value {
    let mut extended = HashSet::new();
    combined_references(schema, true, &mut extended);
    let mut s = schema.clone();
    close(&mut s, true, "#", &extended);
    s
}

/// Keywords whose presence means an object's property set is not its `properties`
/// alone.
const OPENERS: [&str; 11] = [
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "if",
    "dependentSchemas",
    "dependencies",
    "propertyNames",
];

/// Where a subschema sits in its parent object.
enum At {
    Key(&'static str),
    Index(&'static str, usize),
    Name(&'static str, String),
}

impl At {
    fn get<'a>(&self, o: &'a Map<String, Value>) -> Option<&'a Value> {
        match self {
            At::Key(k) => o.get(*k),
            At::Index(k, i) => o.get(*k)?.get(*i),
            At::Name(k, n) => o.get(*k)?.get(n),
        }
    }

    fn get_mut<'a>(&self, o: &'a mut Map<String, Value>) -> Option<&'a mut Value> {
        match self {
            At::Key(k) => o.get_mut(*k),
            At::Index(k, i) => o.get_mut(*k)?.get_mut(*i),
            At::Name(k, n) => o.get_mut(*k)?.get_mut(n),
        }
    }

    /// The JSON pointer of the subschema, below its parent's.
    fn pointer(&self, parent: &str) -> String {
        let escape = |s: &str| s.replace('~', "~0").replace('/', "~1");
        match self {
            At::Key(k) => format!("{parent}/{k}"),
            At::Index(k, i) => format!("{parent}/{k}/{i}"),
            At::Name(k, n) => format!("{parent}/{k}/{}", escape(n)),
        }
    }
}

/// The subschemas of object `o`, each with whether it stands alone when `o` does
/// (`own`). A branch of a union stands alone unless the object around it declares
/// properties the branch combines with; the parts of `allOf`, `if`/`then`/`else` and
/// `dependentSchemas` always combine with their object, so only what lies below them
/// may be closed. `not` is left out: closing inside it would widen what it refuses.
fn below(o: &Map<String, Value>, own: bool) -> Vec<(At, bool)> {
    let declares = matches!(o.get("properties"), Some(Value::Object(_)));
    let mut out = Vec::new();
    for (key, alone) in [
        ("properties", true),
        ("$defs", true),
        ("definitions", true),
        ("patternProperties", true),
        ("dependentSchemas", false),
    ] {
        if let Some(Value::Object(m)) = o.get(key) {
            out.extend(m.keys().map(|n| (At::Name(key, n.clone()), alone)));
        }
    }
    for key in ["additionalProperties", "unevaluatedProperties", "additionalItems", "contains", "items"] {
        if o.get(key).is_some_and(Value::is_object) {
            out.push((At::Key(key), true));
        }
    }
    for (key, alone) in [
        ("items", true),
        ("prefixItems", true),
        ("anyOf", own && !declares),
        ("oneOf", own && !declares),
        ("allOf", false),
    ] {
        if let Some(Value::Array(list)) = o.get(key) {
            out.extend((0..list.len()).map(|i| (At::Index(key, i), alone)));
        }
    }
    for key in ["if", "then", "else"] {
        if o.contains_key(key) {
            out.push((At::Key(key), false));
        }
    }
    out
}

/// The local references some schema combines with others (from a part of `allOf`, or
/// beside `properties` of its own): the definitions they name stay open.
fn combined_references(s: &Value, own: bool, found: &mut HashSet<String>) {
    let Value::Object(o) = s else { return };
    if let Some(Value::String(r)) = o.get("$ref")
        && (!own || o.contains_key("properties"))
    {
        found.insert(r.clone());
    }
    for (at, alone) in below(o, own) {
        if let Some(v) = at.get(o) {
            combined_references(v, alone, found);
        }
    }
}

/// Closes `s` itself when `own` and the module's rule allow, and every schema below it.
/// `pointer`: where `s` is in the whole schema; `extended`: definitions that stay open.
fn close(s: &mut Value, own: bool, pointer: &str, extended: &HashSet<String>) {
    let Value::Object(o) = s else { return };
    if own && closable(o) {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (at, alone) in below(o, own) {
        let at_pointer = at.pointer(pointer);
        let alone = alone && !(matches!(at, At::Name("$defs" | "definitions", _)) && extended.contains(&at_pointer));
        if let Some(v) = at.get_mut(o) {
            close(v, alone, &at_pointer, extended);
        }
    }
}

/// An object that lists its properties, says nothing of others, and requires none it
/// does not list (closing that one would make it unsatisfiable).
fn closable(o: &Map<String, Value>) -> bool {
    let Some(Value::Object(props)) = o.get("properties") else { return false };
    let required_listed = match o.get("required") {
        Some(Value::Array(names)) => names.iter().all(|n| n.as_str().is_some_and(|n| props.contains_key(n))),
        _ => true,
    };
    required_listed && !OPENERS.iter().any(|k| o.contains_key(*k))
}

/// How deep `keep_declared` follows a schema (and its `$ref`s) into a value.
const MAX_DEPTH: usize = 64;

/// Drops from `value` every key a closed object of `schema` does not declare, at every
/// depth the schema describes plainly (through `properties`, `items` and local `$ref`s;
/// unions are left as they are, not knowing which branch the value meant).
fn keep_declared(schema: &Value, value: &mut Value, root: &Value, depth: usize) {
    let Some(o) = schema.as_object() else { return };
    if depth >= MAX_DEPTH {
        return;
    }
    if let Some(Value::String(r)) = o.get("$ref") {
        // A reference combined with properties beside it: which keys are declared is
        // the union of both, left as it is.
        if !o.contains_key("properties")
            && let Some(target) = local(root, r)
        {
            keep_declared(target, value, root, depth + 1);
        }
        return;
    }
    match value {
        Value::Object(fields) => {
            let Some(Value::Object(props)) = o.get("properties") else { return };
            if o.get("additionalProperties") == Some(&Value::Bool(false)) && !o.contains_key("patternProperties") {
                fields.retain(|k, _| props.contains_key(k));
            }
            for (k, sub) in props {
                if let Some(v) = fields.get_mut(k) {
                    keep_declared(sub, v, root, depth + 1);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item @ Value::Object(_)) = o.get("items") {
                items.iter_mut().for_each(|v| keep_declared(item, v, root, depth + 1));
            }
        }
        _ => {}
    }
}

/// The schema a local reference (`#/$defs/Name`, `#/definitions/Name`, `#`) names.
fn local<'a>(root: &'a Value, reference: &str) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    root.pointer(pointer)
}

/// The closed argument schemas of the functions a request offers, by name.
#[derive(Debug, Default, PartialEq)]
pub struct Declared(HashMap<String, Value>);

impl Declared {
    pub fn new<'a>(functions: impl IntoIterator<Item = (&'a str, &'a Value)>) -> Self {
        Self(functions.into_iter().map(|(name, schema)| (name.to_string(), closed(schema))).collect())
    }

    /// A call's arguments (JSON text) with the keys its function does not declare
    /// dropped; the text unchanged when nothing was dropped, or when it is not an
    /// object of a known function.
    pub fn arguments(&self, function: &str, arguments: String) -> String {
        let Some(schema) = self.0.get(function) else { return arguments };
        let Ok(mut value) = serde_json::from_str::<Value>(&arguments) else { return arguments };
        let before = value.clone();
        keep_declared(schema, &mut value, schema, 0);
        if value == before { arguments } else { value.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What LangChain's `bind_tools` sends for `def get_weather(city: str, unit: str =
    /// "celsius")`: no `additionalProperties`.
    fn langchain_weather() -> Value {
        json!({"type": "object", "properties": {"city": {"type": "string"},
               "unit": {"default": "celsius", "type": "string"}}, "required": ["city"]})
    }

    /// What it sends for a Pydantic model with a nested model and a list of them.
    fn langchain_pydantic() -> Value {
        json!({"type": "object", "title": "Trip",
               "properties": {"origin": {"$ref": "#/$defs/Place"},
                              "stops": {"type": "array", "items": {"$ref": "#/$defs/Place"}},
                              "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null}},
               "required": ["origin", "stops"],
               "$defs": {"Place": {"type": "object", "title": "Place",
                                   "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                                   "required": ["city"]}}})
    }

    #[test]
    fn objects_that_declare_properties_are_closed_at_every_depth() {
        let c = closed(&langchain_weather());
        assert_eq!(c["additionalProperties"], false);
        assert_eq!(c["properties"]["unit"], json!({"default": "celsius", "type": "string"}));
        let c = closed(&langchain_pydantic());
        assert_eq!(c["additionalProperties"], false);
        assert_eq!(c["$defs"]["Place"]["additionalProperties"], false);
        let nested = closed(&json!({"type": "object", "properties": {"a": {"type": "array",
            "items": {"type": "object", "properties": {"b": {"type": "object", "properties": {}}}}}}}));
        assert_eq!(nested["properties"]["a"]["items"]["additionalProperties"], false);
        assert_eq!(nested["properties"]["a"]["items"]["properties"]["b"]["additionalProperties"], false);
    }

    #[test]
    fn objects_that_allow_more_or_declare_nothing_stay_open() {
        for open in [
            json!({"type": "object"}),
            json!({"type": "object", "properties": {"a": {}}, "additionalProperties": true}),
            json!({"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}),
            json!({"type": "object", "properties": {"a": {}}, "patternProperties": {"^x-": {}}}),
            json!({"type": "object", "properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]}),
            json!({"properties": {"a": {}}, "$ref": "#/$defs/B", "$defs": {"B": {"type": "string"}}}),
        ] {
            assert_eq!(closed(&open).get("additionalProperties"), open.get("additionalProperties"), "{open}");
        }
        // Parts that combine with their parent are not closed themselves.
        let c = closed(&json!({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}));
        assert!(
            c["allOf"][0].get("additionalProperties").is_none() && c["allOf"][1].get("additionalProperties").is_none()
        );
        let c = closed(&json!({"properties": {"kind": {}}, "anyOf": [{"properties": {"a": {}}}]}));
        assert!(c["anyOf"][0].get("additionalProperties").is_none(), "{c}");
        // A plain union's branches stand alone and are closed.
        let c = closed(&json!({"anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}));
        assert_eq!(
            (&c["anyOf"][0]["additionalProperties"], &c["anyOf"][1]["additionalProperties"]),
            (&json!(false), &json!(false))
        );
        let c = closed(&json!({"not": {"properties": {"a": {}}}}));
        assert!(c["not"].get("additionalProperties").is_none());
        // A union inside a part of allOf combines with the other parts too.
        let c = closed(&json!({"allOf": [{"properties": {"a": {}}}, {"anyOf": [{"properties": {"b": {}}}]}]}));
        assert!(c["allOf"][1]["anyOf"][0].get("additionalProperties").is_none(), "{c}");
        let c = closed(&json!({"properties": {"a": {}}, "dependentSchemas": {"a": {"properties": {"b": {}}}}}));
        assert!(c["dependentSchemas"]["a"].get("additionalProperties").is_none(), "{c}");
        // Requiring a property it does not list: closing would refuse every value.
        let c = closed(&json!({"properties": {"a": {}}, "required": ["a", "b"]}));
        assert!(c.get("additionalProperties").is_none());
    }

    #[test]
    fn definitions_other_schemas_extend_stay_open() {
        let base = json!({"type": "object", "properties": {"id": {"type": "string"}}});
        let inherits = closed(&json!({"$defs": {"Base": base, "Leaf": base},
            "properties": {"item": {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"extra": {}}}]},
                           "beside": {"$ref": "#/$defs/Base", "properties": {"more": {}}},
                           "plain": {"$ref": "#/$defs/Leaf"}}}));
        assert!(inherits["$defs"]["Base"].get("additionalProperties").is_none(), "{inherits}");
        assert_eq!(inherits["$defs"]["Leaf"]["additionalProperties"], false, "{inherits}");
        let d = Declared::new([(
            "f",
            &json!({"$ref": "#/$defs/Base", "properties": {"more": {}},
            "$defs": {"Base": {"properties": {"id": {}}}}}),
        )]);
        assert_eq!(d.arguments("f", r#"{"id": 1, "more": 2}"#.into()), r#"{"id": 1, "more": 2}"#);
    }

    #[test]
    fn free_calls_lose_the_keys_their_function_does_not_declare() {
        let weather = langchain_weather();
        let trip = langchain_pydantic();
        let open = json!({"type": "object", "properties": {"a": {}}, "additionalProperties": true});
        let d = Declared::new([("get_weather", &weather), ("plan_trip", &trip), ("open", &open)]);
        // The call the issue saw: a `properties` key copied from the schema.
        let args = r#"{"city": "Paris", "unit": "celsius", "properties": {"city": {}}}"#;
        assert_eq!(d.arguments("get_weather", args.into()), r#"{"city":"Paris","unit":"celsius"}"#);
        let args =
            r#"{"origin": {"city": "Oslo", "zip": 1}, "stops": [{"city": "Bergen", "x": 2}], "note": null, "y": 3}"#;
        let kept: Value = serde_json::from_str(&d.arguments("plan_trip", args.into())).unwrap();
        assert_eq!(kept, json!({"origin": {"city": "Oslo"}, "stops": [{"city": "Bergen"}], "note": null}));
        // Nothing dropped: the model's own text, untouched.
        let clean = r#"{ "city" : "Paris" }"#;
        assert_eq!(d.arguments("get_weather", clean.into()), clean);
        assert_eq!(d.arguments("open", r#"{"a": 1, "b": 2}"#.into()), r#"{"a": 1, "b": 2}"#);
        assert_eq!(d.arguments("unknown", r#"{"b": 2}"#.into()), r#"{"b": 2}"#);
        assert_eq!(d.arguments("get_weather", "not json".into()), "not json");
    }

    #[test]
    fn references_that_loop_end() {
        let s = json!({"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object",
            "properties": {"next": {"$ref": "#/$defs/Node"}}}}});
        let d = Declared::new([("walk", &s)]);
        let mut deep = json!({});
        for _ in 0..100 {
            deep = json!({"next": deep, "x": 1});
        }
        let kept: Value = serde_json::from_str(&d.arguments("walk", deep.to_string())).unwrap();
        assert!(kept.get("x").is_none() && kept["next"].get("x").is_none());
    }
}
