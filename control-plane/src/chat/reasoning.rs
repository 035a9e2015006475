//! Where a model's output begins — inside a reasoning block, with thinking off, or
//! free to open one — from what the family's template made of the request's thinking
//! toggles (docs/api.md, Reasoning), and so how the output is read back.

use super::output::{Markers, Start};
use tessera_proto::chat_template::Rendered;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Thinking {
    /// The prompt opened the reasoning block: the output begins inside it.
    Open,
    /// Thinking is off.
    Off,
    /// The model decides whether to open a reasoning block.
    Optional,
}

impl Thinking {
    /// What the template said (`reasoning_start`), or for a template that says nothing,
    /// what the end of the prompt shows: an open marker, a closed block, or neither.
    pub fn of(rendered: &Rendered, markers: Markers) -> Self {
        let (Some(open), Some(close)) = (markers.open(), markers.close()) else { return Thinking::Off };
        match rendered.reasoning_start.as_deref() {
            Some("open") => Thinking::Open,
            Some("off") => Thinking::Off,
            Some("optional") => Thinking::Optional,
            _ => {
                let tail = rendered.text.trim_end();
                if tail.ends_with(open) {
                    Thinking::Open
                } else if tail.ends_with(close) {
                    Thinking::Off
                } else {
                    Thinking::Optional
                }
            }
        }
    }

    /// The parser's start. With thinking off, a model that may think anyway
    /// (`bare_close`) is held undecided — unless a grammar decides its first token.
    pub fn start(self, bare_close: bool, constrained: bool) -> Start {
        match self {
            Thinking::Open => Start::Reasoning,
            Thinking::Off if bare_close && !constrained => Start::Undecided,
            Thinking::Off | Thinking::Optional => Start::Content,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendered(text: &str, start: Option<&str>) -> Rendered {
        Rendered { text: text.into(), reasoning_start: start.map(String::from) }
    }

    #[test]
    fn the_template_decides_and_the_prompt_decides_when_it_does_not() {
        assert_eq!(Thinking::of(&rendered("x", Some("open")), Markers::Think), Thinking::Open);
        assert_eq!(Thinking::of(&rendered("x", Some("off")), Markers::Think), Thinking::Off);
        assert_eq!(Thinking::of(&rendered("x", Some("optional")), Markers::Channel), Thinking::Optional);
        assert_eq!(Thinking::of(&rendered("assistant\n<think>\n", None), Markers::Think), Thinking::Open);
        assert_eq!(Thinking::of(&rendered("<think>\n\n</think>\n\n", None), Markers::Think), Thinking::Off);
        assert_eq!(Thinking::of(&rendered("assistant\n", None), Markers::Think), Thinking::Optional);
        assert_eq!(
            Thinking::of(&rendered("x", Some("open")), Markers::Plain),
            Thinking::Off,
            "no markers, no reasoning"
        );
    }

    #[test]
    fn a_model_that_leaks_reasoning_is_held_undecided_unless_a_grammar_leads() {
        assert_eq!(Thinking::Off.start(true, false), Start::Undecided);
        assert_eq!(Thinking::Off.start(true, true), Start::Content);
        assert_eq!(Thinking::Off.start(false, false), Start::Content);
        assert_eq!(Thinking::Open.start(true, true), Start::Reasoning);
        assert_eq!(Thinking::Optional.start(true, false), Start::Content);
    }
}
