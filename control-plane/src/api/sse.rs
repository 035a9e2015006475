//! Server-sent events: a channel whose sender a task fills while the response body
//! drains it. When the client goes away the body is dropped, the next send fails, and
//! the task returns, dropping the worker stream (which aborts the worker's sequence).

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::convert::Infallible;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

pub struct Sender(mpsc::Sender<Result<Event, Infallible>>);

/// A response streaming whatever `fill` sends.
pub fn respond<F, Fut>(fill: F) -> Response
where
    F: FnOnce(Sender) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    // The request's span goes with the task: its lines name the request too, and so
    // does an error that ends the stream.
    let fill = fill(Sender(tx));
    let answering = super::error::answering_id();
    let task = async move {
        match answering {
            Some(id) => super::error::answering(id, fill).await,
            None => fill.await,
        }
    };
    tokio::spawn(task.in_current_span());
    Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response()
}

/// Why sending stopped: the client is gone.
#[derive(Debug)]
pub struct Gone;

impl Sender {
    /// `data: <json>` (chat and completions streams have no event names).
    pub async fn data(&self, v: &Value) -> Result<(), Gone> {
        self.send(Event::default().data(v.to_string())).await
    }

    /// `event: <name>` + `data: <json>` (Responses streams).
    pub async fn named(&self, name: &str, v: &Value) -> Result<(), Gone> {
        self.send(Event::default().event(name).data(v.to_string())).await
    }

    /// `f`'s result, or Gone as soon as the client leaves — even while the worker is
    /// still prefilling or producing tokens with no text.
    pub async fn unless_gone<T>(&self, f: impl Future<Output = T>) -> Result<T, Gone> {
        tokio::select! {
            v = f => Ok(v),
            _ = self.0.closed() => Err(Gone),
        }
    }

    /// The error that ends a chat or completions stream already under way: logged and
    /// counted (`ApiError::mid_stream`), sent as an error object, then `[DONE]`.
    pub async fn fail(&self, e: &super::error::ApiError) -> Result<(), Gone> {
        e.mid_stream();
        self.data(&e.body()).await?;
        self.done().await
    }

    pub async fn done(&self) -> Result<(), Gone> {
        self.send(Event::default().data("[DONE]")).await
    }

    async fn send(&self, e: Event) -> Result<(), Gone> {
        self.0.send(Ok(e)).await.map_err(|_| Gone)
    }
}
