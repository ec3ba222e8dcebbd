"""Splitting streamed model output into reasoning, text and tool calls (plain functions and small
incremental state machines; markers may be cut anywhere between deltas)."""
from gateway_svc.parsing.events import Content, OutputParser, Reasoning
from gateway_svc.parsing.tool_calls import ToolCall, ToolCallSplitter, parse_tool_call
from gateway_svc.parsing.reasoning import ReasoningSplitter

__all__ = ["Content", "OutputParser", "Reasoning", "ReasoningSplitter", "ToolCall", "ToolCallSplitter", "parse_tool_call"]
