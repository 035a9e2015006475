//! Every way an API request can fail, mapped once to the OpenAI error body
//! `{"error":{"message","type","param","code"}}` and an HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

tokio::task_local! {
    /// The id of the request being answered: a server error's message names it, for
    /// the client to quote (`x-request-id` has it too, where a client looks).
    static ANSWERING: String;
}

/// Runs `f` as the answer to request `id`, its stream's task included (`sse::respond`).
pub async fn answering<F: Future>(id: String, f: F) -> F::Output {
    ANSWERING.scope(id, f).await
}

/// The id of the request being answered here, if any.
pub fn answering_id() -> Option<String> {
    ANSWERING.try_with(Clone::clone).ok()
}

#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    MalformedJson(String),
    /// The body could not be read whole (too large, or cut off).
    BadBody {
        status: StatusCode,
        detail: String,
    },
    MissingParam(String),
    InvalidType {
        param: String,
        expected: &'static str,
        got: &'static str,
    },
    /// A number outside its range; `code` is e.g. `decimal_above_max_value`.
    OutOfRange {
        param: String,
        code: &'static str,
        message: String,
    },
    InvalidValue {
        param: String,
        message: String,
    },
    Combination {
        param: String,
        message: String,
    },
    UnknownParam(String),
    Unsupported {
        param: String,
        message: String,
    },
    ContextLength {
        param: &'static str,
        message: String,
    },
    MissingKey,
    InvalidKey {
        masked: String,
    },
    ModelNotFound {
        model: String,
        param: Option<&'static str>,
        /// The served model the name most likely meant (`Models::meant`).
        meant: Option<String>,
    },
    UnknownUrl {
        method: String,
        path: String,
    },
    UnsupportedEndpoint {
        what: &'static str,
    },
    /// No replica can take the request now.
    Overloaded,
    /// The organization's requests per minute are spent for now.
    RateLimited {
        org: String,
        decision: crate::limits::Decision,
    },
    /// A subscription's usage window or concurrency is spent for now.
    SubscriptionLimited {
        message: String,
        retry_after_us: u64,
    },
    /// The organization's credit does not cover the request; retrying will not help.
    InsufficientQuota {
        message: String,
    },
    /// Our fault: logged with detail, answered without it.
    Internal(String),
}

impl ApiError {
    pub fn invalid_value(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidValue { param: param.into(), message: message.into() }
    }

    /// A field of the wrong JSON type; `expected` reads "a string", "an object", ….
    pub fn invalid_type(param: impl Into<String>, expected: &'static str) -> Self {
        Self::InvalidType { param: param.into(), expected, got: "another type" }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey { .. } => StatusCode::UNAUTHORIZED,
            Self::ModelNotFound { .. } | Self::UnknownUrl { .. } | Self::UnsupportedEndpoint { .. } => {
                StatusCode::NOT_FOUND
            }
            Self::BadBody { status, .. } => *status,
            Self::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            Self::InsufficientQuota { .. } | Self::RateLimited { .. } | Self::SubscriptionLimited { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::BAD_REQUEST,
        }
    }

    /// The `error` object of the body.
    pub fn object(&self) -> Value {
        let (kind, code, param, message): (&str, Option<&str>, Option<&str>, String) = match self {
            Self::MalformedJson(detail) => (
                "invalid_request_error",
                None,
                None,
                format!(
                    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using \
                     your HTTP library correctly. The API expects a JSON payload, but what was sent was not valid \
                     JSON: {detail})"
                ),
            ),
            Self::BadBody { detail, .. } => {
                ("invalid_request_error", None, None, format!("Could not read the request body: {detail}."))
            }
            Self::MissingParam(p) => (
                "invalid_request_error",
                Some("missing_required_parameter"),
                Some(p),
                format!("Missing required parameter: '{p}'."),
            ),
            Self::InvalidType { param, expected, got } => (
                "invalid_request_error",
                Some("invalid_type"),
                Some(param),
                format!("Invalid type for '{param}': expected {expected}, but got {got} instead."),
            ),
            Self::OutOfRange { param, code, message } => {
                ("invalid_request_error", Some(code), Some(param), message.clone())
            }
            Self::InvalidValue { param, message } => {
                ("invalid_request_error", Some("invalid_value"), Some(param), message.clone())
            }
            Self::Combination { param, message } => {
                ("invalid_request_error", Some("invalid_parameter_combination"), Some(param), message.clone())
            }
            Self::UnknownParam(p) => {
                ("invalid_request_error", None, None, format!("Unrecognized request argument supplied: {p}"))
            }
            Self::Unsupported { param, message } => {
                ("invalid_request_error", Some("unsupported_value"), Some(param), message.clone())
            }
            Self::ContextLength { param, message } => {
                ("invalid_request_error", Some("context_length_exceeded"), Some(param), message.clone())
            }
            Self::MissingKey => (
                "invalid_request_error",
                None,
                None,
                "You didn't provide an API key. You need to provide your API key in an Authorization header using \
                 Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
                    .into(),
            ),
            Self::InvalidKey { masked } => (
                "invalid_request_error",
                Some("invalid_api_key"),
                None,
                format!(
                    "Incorrect API key provided: {masked}. Keys are created in the console or with `tessera keys create`."
                ),
            ),
            Self::ModelNotFound { model, param, meant } => (
                "invalid_request_error",
                Some("model_not_found"),
                *param,
                match meant {
                    Some(meant) => format!(
                        "The model `{model}` does not exist or you do not have access to it. Did you mean \
                         `{meant}`? Models are named by their full id; GET /v1/models lists them."
                    ),
                    None => format!(
                        "The model `{model}` does not exist or you do not have access to it. GET /v1/models lists \
                         the models served, by their full id."
                    ),
                },
            ),
            Self::UnknownUrl { method, path } => (
                "invalid_request_error",
                Some("unknown_url"),
                None,
                format!("Unknown request URL: {method} {path}. Please check the URL for typos; the API is under /v1."),
            ),
            Self::UnsupportedEndpoint { what } => (
                "invalid_request_error",
                Some("unknown_url"),
                None,
                format!("The {what} API is not supported by this service."),
            ),
            // OpenAI names the limit in `type`.
            Self::RateLimited { org, decision } => (
                "requests",
                Some("rate_limit_exceeded"),
                None,
                format!(
                    "Rate limit reached for requests in organization {org} on requests per min (RPM): Limit {}. \
                     Please try again in {}.",
                    decision.limit,
                    crate::limits::go_duration(decision.retry_after_us)
                ),
            ),
            Self::SubscriptionLimited { message, .. } => {
                ("requests", Some("rate_limit_exceeded"), None, message.clone())
            }
            Self::InsufficientQuota { message } => {
                ("insufficient_quota", Some("insufficient_quota"), None, message.clone())
            }
            Self::Overloaded => (
                "service_unavailable_error",
                Some("server_is_overloaded"),
                None,
                "Our servers are currently overloaded. Please try again later.".into(),
            ),
            Self::Internal(_) => (
                "server_error",
                None,
                None,
                match answering_id() {
                    Some(id) => format!(
                        "The server had an error while processing your request. Sorry about that! You can retry \
                         your request; if the error persists, report it with its request ID, {id}."
                    ),
                    None => "The server had an error while processing your request. Sorry about that!".into(),
                },
            ),
        };
        json!({"message": message, "type": kind, "param": param, "code": code})
    }

    pub fn body(&self) -> Value {
        json!({ "error": self.object() })
    }
}

impl ApiError {
    /// An error that ends a stream whose status line has already gone out as 200: a
    /// fault of ours is logged (with the request's id, from its span) as
    /// `into_response` would have, and every such end is counted by its type.
    pub fn mid_stream(&self) {
        if let Self::Internal(detail) = self {
            tracing::error!("internal error mid-stream: {detail}");
        } else if self.status().is_server_error() {
            tracing::warn!("stream ended by {}: {}", self.status(), self.object()["message"]);
        }
        let object = self.object();
        let kind = object["code"].as_str().or(object["type"].as_str()).unwrap_or("error").to_string();
        metrics::counter!(crate::metrics::STREAM_ERRORS, "code" => kind).increment(1);
    }
}

/// The layers' errors, each mapped here once: what the client did wrong becomes a 400
/// naming its parameter, our own failure a 500.
impl From<crate::chat::ChatError> for ApiError {
    fn from(e: crate::chat::ChatError) -> Self {
        use crate::chat::ChatError::*;
        match &e {
            NoTemplate { .. } | TemplateRefused(_) => Self::invalid_value("messages", e.to_string()),
            TextHasImageToken { param, .. } | ImagesNotShown { param, .. } | TooFewTokens { param, .. } => {
                Self::invalid_value(*param, e.to_string())
            }
            Internal(detail) => Self::Internal(detail.clone()),
        }
    }
}

impl From<crate::images::Refused> for ApiError {
    fn from(e: crate::images::Refused) -> Self {
        use crate::images::Refused;
        let message = e.to_string();
        match e {
            Refused::Part { param, .. } => Self::InvalidValue { param, message },
            Refused::TextOnly { param, .. } => Self::Unsupported { param, message },
        }
    }
}

/// A spent quota is a 429 that retrying will not fix; a subscription's window or
/// concurrency, one to retry after it frees up.
impl From<crate::billing::AdmitError> for ApiError {
    fn from(e: crate::billing::AdmitError) -> Self {
        use crate::billing::AdmitError;
        match (&e, e.retry_after_us()) {
            (AdmitError::Failed, _) => Self::Internal(e.to_string()),
            (_, Some(retry_after_us)) => Self::SubscriptionLimited { message: e.to_string(), retry_after_us },
            (_, None) => Self::InsufficientQuota { message: e.to_string() },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let Self::Internal(detail) = &self {
            tracing::error!("internal error: {detail}");
        }
        let refused = match &self {
            Self::RateLimited { .. } => Some("rate_limited"),
            Self::SubscriptionLimited { .. } => Some("window_exhausted"),
            Self::InsufficientQuota { .. } => Some("insufficient_quota"),
            Self::Overloaded => Some("overloaded"),
            _ => None,
        };
        if let Some(outcome) = refused {
            metrics::counter!(crate::metrics::REFUSALS, "outcome" => outcome).increment(1);
        }
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if let Self::RateLimited { decision, .. } = &self {
            super::auth::set_rate_headers(response.headers_mut(), decision);
        }
        if matches!(self, Self::InsufficientQuota { .. }) {
            // The SDKs retry a 429 unless this header says not to: a spent quota stays spent.
            response.headers_mut().insert("x-should-retry", axum::http::HeaderValue::from_static("false"));
        }
        if let Self::SubscriptionLimited { retry_after_us, .. } = &self {
            let h = response.headers_mut();
            for (name, value) in [
                ("retry-after", retry_after_us.div_ceil(1_000_000)),
                ("retry-after-ms", retry_after_us.div_ceil(1_000)),
            ] {
                h.insert(name, axum::http::HeaderValue::from(value));
            }
            // The SDKs retry a 429 after at most a minute: a window hours from resetting
            // is not worth their retries.
            if *retry_after_us > 60_000_000 {
                h.insert("x-should-retry", axum::http::HeaderValue::from_static("false"));
            }
        }
        if matches!(self, Self::Overloaded) {
            response.headers_mut().insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_status_and_openai_body() {
        let cases = [
            (ApiError::MissingKey, 401, None),
            (ApiError::InvalidKey { masked: "tsk_abcd***wxyz".into() }, 401, Some("invalid_api_key")),
            (
                ApiError::ModelNotFound { model: "model-a".into(), param: None, meant: None },
                404,
                Some("model_not_found"),
            ),
            (ApiError::MalformedJson("eof".into()), 400, None),
            (ApiError::MissingParam("messages".into()), 400, Some("missing_required_parameter")),
            (ApiError::UnsupportedEndpoint { what: "embeddings" }, 404, Some("unknown_url")),
            (ApiError::Overloaded, 503, Some("server_is_overloaded")),
            (ApiError::Internal("secret detail".into()), 500, None),
        ];
        for (e, status, code) in cases {
            assert_eq!(e.status().as_u16(), status, "{e:?}");
            let body = e.body();
            assert_eq!(body["error"]["code"].as_str(), code, "{e:?}");
            assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
            assert!(body["error"]["type"].is_string());
        }
        assert!(!ApiError::Internal("secret detail".into()).body().to_string().contains("secret detail"));
    }
}
