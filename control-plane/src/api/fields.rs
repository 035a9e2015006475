//! Reading a request body's fields one by one, so that every mistake names its
//! parameter and bound the way the OpenAI API does, and unknown fields are refused.

use super::error::ApiError;
use serde_json::{Map, Value};
use std::collections::BTreeSet;

pub struct Fields<'a> {
    obj: &'a Map<String, Value>,
    read: BTreeSet<&'a str>,
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a decimal",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A number as the message shows it: integers without a fraction.
fn show(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 { format!("{}", x as i64) } else { format!("{x}") }
}

impl<'a> Fields<'a> {
    pub fn new(body: &'a Value) -> Result<Self, ApiError> {
        match body {
            Value::Object(obj) => Ok(Self { obj, read: BTreeSet::new() }),
            other => Err(ApiError::InvalidType { param: "body".into(), expected: "an object", got: kind(other) }),
        }
    }

    /// The raw value of a field, absent or null as None.
    pub fn raw(&mut self, name: &'a str) -> Option<&'a Value> {
        self.read.insert(name);
        self.obj.get(name).filter(|v| !v.is_null())
    }

    pub fn present(&self, name: &str) -> bool {
        self.obj.get(name).is_some_and(|v| !v.is_null())
    }

    /// Marks fields that are accepted and have no effect here.
    pub fn ignore(&mut self, names: &[&'a str]) {
        self.read.extend(names.iter().copied());
    }

    pub fn required(&mut self, name: &'a str) -> Result<&'a Value, ApiError> {
        self.raw(name).ok_or_else(|| ApiError::MissingParam(name.into()))
    }

    pub fn string(&mut self, name: &'a str) -> Result<Option<&'a str>, ApiError> {
        match self.raw(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::InvalidType { param: name.into(), expected: "a string", got: kind(v) }),
        }
    }

    pub fn bool(&mut self, name: &'a str, default: bool) -> Result<bool, ApiError> {
        match self.raw(name) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(ApiError::InvalidType { param: name.into(), expected: "a boolean", got: kind(v) }),
        }
    }

    /// A decimal in `[min, max]` (either bound optional).
    pub fn decimal(&mut self, name: &'a str, min: Option<f64>, max: Option<f64>) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.raw(name) else { return Ok(None) };
        let x = v.as_f64().ok_or_else(|| ApiError::InvalidType {
            param: name.into(),
            expected: "a decimal",
            got: kind(v),
        })?;
        check_range(name, x, min, max, false)?;
        Ok(Some(x))
    }

    /// An integer in `[min, max]`.
    pub fn integer(&mut self, name: &'a str, min: Option<i64>, max: Option<i64>) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.raw(name) else { return Ok(None) };
        let x = match v {
            Value::Number(n) => n.as_i64().or_else(|| n.as_u64().map(|_| i64::MAX)),
            _ => None,
        };
        let x = x.ok_or_else(|| ApiError::InvalidType { param: name.into(), expected: "an integer", got: kind(v) })?;
        check_range(name, x as f64, min.map(|m| m as f64), max.map(|m| m as f64), true)?;
        Ok(Some(x))
    }

    /// Refuses any field not read or ignored.
    pub fn finish(self) -> Result<(), ApiError> {
        match self.obj.keys().find(|k| !self.read.contains(k.as_str())) {
            Some(k) => Err(ApiError::UnknownParam(k.clone())),
            None => Ok(()),
        }
    }
}

pub fn check_range(name: &str, x: f64, min: Option<f64>, max: Option<f64>, integer: bool) -> Result<(), ApiError> {
    let what = if integer { "integer" } else { "decimal" };
    if let Some(min) = min.filter(|m| x < *m || x.is_nan()) {
        return Err(ApiError::OutOfRange {
            param: name.into(),
            code: if integer { "integer_below_min_value" } else { "decimal_below_min_value" },
            message: format!(
                "Invalid '{name}': {what} below minimum value. Expected a value >= {}, but got {} instead.",
                show(min),
                show(x)
            ),
        });
    }
    if let Some(max) = max.filter(|m| x > *m) {
        return Err(ApiError::OutOfRange {
            param: name.into(),
            code: if integer { "integer_above_max_value" } else { "decimal_above_max_value" },
            message: format!(
                "Invalid '{name}': {what} above maximum value. Expected a value <= {}, but got {} instead.",
                show(max),
                show(x)
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fields_name_their_param_type_and_bound() {
        let body = json!({"t": 5, "s": "x", "i": 2.5, "b": 1, "n": null, "extra": 1});
        let mut f = Fields::new(&body).unwrap();
        let e = f.decimal("t", Some(0.0), Some(2.0)).unwrap_err();
        assert_eq!(e.body()["error"]["code"], "decimal_above_max_value");
        assert_eq!(e.body()["error"]["param"], "t");
        assert!(e.body()["error"]["message"].as_str().unwrap().contains("Expected a value <= 2, but got 5"));
        let e = f.integer("i", Some(0), None).unwrap_err();
        assert_eq!(e.body()["error"]["code"], "invalid_type");
        let e = f.bool("b", false).unwrap_err();
        assert!(e.body()["error"]["message"].as_str().unwrap().contains("expected a boolean, but got an integer"));
        assert_eq!(f.string("s").unwrap(), Some("x"));
        assert_eq!(f.decimal("n", None, None).unwrap(), None, "null is absent");
        assert_eq!(f.integer("missing", Some(1), None).unwrap(), None);
        assert_eq!(f.finish().unwrap_err(), ApiError::UnknownParam("extra".into()));
        assert!(Fields::new(&json!([1])).is_err());
    }

    #[test]
    fn integers_below_the_minimum_are_refused() {
        let body = json!({"n": 0});
        let e = Fields::new(&body).unwrap().integer("n", Some(1), Some(128)).unwrap_err();
        assert_eq!(e.body()["error"]["code"], "integer_below_min_value");
    }
}
