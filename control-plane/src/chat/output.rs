//! A model's output text split into reasoning, content and tool calls by the markers
//! of its family, as it streams.
//!
//! Deltas arrive cut anywhere, even inside a marker, so a tail that could still begin a
//! marker is held back until the next delta (or the end) decides it: the pieces, joined
//! by kind, are the same however the output was cut. Two states hold more than a tail:
//! a tool call's body, parsed when its closing marker arrives, and the undecided start
//! of a model that may think without being asked (docs/api.md, Reasoning), held
//! until a bare closing marker makes it reasoning or the end makes it content, so that
//! chain-of-thought never reaches `content`.

use super::schema::Declared;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;
use tessera_proto::text::partial_suffix;

/// The reasoning markers of a model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Markers {
    /// No reasoning markers: everything outside tool calls is content.
    Plain,
    /// Reasoning inside `<think>` … `</think>`.
    Think,
    /// Reasoning between `<|channel|>thought` and the next `<|channel|>`.
    Channel,
}

impl Markers {
    pub fn open(self) -> Option<&'static str> {
        match self {
            Markers::Plain => None,
            Markers::Think => Some("<think>"),
            Markers::Channel => Some("<|channel|>thought"),
        }
    }

    pub fn close(self) -> Option<&'static str> {
        match self {
            Markers::Plain => None,
            Markers::Think => Some("</think>"),
            Markers::Channel => Some("<|channel|>"),
        }
    }
}

/// Where the output begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    Content,
    /// The prompt opened the reasoning block (thinking on).
    Reasoning,
    /// Thinking is off, but the model may think anyway and end with a bare closing
    /// marker: nothing is released until that marker or the end.
    Undecided,
}

/// How a family's template asks for tool calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolFormat {
    /// One JSON object `{"name": …, "arguments": {…}}` between `<tool_call>` and
    /// `</tool_call>` per call (Hermes, Qwen and most ChatML families).
    #[default]
    Hermes,
    /// `[TOOL_CALLS]` and then a JSON array of such objects, up to the end of the
    /// output (Mistral's families).
    Mistral,
}

impl ToolFormat {
    pub fn open(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "<tool_call>",
            ToolFormat::Mistral => "[TOOL_CALLS]",
        }
    }

    /// The marker that ends a call; None when calls run to the end of the output.
    pub fn close(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes => Some("</tool_call>"),
            ToolFormat::Mistral => None,
        }
    }

    /// The calls in a body, or None when it is not calls (the text then stays content).
    fn calls(self, body: &str) -> Option<Vec<Piece>> {
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        match (self, v) {
            (ToolFormat::Hermes, v @ Value::Object(_)) => Some(vec![call(&v)?]),
            (ToolFormat::Mistral, Value::Array(list)) if !list.is_empty() => list.iter().map(call).collect(),
            _ => None,
        }
    }
}

/// One call object: its name, and arguments as an object (or as JSON text already).
fn call(v: &Value) -> Option<Piece> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(args @ Value::Object(_)) => args.to_string(),
        Some(_) => return None,
    };
    Some(Piece::ToolCall { name, arguments })
}

/// How one request's output is read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Reading {
    pub markers: Markers,
    pub start: Start,
    /// The tool-call format, when the request lets the model call tools.
    pub tools: Option<ToolFormat>,
    /// An answer that is only call objects, without their markers, is read as calls:
    /// small Hermes-format models (Qwen2.5-Coder 0.5B) often drop the tags. Only for
    /// free output: a grammar writes the markers itself.
    pub bare_calls: bool,
    /// The offered functions' argument schemas, closed: a call's undeclared keys are
    /// dropped (`schema::Declared`).
    pub declared: Option<Arc<Declared>>,
}

impl Reading {
    /// Everything is content (legacy completions).
    pub const PLAIN: Reading =
        Reading { markers: Markers::Plain, start: Start::Content, tools: None, bare_calls: false, declared: None };

    pub fn parser(&self) -> OutputParser {
        let mut p = OutputParser::new(self.markers, self.start, self.tools);
        p.bare_calls = self.bare_calls && self.tools.is_some();
        p.declared = self.declared.clone();
        p
    }
}

/// A whole output split: each kind joined, calls in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
    /// Each call's function name and arguments (JSON text).
    pub calls: Vec<(String, String)>,
}

impl Split {
    pub fn add(&mut self, pieces: Vec<Piece>) {
        for p in pieces {
            match p {
                Piece::Reasoning(t) => self.reasoning.push_str(&t),
                Piece::Content(t) => self.content.push_str(&t),
                Piece::ToolCall { name, arguments } => self.calls.push((name, arguments)),
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    /// A whole tool call: the function's name and its arguments as JSON text.
    ToolCall {
        name: String,
        arguments: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Content,
    Reasoning,
    Undecided,
    ToolCall,
    /// The answer opened with `{` and may be bare call objects: held to the end.
    MaybeCalls,
}

#[derive(Debug, Clone)]
pub struct OutputParser {
    markers: Markers,
    tools: Option<ToolFormat>,
    state: State,
    /// Text not yet looked at past a possible marker start.
    held: String,
    /// The undecided start, or the tool call's body, so far.
    body: String,
    /// Tokens that were chain-of-thought, and those of an undecided start.
    reasoning_tokens: u32,
    undecided_tokens: u32,
    /// Read an answer of bare call objects as calls (`Reading::bare_calls`).
    bare_calls: bool,
    /// The answer has begun (text other than whitespace, or a call).
    answered: bool,
    declared: Option<Arc<Declared>>,
}

impl OutputParser {
    /// `tools`: the format of calls when the request offered tools (their markers are
    /// plain text otherwise).
    pub fn new(markers: Markers, start: Start, tools: Option<ToolFormat>) -> Self {
        let state = match (markers, start) {
            (Markers::Plain, _) | (_, Start::Content) => State::Content,
            (_, Start::Reasoning) => State::Reasoning,
            (_, Start::Undecided) => State::Undecided,
        };
        Self {
            markers,
            tools,
            state,
            held: String::new(),
            body: String::new(),
            reasoning_tokens: 0,
            undecided_tokens: 0,
            bare_calls: false,
            answered: false,
            declared: None,
        }
    }

    /// The pieces `text`, made of `tokens` tokens, completes. Tokens count as
    /// reasoning when they arrive inside a reasoning block (its closing marker too).
    pub fn push(&mut self, text: &str, tokens: u32) -> Vec<Piece> {
        match self.state {
            State::Reasoning => self.reasoning_tokens += tokens,
            State::Undecided => self.undecided_tokens += tokens,
            State::Content | State::ToolCall | State::MaybeCalls => {}
        }
        self.held.push_str(text);
        let mut out = Vec::new();
        self.scan(&mut out, false);
        self.keep_declared(out)
    }

    /// The calls in `pieces` with only the arguments their functions declare.
    fn keep_declared(&self, mut pieces: Vec<Piece>) -> Vec<Piece> {
        if let Some(declared) = &self.declared {
            for p in &mut pieces {
                if let Piece::ToolCall { name, arguments } = p {
                    *arguments = declared.arguments(name, std::mem::take(arguments));
                }
            }
        }
        pieces
    }

    /// The rest, at the end of the output: held text is what it looked like, an
    /// unfinished tool call is content, an undecided start is content.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.scan(&mut out, true);
        if self.state == State::Undecided {
            // No closing marker came: the start was the answer, read as content (it
            // may hold tool calls).
            self.undecided_tokens = 0;
            self.held = std::mem::take(&mut self.body);
            self.state = State::Content;
            self.scan(&mut out, true);
        }
        if self.state == State::MaybeCalls {
            let body = std::mem::take(&mut self.body);
            match self.tools.and_then(|f| bare_calls(f, &body)) {
                Some(calls) => out.extend(calls),
                None => emit(&mut out, Piece::Content(body)),
            }
        }
        if self.state == State::Content && !self.body.is_empty() {
            // Whitespace held back at the start of an answer that never began.
            let body = std::mem::take(&mut self.body);
            emit(&mut out, Piece::Content(body));
        }
        if self.state == State::ToolCall {
            match self.tools {
                // Calls that run to the end of the output end here.
                Some(format) if format.close().is_none() => self.leave(&mut out),
                _ => {
                    let open = self.tools.map_or("", |t| t.open());
                    emit(&mut out, Piece::Content(format!("{open}{}", std::mem::take(&mut self.body))))
                }
            }
        }
        self.state = State::Content;
        self.keep_declared(out)
    }

    /// The output's chain-of-thought tokens so far (an undecided start counts once
    /// its closing marker has shown it was reasoning).
    pub fn reasoning_tokens(&self) -> u32 {
        self.reasoning_tokens
    }

    /// The markers the current state ends at, with the state each leads to.
    fn watched(&self) -> Vec<(&'static str, State)> {
        let mut m = Vec::new();
        match self.state {
            State::Content => {
                if let Some(open) = self.markers.open() {
                    m.push((open, State::Reasoning));
                }
                if let Some(t) = self.tools {
                    m.push((t.open(), State::ToolCall));
                }
            }
            State::Reasoning | State::Undecided => m.extend(self.markers.close().map(|c| (c, State::Content))),
            State::ToolCall => m.extend(self.tools.and_then(|t| t.close()).map(|c| (c, State::Content))),
            State::MaybeCalls => {}
        }
        m
    }

    fn scan(&mut self, out: &mut Vec<Piece>, last: bool) {
        loop {
            let watched = self.watched();
            let found = watched
                .iter()
                .filter_map(|&(marker, next)| self.held.find(marker).map(|at| (at, marker, next)))
                .min_by_key(|&(at, ..)| at);
            let Some((at, marker, next)) = found else {
                // Keep a tail that may still become a marker, unless nothing follows.
                let keep = if last {
                    0
                } else {
                    watched.iter().map(|(m, _)| partial_suffix(&self.held, m)).max().unwrap_or(0)
                };
                let text: String = self.held.drain(..self.held.len() - keep).collect();
                self.release(out, text);
                return;
            };
            let text = self.held[..at].to_string();
            self.held.drain(..at + marker.len());
            self.release(out, text);
            self.leave(out);
            if next == State::ToolCall {
                self.answer_begins(out);
            }
            self.state = next;
        }
    }

    /// Text that belongs to the current state.
    fn release(&mut self, out: &mut Vec<Piece>, text: String) {
        match self.state {
            State::Content if self.bare_calls && !self.answered => {
                // Until the answer begins, whitespace is held: a `{` first may open calls.
                self.body.push_str(&text);
                let start = self.body.trim_start();
                if start.starts_with('{') || start.starts_with(FENCE) {
                    self.answered = true;
                    self.state = State::MaybeCalls;
                } else if !FENCE.starts_with(start) {
                    self.answer_begins(out);
                }
            }
            State::Content => emit(out, Piece::Content(text)),
            State::Reasoning => emit(out, Piece::Reasoning(text)),
            State::Undecided | State::ToolCall | State::MaybeCalls => self.body.push_str(&text),
        }
    }

    /// The answer has begun otherwise than with a `{`: held whitespace goes out.
    fn answer_begins(&mut self, out: &mut Vec<Piece>) {
        if !self.answered && self.state == State::Content {
            self.answered = true;
            let body = std::mem::take(&mut self.body);
            emit(out, Piece::Content(body));
        }
        self.answered = true;
    }

    /// The current state's closing marker has been read.
    fn leave(&mut self, out: &mut Vec<Piece>) {
        let body = std::mem::take(&mut self.body);
        match self.state {
            State::Undecided => {
                self.reasoning_tokens += std::mem::take(&mut self.undecided_tokens);
                emit(out, Piece::Reasoning(body))
            }
            State::ToolCall => {
                let Some(format) = self.tools else { return };
                match format.calls(&body) {
                    Some(calls) => out.extend(calls),
                    None => {
                        emit(out, Piece::Content(format!("{}{body}{}", format.open(), format.close().unwrap_or(""))))
                    }
                }
            }
            State::Content | State::Reasoning | State::MaybeCalls => {}
        }
    }
}

/// How a JSON code block opens.
const FENCE: &str = "```json";

/// An answer made only of call objects (`{"name": …, "arguments": {…}}`, whitespace
/// between them; a list of them for Mistral's format), or None.
fn bare_calls(format: ToolFormat, body: &str) -> Option<Vec<Piece>> {
    // Or in a JSON code block, as Qwen2.5-Coder 1.5B writes them.
    let body = body.trim();
    let body = body.strip_prefix(FENCE).and_then(|b| b.strip_suffix("```")).unwrap_or(body);
    let values: Vec<Value> =
        serde_json::Deserializer::from_str(body).into_iter::<Value>().collect::<Result<_, _>>().ok()?;
    let mut calls = Vec::new();
    for v in &values {
        match (format, v) {
            (_, Value::Object(o)) if o.get("arguments").is_some_and(Value::is_object) => calls.push(call(v)?),
            (ToolFormat::Mistral, Value::Array(list)) => {
                calls.extend(list.iter().map(call).collect::<Option<Vec<_>>>()?)
            }
            _ => return None,
        }
    }
    (!calls.is_empty()).then_some(calls)
}

fn emit(out: &mut Vec<Piece>, piece: Piece) {
    if !matches!(&piece, Piece::Content(t) | Piece::Reasoning(t) if t.is_empty()) {
        out.push(piece);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reasoning, content and calls, each kind joined.
    type Joined = (String, String, Vec<(String, String)>);

    fn parse(chunks: &[&str], markers: Markers, start: Start, tools: Option<ToolFormat>) -> Joined {
        let mut p = OutputParser::new(markers, start, tools);
        let mut split = Split::default();
        for c in chunks {
            split.add(p.push(c, 1));
        }
        split.add(p.finish());
        (split.reasoning, split.content, split.calls)
    }

    fn call(name: &str, args: &str) -> (String, String) {
        (name.to_string(), args.to_string())
    }

    #[test]
    fn calls_keep_only_the_arguments_their_function_declares() {
        let weather = serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let reading = Reading {
            markers: Markers::Think,
            start: Start::Content,
            tools: Some(ToolFormat::Hermes),
            bare_calls: true,
            declared: Some(Arc::new(Declared::new([("get_weather", &weather)]))),
        };
        let mut p = reading.parser();
        let mut split = Split::default();
        let call_text = "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"properties\": {}}}</tool_call>";
        split.add(p.push(call_text, 1));
        split.add(p.push("<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\", \\\"unit\\\": 1}\"}</tool_call>", 1));
        split.add(p.finish());
        assert_eq!(
            split.calls,
            vec![call("get_weather", "{\"city\":\"Paris\"}"), call("get_weather", "{\"city\":\"Rome\"}")]
        );
    }

    #[test]
    fn bare_call_objects_are_calls_when_the_reading_allows_them() {
        let read = |chunks: &[&str], bare: bool| {
            let reading = Reading {
                markers: Markers::Plain,
                start: Start::Content,
                tools: Some(ToolFormat::Hermes),
                bare_calls: bare,
                declared: None,
            };
            let mut p = reading.parser();
            let mut split = Split::default();
            let mut streamed_before_end = String::new();
            for c in chunks {
                let pieces = p.push(c, 1);
                for piece in &pieces {
                    if let Piece::Content(t) = piece {
                        streamed_before_end.push_str(t);
                    }
                }
                split.add(pieces);
            }
            split.add(p.finish());
            (split.content, split.calls, streamed_before_end)
        };
        let one = ["\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Paris\"}}"];
        let (content, calls, _) = read(&one, true);
        assert_eq!((content.as_str(), calls), ("", vec![call("get_weather", "{\"city\":\"Paris\"}")]));
        let two = ["{\"name\": \"a\", \"arguments\": {}}\n{\"name\": \"b\", \"arguments\": {\"x\": 1}}"];
        assert_eq!(read(&two, true).1, vec![call("a", "{}"), call("b", "{\"x\":1}")]);
        // Off, or JSON that is not calls, or text first: content, as it came.
        assert_eq!(read(&one, false).0, one.concat());
        let fenced = ["``", "`json\n{\"name\": \"a\", \"arguments\": {}}\n```"];
        assert_eq!(read(&fenced, true).1, vec![call("a", "{}")], "in a JSON code block");
        let code = ["``", "`python\nprint(1)\n```"];
        assert_eq!(read(&code, true), (code.concat(), vec![], code.concat()), "other code streams as it comes");
        let data = ["{\"name\": \"Paris\", \"population\": 2}"];
        assert_eq!(read(&data, true), (data.concat(), vec![], String::new()));
        let (content, calls, streamed) = read(&["  Sure: ", "{\"name\": \"a\", \"arguments\": {}}"], true);
        assert_eq!((content.as_str(), calls.len()), ("  Sure: {\"name\": \"a\", \"arguments\": {}}", 0));
        assert_eq!(streamed, content, "an answer that begins with text streams as it comes");
    }

    struct Case {
        markers: Markers,
        start: Start,
        tools: Option<ToolFormat>,
        output: &'static str,
        want: (&'static str, &'static str, Vec<(String, String)>),
    }

    fn cases() -> Vec<Case> {
        use Markers::*;
        use Start as S;
        use ToolFormat::*;
        let c = |markers, start, tools, output, want| Case { markers, start, tools, output, want };
        vec![
            c(
                Plain,
                S::Content,
                None,
                "Hello <think>not markers</think>",
                ("", "Hello <think>not markers</think>", vec![]),
            ),
            c(Think, S::Content, None, "<think>a plan</think>The answer.", ("a plan", "The answer.", vec![])),
            c(Think, S::Reasoning, None, "a plan</think>The answer.", ("a plan", "The answer.", vec![])),
            c(Think, S::Reasoning, None, "still thinking <thi", ("still thinking <thi", "", vec![])),
            c(
                Think,
                S::Content,
                None,
                "No thought. 3 < 4 and </thin is text",
                ("", "No thought. 3 < 4 and </thin is text", vec![]),
            ),
            // Model B with thinking off: a bare closing marker ends leaked reasoning…
            c(Think, S::Undecided, None, "Let me see.</think>Paris.", ("Let me see.", "Paris.", vec![])),
            // …and without one, everything was content.
            c(Think, S::Undecided, None, "Paris is the capital.", ("", "Paris is the capital.", vec![])),
            // Model C: thought between channel markers.
            c(
                Channel,
                S::Content,
                None,
                "<|channel|>thought weigh it<|channel|>final: 42",
                (" weigh it", "final: 42", vec![]),
            ),
            c(Channel, S::Content, None, "plain <|channel|> text", ("", "plain <|channel|> text", vec![])),
            c(
                Think,
                S::Reasoning,
                Some(Hermes),
                "need weather</think><tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>",
                ("need weather", "", vec![call("get_weather", "{\"city\":\"Paris\"}")]),
            ),
            c(
                Plain,
                S::Content,
                Some(Hermes),
                "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\n<tool_call>{\"name\":\"b\",\"arguments\":\"{\\\"x\\\":1}\"}</tool_call>",
                ("", "\n", vec![call("a", "{}"), call("b", "{\"x\":1}")]),
            ),
            // Not a call: the text stays, markers and all.
            c(
                Plain,
                S::Content,
                Some(Hermes),
                "<tool_call>{oops}</tool_call> ok",
                ("", "<tool_call>{oops}</tool_call> ok", vec![]),
            ),
            c(
                Plain,
                S::Content,
                Some(Hermes),
                "cut off <tool_call>{\"name\":",
                ("", "cut off <tool_call>{\"name\":", vec![]),
            ),
            // Without tools in the request the markers are text.
            c(
                Plain,
                S::Content,
                None,
                "<tool_call>{\"name\":\"a\"}</tool_call>",
                ("", "<tool_call>{\"name\":\"a\"}</tool_call>", vec![]),
            ),
            c(Think, S::Content, None, "héllo <think>ünïcode ✓</think>fin ✓", ("ünïcode ✓", "héllo fin ✓", vec![])),
            // Model B thinking off calling a tool straight away: the held start holds calls.
            c(
                Think,
                S::Undecided,
                Some(Hermes),
                "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>",
                ("", "", vec![call("a", "{}")]),
            ),
            // Mistral's format: a list of calls that runs to the end.
            c(
                Think,
                S::Reasoning,
                Some(Mistral),
                "plan</think>[TOOL_CALLS][{\"name\":\"a\",\"arguments\":{\"x\":1}},{\"name\":\"b\",\"arguments\":{}}]",
                ("plan", "", vec![call("a", "{\"x\":1}"), call("b", "{}")]),
            ),
            c(
                Plain,
                S::Content,
                Some(Mistral),
                "Sure. [TOOL_CALLS] not json",
                ("", "Sure. [TOOL_CALLS] not json", vec![]),
            ),
            c(Plain, S::Content, Some(Mistral), "<tool_call>{}</tool_call>", ("", "<tool_call>{}</tool_call>", vec![])),
        ]
    }

    #[test]
    fn each_family_splits_its_output_as_the_table_says() {
        for (i, case) in cases().into_iter().enumerate() {
            let got = parse(&[case.output], case.markers, case.start, case.tools);
            let want = (case.want.0.to_string(), case.want.1.to_string(), case.want.2);
            assert_eq!(got, want, "case {i}: {:?}", case.output);
        }
    }

    #[test]
    fn every_chunking_of_an_output_splits_it_the_same_way() {
        for (i, case) in cases().into_iter().enumerate() {
            let whole = parse(&[case.output], case.markers, case.start, case.tools);
            let cuts: Vec<usize> = (1..case.output.len()).filter(|&c| case.output.is_char_boundary(c)).collect();
            let check = |chunks: Vec<&str>| {
                let got = parse(&chunks, case.markers, case.start, case.tools);
                assert_eq!(got, whole, "case {i} cut as {chunks:?}");
            };
            // Character by character, at every cut, and at every pair of cuts.
            check(case.output.char_indices().map(|(at, c)| &case.output[at..at + c.len_utf8()]).collect());
            for (n, &a) in cuts.iter().enumerate() {
                check(vec![&case.output[..a], &case.output[a..]]);
                for &b in &cuts[n + 1..] {
                    check(vec![&case.output[..a], &case.output[a..b], &case.output[b..]]);
                }
            }
        }
    }

    #[test]
    fn content_streams_as_soon_as_no_marker_can_begin_in_it() {
        let mut p = OutputParser::new(Markers::Think, Start::Content, Some(ToolFormat::Hermes));
        assert_eq!(p.push("Hello", 1), [Piece::Content("Hello".into())]);
        // "<t" may begin <think> or <tool_call>: held until decided.
        assert_eq!(p.push(" <t", 1), [Piece::Content(" ".into())]);
        assert_eq!(p.push("o the world", 1), [Piece::Content("<to the world".into())]);
        let mut u = OutputParser::new(Markers::Think, Start::Undecided, None);
        assert!(u.push("maybe a thought", 3).is_empty(), "an undecided start is held");
        assert_eq!(u.finish(), [Piece::Content("maybe a thought".into())]);
        assert_eq!(u.reasoning_tokens(), 0, "it was content after all");
    }

    #[test]
    fn reasoning_tokens_are_those_inside_the_reasoning_block() {
        let mut p = OutputParser::new(Markers::Think, Start::Reasoning, None);
        for (text, tokens) in [("a", 1), (" plan", 1), ("</think>", 3), ("Answer", 1), (".", 1)] {
            p.push(text, tokens);
        }
        p.finish();
        assert_eq!(p.reasoning_tokens(), 5);
        let mut u = OutputParser::new(Markers::Think, Start::Undecided, None);
        for (text, tokens) in [("leak", 2), ("</think>", 3), ("Paris", 1)] {
            u.push(text, tokens);
        }
        assert_eq!(u.reasoning_tokens(), 5, "a bare closing marker makes the start reasoning");
    }
}
