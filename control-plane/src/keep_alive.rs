//! Early answers that leave keep-alive connections usable. A handler that answers
//! before reading the request's body (a 401 or 429 from the key check, a 404, a 413)
//! drops the body; hyper then drains only what has already arrived and, if more was on
//! its way, closes the connection after the response — whose head already said
//! keep-alive. A pooled client that picked that connection for its next request loses
//! it ("Server disconnected without sending a response"). So the rest of a small body
//! is read before the answer goes out, and otherwise the answer says
//! `Connection: close`, which no client reuses.

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Body as HttpBody, Frame, SizeHint};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

/// The most of an unread body read to keep its connection; larger ones close it.
const MAX_DRAIN_BYTES: u64 = 1 << 20;
/// How long a client that is slow to send the rest may hold the answer back.
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Middleware: the request's body as the handler sees it, and whatever the handler
/// left of it read (bounded) or the connection marked to close.
pub async fn settle_unread(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let length = parts.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let waits_for_continue = parts.headers.contains_key(header::EXPECT);
    let left: Left = Arc::default();
    let body = Body::new(Tracked { inner: Some(body), left: left.clone() });
    let mut response = next.run(Request::from_parts(parts, body)).await;
    let unread = left.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(unread) = unread {
        // A client that waits for `100 Continue` sends nothing more until told.
        let drainable = length.is_some_and(|l| l <= MAX_DRAIN_BYTES) && !waits_for_continue;
        let drained = drainable
            && matches!(
                tokio::time::timeout(DRAIN_TIME, axum::body::to_bytes(unread, MAX_DRAIN_BYTES as usize)).await,
                Ok(Ok(_))
            );
        if !drained {
            response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
    }
    response
}

/// Where a body dropped before its end is left for `settle_unread`.
type Left = Arc<Mutex<Option<Body>>>;

/// A request body that, dropped unfinished, hands what is left to its middleware.
struct Tracked {
    inner: Option<Body>,
    left: Left,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        match self.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.as_ref().map_or_else(|| SizeHint::with_exact(0), HttpBody::size_hint)
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take().filter(|b| !b.is_end_stream()) {
            *self.left.lock().unwrap_or_else(|e| e.into_inner()) = Some(inner);
        }
    }
}
