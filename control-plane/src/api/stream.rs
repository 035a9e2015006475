//! The worker's stream as the endpoints read it: typed events, made here and only here.
//! Each endpoint turns them into its own wire format. What a worker may not send — a
//! choice it was not asked for, output after a choice finished, a stream that ends
//! before every choice did — is refused here, once, as an internal error.

use super::error::ApiError;
use super::generate::Output;
use crate::chat::output::{OutputParser, Piece, Reading, Split};
use std::collections::VecDeque;
use tessera_proto::worker as pb;

/// Why a choice ended, as every endpoint names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop sequence.
    #[default]
    Stop,
    /// `max_tokens` (or the context) ran out.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }

    /// A finished delta's reason; None while the choice goes on. (An aborted
    /// generation never gets here: `Output::next` fails it.)
    fn from_worker(code: i32) -> Option<Self> {
        match pb::FinishReason::try_from(code).ok()? {
            pb::FinishReason::Stop => Some(Self::Stop),
            pb::FinishReason::Length => Some(Self::Length),
            // A handoff goes on at the decode replica (`Output::next` follows it).
            pb::FinishReason::Abort | pb::FinishReason::Handoff | pb::FinishReason::Unspecified => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The prompt's tokens after the first, scored: once, before any choice's output.
    PromptScores(Vec<pb::PromptToken>),
    /// Choice `index` went on: its text as the worker decoded it, the same text read
    /// as the request's `Reading` says (pieces are held back while a marker may be
    /// starting), and its tokens with their log-probabilities when asked.
    Delta { index: usize, text: String, pieces: Vec<Piece>, tokens: Vec<pb::GeneratedToken> },
    /// Choice `index` ended; nothing of it follows.
    Finished { index: usize, reason: FinishReason },
}

/// Token counts of a whole generation.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    /// Every generated token, reasoning included.
    pub completion_tokens: u32,
    /// The completion tokens that were chain-of-thought.
    pub reasoning_tokens: u32,
}

/// One generation's events, in order.
pub struct Events {
    out: Output,
    reader: Reader,
}

/// What the worker's messages have said so far, and the events they made.
struct Reader {
    choices: Vec<Choice>,
    queued: VecDeque<Event>,
    usage: Usage,
    scored: bool,
}

struct Choice {
    parser: OutputParser,
    finished: bool,
}

impl Events {
    /// The events of `out`'s `n` choices, each read as `reading` says.
    pub fn new(out: Output, n: u32, reading: &Reading) -> Self {
        Self { out, reader: Reader::new(n, reading) }
    }

    /// The next event, or None once every choice has finished.
    pub async fn next(&mut self) -> Result<Option<Event>, ApiError> {
        loop {
            if let Some(e) = self.reader.queued.pop_front() {
                return Ok(Some(e));
            }
            let read = match self.out.next().await? {
                Some(r) => self.reader.read(r),
                None => return self.reader.ended().map(|()| None).inspect_err(|_| self.out.failed()),
            };
            // A worker that breaks the protocol is a failure on our side, as /status counts.
            read.inspect_err(|_| self.out.failed())?;
        }
    }

    /// The end of choice `index` when the worker's message that made its last `Delta`
    /// also ended it, taken without waiting: for a wire format that carries both in
    /// one chunk (legacy completions).
    pub fn finished_with(&mut self, index: usize) -> Option<FinishReason> {
        match self.reader.queued.front() {
            Some(&Event::Finished { index: i, reason }) if i == index => {
                self.reader.queued.pop_front();
                Some(reason)
            }
            _ => None,
        }
    }

    /// What the generation used so far (all of it, once `next` has returned None).
    pub fn usage(&self) -> Usage {
        self.reader.usage()
    }

    /// How many choices it has.
    pub fn n(&self) -> usize {
        self.reader.choices.len()
    }
}

impl Reader {
    fn new(n: u32, reading: &Reading) -> Self {
        let choices = (0..n.max(1)).map(|_| Choice { parser: reading.parser(), finished: false }).collect();
        Self { choices, queued: VecDeque::new(), usage: Usage::default(), scored: false }
    }

    fn usage(&self) -> Usage {
        Usage { reasoning_tokens: self.choices.iter().map(|c| c.parser.reasoning_tokens()).sum(), ..self.usage }
    }

    fn read(&mut self, r: pb::GenerateResponse) -> Result<(), ApiError> {
        let index = r.index as usize;
        let Some(choice) = self.choices.get_mut(index) else {
            return Err(ApiError::Internal(format!(
                "worker sent completion index {index} of a request for {}",
                self.choices.len()
            )));
        };
        if choice.finished {
            return Err(ApiError::Internal(format!("worker sent output for completion {index} after it finished")));
        }
        // Every delta repeats the prompt's counts.
        self.usage.prompt_tokens = r.prompt_tokens;
        self.usage.cached_tokens = r.cached_prompt_tokens;
        self.usage.completion_tokens += r.tokens.len() as u32;
        if !r.prompt_logprobs.is_empty() && !self.scored {
            self.scored = true;
            self.queued.push_back(Event::PromptScores(r.prompt_logprobs));
        }
        let reason = FinishReason::from_worker(r.finish_reason);
        let mut pieces = choice.parser.push(&r.text, r.tokens.len() as u32);
        if reason.is_some() {
            pieces.extend(choice.parser.finish());
            choice.finished = true;
        }
        if !r.text.is_empty() || !r.tokens.is_empty() || !pieces.is_empty() {
            self.queued.push_back(Event::Delta { index, text: r.text, pieces, tokens: r.tokens });
        }
        if let Some(reason) = reason {
            self.queued.push_back(Event::Finished { index, reason });
        }
        Ok(())
    }

    /// The worker's stream ended: every choice must have finished.
    fn ended(&self) -> Result<(), ApiError> {
        match self.choices.iter().position(|c| !c.finished) {
            Some(i) => Err(ApiError::Internal(format!("the worker's stream ended before completion {i} finished"))),
            None => Ok(()),
        }
    }
}

/// One choice, gathered for a non-streamed reply.
#[derive(Debug, Default, Clone)]
pub struct Gathered {
    pub text: String,
    /// The text read as the request's reading says: reasoning, content, calls.
    pub split: Split,
    pub tokens: Vec<pb::GeneratedToken>,
    pub finish_reason: FinishReason,
    /// The prompt's tokens after the first, scored, when the generation asked: one
    /// choice scored the prompt, every choice shows it.
    pub prompt_scores: Vec<pb::PromptToken>,
}

/// Reads every choice to its end.
pub async fn gather(mut events: Events) -> Result<(Vec<Gathered>, Usage), ApiError> {
    let mut choices = vec![Gathered::default(); events.n()];
    let mut scores = Vec::new();
    while let Some(e) = events.next().await? {
        match e {
            Event::PromptScores(s) => scores = s,
            Event::Delta { index, text, pieces, tokens } => {
                let c = &mut choices[index];
                c.text.push_str(&text);
                c.split.add(pieces);
                c.tokens.extend(tokens);
            }
            Event::Finished { index, reason } => choices[index].finish_reason = reason,
        }
    }
    for c in &mut choices {
        c.prompt_scores = scores.clone();
    }
    Ok((choices, events.usage()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_take_their_openai_names() {
        assert_eq!(FinishReason::from_worker(pb::FinishReason::Stop as i32), Some(FinishReason::Stop));
        assert_eq!(
            FinishReason::from_worker(pb::FinishReason::Length as i32).map(FinishReason::as_str),
            Some("length")
        );
        assert_eq!(FinishReason::from_worker(pb::FinishReason::Unspecified as i32), None);
        assert_eq!(FinishReason::from_worker(99), None);
    }

    fn delta(index: u32, text: &str, tokens: &[u32], finish: pb::FinishReason) -> pb::GenerateResponse {
        pb::GenerateResponse {
            index,
            text: text.into(),
            tokens: tokens.iter().map(|&token_id| pb::GeneratedToken { token_id, ..Default::default() }).collect(),
            finish_reason: finish as i32,
            prompt_tokens: 7,
            cached_prompt_tokens: 3,
            ..Default::default()
        }
    }

    fn drain(r: &mut Reader) -> Vec<Event> {
        r.queued.drain(..).collect()
    }

    #[test]
    fn worker_messages_become_events_per_choice() {
        let mut r = Reader::new(2, &Reading::PLAIN);
        let mut first = delta(1, "Hi", &[5], pb::FinishReason::Unspecified);
        first.prompt_logprobs = vec![pb::PromptToken { token_id: 9, ..Default::default() }];
        r.read(first).unwrap();
        let events = drain(&mut r);
        assert!(matches!(&events[0], Event::PromptScores(s) if s[0].token_id == 9), "{events:?}");
        assert!(matches!(&events[1], Event::Delta { index: 1, text, .. } if text == "Hi"), "{events:?}");
        // The prompt's scores come once, however many choices repeat them.
        let mut again = delta(0, "", &[6], pb::FinishReason::Length);
        again.prompt_logprobs = vec![pb::PromptToken { token_id: 9, ..Default::default() }];
        r.read(again).unwrap();
        let events = drain(&mut r);
        assert!(matches!(&events[0], Event::Delta { index: 0, .. }), "{events:?}");
        assert_eq!(events[1], Event::Finished { index: 0, reason: FinishReason::Length });
        assert_eq!(events.len(), 2);
        // A stream that ends with a choice unfinished is refused.
        assert!(matches!(r.ended(), Err(ApiError::Internal(m)) if m.contains("completion 1")));
        r.read(delta(1, "", &[], pb::FinishReason::Stop)).unwrap();
        assert_eq!(drain(&mut r), [Event::Finished { index: 1, reason: FinishReason::Stop }], "nothing empty is sent");
        r.ended().unwrap();
        assert_eq!(r.usage(), Usage { prompt_tokens: 7, cached_tokens: 3, completion_tokens: 2, reasoning_tokens: 0 });
    }

    #[test]
    fn a_worker_cannot_send_what_was_not_asked_for() {
        let mut r = Reader::new(1, &Reading::PLAIN);
        let e = r.read(delta(1, "x", &[1], pb::FinishReason::Unspecified)).unwrap_err();
        assert!(matches!(&e, ApiError::Internal(m) if m.contains("index 1")), "{e:?}");
        r.read(delta(0, "x", &[1], pb::FinishReason::Stop)).unwrap();
        let e = r.read(delta(0, "y", &[2], pb::FinishReason::Unspecified)).unwrap_err();
        assert!(matches!(&e, ApiError::Internal(m) if m.contains("after it finished")), "{e:?}");
    }
}
