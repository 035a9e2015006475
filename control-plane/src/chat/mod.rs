//! Turning API messages into a prompt: the message list the model's chat template
//! reads, the template rendered with the request's and the catalog's kwargs, tokens.

pub mod messages;
pub mod output;

use crate::api::error::ApiError;
use crate::router::ServedModel;
use serde_json::{Map, Value};

/// The catalog's `chat_template_kwargs` for the model with the request's merged over
/// them (unknown keys are passed along and ignored by templates that do not read them).
pub fn template_kwargs(model: &ServedModel, request: Option<&Map<String, Value>>) -> Map<String, Value> {
    let mut kwargs = model.entry.chat_template_kwargs.clone();
    if let Some(r) = request {
        for (k, v) in r {
            kwargs.insert(k.clone(), v.clone());
        }
    }
    kwargs
}

/// Renders the template and tokenizes the result (special tokens in the text are
/// parsed as such; none are added).
pub fn prompt_tokens(
    model: &ServedModel,
    messages: &[Value],
    kwargs: &Map<String, Value>,
) -> Result<(String, Vec<u32>), ApiError> {
    let replica = &model.replica;
    let template = replica.template.as_ref().ok_or_else(|| {
        ApiError::invalid_value("messages", format!("{} has no chat template; use /v1/completions", model.entry.id))
    })?;
    let text = template
        .render_json(&Value::Array(messages.to_vec()), None, true, kwargs)
        // A template's raise_exception is about the conversation's shape: the client's.
        .map_err(|e| ApiError::invalid_value("messages", format!("The chat template refused these messages: {e}")))?;
    Ok((text.clone(), tokenize(model, &text)?))
}

pub fn tokenize(model: &ServedModel, text: &str) -> Result<Vec<u32>, ApiError> {
    let encoding =
        model.replica.tokenizer.encode(text, false).map_err(|e| ApiError::Internal(format!("tokenizing: {e}")))?;
    Ok(encoding.get_ids().to_vec())
}
