//! What a chat asks of its answer's shape, read at validation: the tool-call and reasoning
//! formats of the pool (`baseModel.toolCallParser`, `baseModel.reasoningParser`, else detected
//! from the chat template), the tools and their history handed to the template, the grammar
//! of structured outputs or of a forced tool call (starting after the reasoning), and how the
//! answer is split ([`super::parse`]).

use serde_json::{Map, Value};

use mole_api::{ReasoningParser, ToolCallParser};

use super::parse::{ParseSpec, Start};
use super::tools::{self, ToolRequest};
use crate::{ApiError, AppState};
use mole_engine::api::{ChatMessage, SamplingParams};
use mole_engine::grammar::{Guide, Guided};

/// The pool's output formats.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Formats {
    /// How tool calls are written (None: unknown; tools are refused).
    pub(crate) tools: Option<ToolCallParser>,
    /// How reasoning is marked (None: no reasoning parsed).
    pub(super) reasoning: Option<ReasoningParser>,
    /// The chat template renders `tools` itself.
    pub(super) template_tools: bool,
}

impl Formats {
    /// The pool's settings, else what `template` names: `<tool_call>` (Hermes: Qwen2.5,
    /// Qwen3, QwQ) and `</think>` (Qwen3; a template that opens `<think>` in its generation
    /// prompt is DeepSeek-R1's and QwQ's shape).
    pub(super) fn of(
        tools: Option<ToolCallParser>,
        reasoning: Option<ReasoningParser>,
        template: Option<&str>,
    ) -> Self {
        let t = template.unwrap_or("");
        let detected_reasoning = match (t.contains("</think>"), t.contains("'<think>\\n'")) {
            (false, _) => None,
            (true, false) => Some(ReasoningParser::Qwen3),
            (true, true) => Some(ReasoningParser::DeepseekR1),
        };
        Self {
            tools: tools.or(t.contains("<tool_call>").then_some(ToolCallParser::Hermes)),
            reasoning: reasoning.or(detected_reasoning),
            template_tools: t.contains("tools"),
        }
    }

    /// The formats of the pool `s` serves.
    pub(crate) fn for_pool(s: &AppState) -> Self {
        let cfg = s.cfg();
        Self::of(
            cfg.base_model.tool_call_parser,
            cfg.base_model.reasoning_parser,
            s.codec.chat_template().as_deref(),
        )
    }
}

/// A chat's tools, read and handed to the template: as its `tools` variable when it renders
/// them, else as Qwen's tools section at the start of the system prompt.
pub(super) fn tools(
    t: tools::ToolFields,
    f: &Formats,
    msgs: &mut Vec<ChatMessage>,
    kwargs: &mut Map<String, Value>,
) -> Result<Option<ToolRequest>, ApiError> {
    let Some(t) = tools::read(t, f.tools)? else {
        return Ok(None);
    };
    if f.template_tools {
        kwargs.insert("tools".into(), Value::Array(t.tools.clone()));
    } else {
        let section = tools::system_section(&t.tools);
        match msgs.first_mut().filter(|m| m.role == "system") {
            Some(sys) => {
                sys.content = format!("{}\n\n{section}", sys.content);
            }
            None => msgs.insert(0, ChatMessage::text("system", section)),
        }
    }
    Ok(Some(t))
}

/// The answer's grammar and split, once the prompt is rendered: a forced tool call, or
/// structured outputs (`guide`), starting after the reasoning when the model reasons. As
/// OpenAI's: a forced call shapes the answer (a format applies to an answer's text, and there
/// is none); with `auto` tools and a JSON format the answer is either calls or the JSON (one
/// grammar of both); another format with `auto` tools leaves no room for a call.
pub(super) fn finish(
    prompt: &str,
    f: &Formats,
    guide: Option<Guide>,
    tools: Option<&ToolRequest>,
    sampling: &mut SamplingParams,
) -> Result<Option<ParseSpec>, ApiError> {
    let forced = tools.and_then(|t| t.forced.clone());
    let calls = tools.and_then(|t| t.calls.as_deref());
    let shape = match (forced, guide, calls) {
        (Some(call), _, _) => Some(call),
        (None, Some(Guide::Json { schema, strict }), Some(rules)) => Some(Guide::Lark(format!(
            "start: calls | WS calls | json | WS json\n{rules}json: %json {}\n",
            mole_engine::grammar::compact(&schema, strict)
        ))),
        (None, g, _) => g,
    };
    let start = f.reasoning.map(|r| Start::after(prompt, r));
    if let Some(g) = shape {
        sampling.guide = Some(Guided {
            guide: g,
            after: match start {
                Some(Start::Reasoning | Start::Sniff) => Some("</think>".into()),
                _ => None,
            },
        });
    }
    let tools = tools.is_some_and(|t| t.parse);
    Ok((start.is_some() || tools).then_some(ParseSpec {
        reasoning: start,
        tools,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_come_from_the_pool_or_the_template() {
        let qwen3 = "{%- if tools %}<tool_call>{%- endif %}{{ '</think>' }}";
        let f = Formats::of(None, None, Some(qwen3));
        assert_eq!(f.tools, Some(ToolCallParser::Hermes));
        assert_eq!(f.reasoning, Some(ReasoningParser::Qwen3));
        assert!(f.template_tools);
        let f = Formats::of(None, None, Some("{{ messages }}"));
        assert_eq!(
            (f.tools, f.reasoning, f.template_tools),
            (None, None, false)
        );
        let f = Formats::of(
            Some(ToolCallParser::Hermes),
            Some(ReasoningParser::DeepseekR1),
            Some("{{ messages }}"),
        );
        assert_eq!(f.tools, Some(ToolCallParser::Hermes));
        assert_eq!(f.reasoning, Some(ReasoningParser::DeepseekR1));
    }
}
