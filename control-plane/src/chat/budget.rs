//! A request's thinking budget: how many tokens its reasoning may take before the
//! worker forces the family's closing marker (`tessera_worker::engine::thinking`).
//!
//! The budget is the request's own (vLLM's `thinking_token_budget`, SGLang's
//! `thinking_budget`, or `chat_template_kwargs.thinking_budget`: `api::params::
//! thinking_budget`), else the model's
//! catalog default, else the server's `--thinking-budget`, else none. When the output
//! is constrained (a format or a forced tool call), reasoning also ends early enough to
//! leave the answer its shortest valid length plus half of what remains of
//! `max_tokens` after it: a model that would think until the limit still answers, and
//! the answer has room to be more than the bare minimum.

use super::ChatError;
use super::Prepared;
use super::output::Markers;
use super::reasoning::Thinking;
use crate::router::ServedModel;
use tessera_proto::worker as pb;

/// What the worker is told about the output's reasoning; None when it cannot reason.
/// A constrained output whose shortest valid answer cannot fit `max_tokens` is refused,
/// naming `max_param`.
pub fn for_worker(
    model: &ServedModel,
    prepared: &Prepared,
    requested: Option<u32>,
    max_tokens: u32,
    max_param: &'static str,
) -> Result<Option<pb::ThinkingBudget>, ChatError> {
    let markers = model.entry.reasoning.markers;
    let reasons = prepared.thinking != Thinking::Off;
    let close = match (markers.close(), markers.forced_close()) {
        (Some(close), Some(forced)) if reasons => Some((close, super::tokenize(model, forced)?)),
        _ => None,
    };
    let closing = close.as_ref().map_or(0, |(_, tokens)| tokens.len());
    let floor = prepared.shortest.as_deref().map(|a| super::tokenize(model, a)).transpose()?.map(|t| t.len());
    let asked = requested.or(model.entry.reasoning.thinking_budget);
    let budget = limit(asked, prepared.thinking, closing, floor, max_tokens as usize)
        .map_err(|(floor, must_close)| ChatError::TooFewTokens { param: max_param, max_tokens, floor, must_close })?;
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
