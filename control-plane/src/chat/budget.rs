//! A request's thinking budget: how many tokens its reasoning may take before the
//! worker forces the family's closing marker (`tessera_worker::engine::thinking`).
//!
//! The budget is the request's own (vLLM's `thinking_token_budget`, SGLang's
//! `thinking_budget`, or `chat_template_kwargs.thinking_budget`), else the model's
//! catalog default, else the server's `--thinking-budget`, else none. When the output
//! is constrained (a format or a forced tool call), reasoning also ends early enough to
//! leave the answer its shortest valid length plus half of what remains of
//! `max_tokens` after it: a model that would think until the limit still answers, and
//! the answer has room to be more than the bare minimum.

use super::Prepared;
use super::output::Markers;
use super::reasoning::Thinking;
use crate::api::error::ApiError;
use crate::api::fields::Fields;
use crate::router::ServedModel;
use serde_json::{Map, Value};
use tessera_proto::worker as pb;

/// The budget a request names; None when it names none or `-1` (the model's default).
pub fn requested<'a>(f: &mut Fields<'a>, kwargs: Option<&Map<String, Value>>) -> Result<Option<u32>, ApiError> {
    let mut named: Option<(String, i64)> = None;
    let top = [
        ("thinking_token_budget", f.integer("thinking_token_budget", Some(-1), None)?),
        ("thinking_budget", f.integer("thinking_budget", Some(-1), None)?),
    ];
    let in_kwargs = match kwargs.and_then(|k| k.get("thinking_budget")) {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(b) if b >= -1 => Some(b),
            _ => {
                return Err(ApiError::invalid_value(
                    "chat_template_kwargs.thinking_budget",
                    format!(
                        "Invalid value: {v}. The thinking budget is a number of tokens, or -1 for the model's default."
                    ),
                ));
            }
        },
    };
    for (param, value) in top.into_iter().chain([("chat_template_kwargs.thinking_budget", in_kwargs)]) {
        let Some(value) = value else { continue };
        match &named {
            Some((first, v)) if *v != value => {
                return Err(ApiError::Combination {
                    param: param.into(),
                    message: format!("'{param}' ({value}) and '{first}' ({v}) name different thinking budgets."),
                });
            }
            _ => named = Some((param.into(), value)),
        }
    }
    Ok(named.and_then(|(_, v)| u32::try_from(v).ok()))
}

/// What the worker is told about the output's reasoning; None when it cannot reason.
/// A constrained output whose shortest valid answer cannot fit `max_tokens` is refused,
/// naming `max_param`.
pub fn for_worker(
    model: &ServedModel,
    prepared: &Prepared,
    requested: Option<u32>,
    max_tokens: u32,
    max_param: &'static str,
) -> Result<Option<pb::ThinkingBudget>, ApiError> {
    let markers = model.entry.reasoning.markers;
    let reasons = prepared.thinking != Thinking::Off;
    let close = match (markers.close(), markers.forced_close()) {
        (Some(close), Some(forced)) if reasons => Some((close, super::tokenize(model, forced)?)),
        _ => None,
    };
    let closing = close.as_ref().map_or(0, |(_, tokens)| tokens.len());
    let floor = prepared.shortest.as_deref().map(|a| super::tokenize(model, a)).transpose()?.map(|t| t.len());
    let asked = requested.or(model.entry.reasoning.thinking_budget);
    let budget =
        limit(asked, prepared.thinking, closing, floor, max_tokens as usize).map_err(|(floor, must_close)| {
            let after =
                if must_close > 0 { format!(", after the {must_close} that end the reasoning") } else { String::new() };
            ApiError::invalid_value(
                max_param,
                format!(
                    "'{max_param}' is {max_tokens}, too few for any valid answer: the shortest the requested format \
                 allows takes {floor} tokens{after}."
                ),
            )
        })?;
    // With no budget the block is still watched: an end picked inside it closes it.
    let Some((close, close_tokens)) = close else { return Ok(None) };
    let budget = budget.unwrap_or(u32::MAX);
    Ok(Some(pb::ThinkingBudget {
        inside: prepared.thinking == Thinking::Open,
        open: markers.open().unwrap_or_default().into(),
        close: close.into(),
        close_tokens,
        budget,
    }))
}

/// The budget the worker applies: the one asked for, and with a constrained answer
/// (`floor`: its shortest valid length) at most half of what `max_tokens` leaves after
/// the close and that answer. Err((floor, close)) when the answer cannot fit at all.
fn limit(
    asked: Option<u32>,
    thinking: Thinking,
    closing: usize,
    floor: Option<usize>,
    max_tokens: usize,
) -> Result<Option<u32>, (usize, usize)> {
    let Some(floor) = floor else { return Ok(asked) };
    let must_close = if thinking == Thinking::Open { closing } else { 0 };
    if max_tokens < floor + must_close {
        return Err((floor, must_close));
    }
    if thinking == Thinking::Off {
        return Ok(asked);
    }
    let room = (max_tokens.saturating_sub(closing + floor) / 2) as u32;
    Ok(Some(asked.map_or(room, |b| b.min(room))))
}

impl Markers {
    /// What a spent budget forces: the closing marker, set off as the family's
    /// templates write it.
    pub fn forced_close(self) -> Option<&'static str> {
        match self {
            Markers::Plain => None,
            Markers::Think => Some("\n</think>\n\n"),
            Markers::Channel => Some("<|channel|>"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: Value) -> Result<Option<u32>, ApiError> {
        let mut f = Fields::new(&body).unwrap();
        let kwargs = body.get("chat_template_kwargs").and_then(Value::as_object).cloned();
        f.raw("chat_template_kwargs");
        let r = requested(&mut f, kwargs.as_ref());
        f.finish()?;
        r
    }

    #[test]
    fn each_name_of_the_budget_is_read_and_minus_one_is_the_default() {
        assert_eq!(parse(json!({})).unwrap(), None);
        assert_eq!(parse(json!({"thinking_token_budget": 64})).unwrap(), Some(64));
        assert_eq!(parse(json!({"thinking_budget": 0})).unwrap(), Some(0));
        assert_eq!(parse(json!({"chat_template_kwargs": {"thinking_budget": 12}})).unwrap(), Some(12));
        assert_eq!(parse(json!({"thinking_budget": -1})).unwrap(), None);
        assert_eq!(parse(json!({"thinking_budget": 5, "thinking_token_budget": 5})).unwrap(), Some(5));
        let e = parse(json!({"thinking_budget": 5, "thinking_token_budget": 6})).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "thinking_budget", "{:?}", e.body());
        let e = parse(json!({"thinking_budget": -2})).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "thinking_budget");
        let e = parse(json!({"chat_template_kwargs": {"thinking_budget": "lots"}})).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "chat_template_kwargs.thinking_budget");
    }

    #[test]
    fn a_constrained_answer_keeps_its_floor_and_half_the_rest() {
        use Thinking::*;
        // Free output: the budget asked for, whatever max_tokens.
        assert_eq!(limit(Some(100), Open, 5, None, 20), Ok(Some(100)));
        assert_eq!(limit(None, Open, 5, None, 20), Ok(None));
        // 200 tokens, a 5-token close, a 15-token answer: reasoning gets (200-20)/2.
        assert_eq!(limit(None, Open, 5, Some(15), 200), Ok(Some(90)));
        assert_eq!(limit(Some(40), Open, 5, Some(15), 200), Ok(Some(40)));
        assert_eq!(limit(Some(400), Optional, 5, Some(15), 200), Ok(Some(90)));
        // Just room for close and answer: no reasoning at all.
        assert_eq!(limit(Some(400), Open, 5, Some(15), 20), Ok(Some(0)));
        assert_eq!(limit(None, Open, 5, Some(15), 19), Err((15, 5)));
        // The model need not think: the answer alone must fit.
        assert_eq!(limit(None, Optional, 5, Some(15), 16), Ok(Some(0)));
        assert_eq!(limit(None, Off, 5, Some(15), 14), Err((15, 0)));
        assert_eq!(limit(Some(3), Off, 0, Some(15), 15), Ok(Some(3)));
    }
}
