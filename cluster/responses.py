"""OpenAI response shapes: streamed SSE chunks and whole responses, built from replica outputs.

The replica streams plain dicts (``cluster.replica.output_to_dict``): per step, each choice's
``new_text``, ``new_token_ids``, new ``logprobs`` as ``[token_id, logprob, [[id, lp], ...]]``
and, once, its ``finish_reason``/``text``. ``ResponseBuilder`` turns those into
``chat.completion(.chunk)`` or ``text_completion`` objects; it owns the per-choice state
(text so far, token counts, logprobs) and the usage, whose
``prompt_tokens_details.cached_tokens`` is always filled. Choices of a batched completions
request are numbered ``prompt_index * n + output_index``. With a ``ToolPlan`` each chat
choice's text goes through its own tool-call parser (``cluster/tool_parsers.py``): streamed as
``content`` and ``tool_calls`` deltas, whole as ``message.tool_calls`` (``content`` null when
there are only calls), and a choice that ended by itself with calls has finish_reason
``tool_calls``. Nothing here raises on well-formed replica output; a choice that ends in an
engine error is reported by the caller.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.tool_calls import ToolPlan
from cluster.tool_parsers import ToolCallStream

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


@dataclass
class ChoiceState:
    index: int
    text_parts: list[str] = field(default_factory=list)
    final_text: str | None = None
    num_tokens: int = 0
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    role_sent: bool = False
    num_chars: int = 0
    tool_stream: ToolCallStream | None = None
    """Parses this choice's text into tool calls (requests with tools only)."""

    @property
    def text(self) -> str:
        return self.final_text if self.final_text is not None else "".join(self.text_parts)


class ResponseBuilder:
    """Accumulates replica outputs of one API request and renders OpenAI objects."""

    def __init__(
        self,
        *,
        chat: bool,
        request_id: str,
        model: str,
        n: int,
        num_prompts: int,
        want_logprobs: bool,
        token_to_str: Callable[[int], str],
        include_usage: bool = False,
        continuous_usage: bool = False,
        tool_plan: ToolPlan | None = None,
    ) -> None:
        self.chat = chat
        self.tool_plan = tool_plan
        self.request_id = request_id
        self.model = model
        self.n = n
        self.created = int(time.time())
        self.want_logprobs = want_logprobs
        self.token_to_str = token_to_str
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.choices = [ChoiceState(i) for i in range(n * num_prompts)]
        if tool_plan is not None:
            for choice in self.choices:
                choice.tool_stream = tool_plan.new_stream()
        self.num_prompt_tokens = [0] * num_prompts
        self.num_cached_tokens = [0] * num_prompts

    # ---- accumulation -------------------------------------------------------------------
    def add(self, prompt_index: int, out: dict) -> list[tuple[ChoiceState, str, list]]:
        """Records one replica output; returns (choice, new text, new logprobs) per change."""
        self.num_prompt_tokens[prompt_index] = out["num_prompt_tokens"]
        self.num_cached_tokens[prompt_index] = out["num_cached_tokens"]
        changes = []
        for completion in out["outputs"]:
            state = self.choices[prompt_index * self.n + completion["index"]]
            if state.finish_reason is not None:
                continue
            new_text = completion["new_text"]
            new_logprobs = completion.get("logprobs") or []
            state.text_parts.append(new_text)
            state.num_tokens += len(completion["new_token_ids"])
            state.logprobs.extend(new_logprobs)
            if completion["finish_reason"] is not None:
                state.finish_reason = completion["finish_reason"]
                state.stop_reason = completion.get("stop_reason")
                state.final_text = completion.get("text")
            if new_text or completion["new_token_ids"] or state.finish_reason is not None:
                changes.append((state, new_text, new_logprobs))
        return changes

    def usage(self) -> dict:
        return usage_dict(
            sum(self.num_prompt_tokens),
            sum(choice.num_tokens for choice in self.choices),
            sum(self.num_cached_tokens),
        )

    # ---- logprobs -----------------------------------------------------------------------
    def _token_entry(self, token_id: int, logprob: float) -> dict:
        token = self.token_to_str(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def chat_logprobs(self, entries: list) -> dict | None:
        if not self.want_logprobs:
            return None
        content = []
        for token_id, logprob, top in entries:
            entry = self._token_entry(token_id, logprob)
            entry["top_logprobs"] = [self._token_entry(tid, lp) for tid, lp in top]
            content.append(entry)
        return {"content": content}

    def completion_logprobs(self, entries: list, start_offset: int) -> dict | None:
        if not self.want_logprobs:
            return None
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = start_offset
        for token_id, logprob, top in entries:
            token = self.token_to_str(token_id)
            tokens.append(token)
            token_logprobs.append(logprob)
            top_logprobs.append({self.token_to_str(tid): lp for tid, lp in top} or None)
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    # ---- streaming ----------------------------------------------------------------------
    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.continuous_usage:
            chunk["usage"] = self.usage()
        elif self.include_usage:
            chunk["usage"] = None
        return chunk

    def stream_events(self, prompt_index: int, out: dict) -> list[str]:
        """SSE events for one replica output."""
        events = []
        for state, new_text, new_logprobs in self.add(prompt_index, out):
            if self.chat:
                if not state.role_sent:
                    state.role_sent = True
                    role = {
                        "index": state.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    events.append(sse_event(self._chunk([role])))
                choice = {
                    "index": state.index,
                    "delta": self._chat_delta(state, new_text),
                    "logprobs": self.chat_logprobs(new_logprobs),
                    "finish_reason": self._chat_finish_reason(state, state.tool_stream),
                }
            else:
                choice = {
                    "index": state.index,
                    "text": new_text,
                    "logprobs": self.completion_logprobs(new_logprobs, state.num_chars),
                    "finish_reason": state.finish_reason,
                }
            if state.finish_reason is not None:
                choice["stop_reason"] = state.stop_reason
            state.num_chars += len(new_text)
            events.append(sse_event(self._chunk([choice])))
        return events

    @staticmethod
    def _chat_delta(state: ChoiceState, new_text: str) -> dict:
        stream = state.tool_stream
        if stream is None:
            return {"content": new_text} if new_text else {}
        content, calls = stream.feed(new_text)
        if state.finish_reason is not None:
            more_content, more_calls = stream.finish()
            content, calls = content + more_content, calls + more_calls
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [call.to_dict() for call in calls]
        return delta

    @staticmethod
    def _chat_finish_reason(state: ChoiceState, stream: ToolCallStream | None) -> str | None:
        """``tool_calls`` when a choice that ended on its own made calls (OpenAI's reason)."""
        if state.finish_reason == "stop" and stream is not None and stream.calls:
            return "tool_calls"
        return state.finish_reason

    def _chat_message(self, state: ChoiceState) -> tuple[dict, ToolCallStream | None]:
        if self.tool_plan is None:
            return {"role": "assistant", "content": state.text}, None
        stream = self.tool_plan.new_stream()
        content, calls = stream.parse(state.text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_dict() for call in calls]
        return message, stream

    def closing_events(self) -> list[str]:
        """The usage chunk (when asked for) and ``[DONE]``."""
        events = []
        if self.include_usage:
            chunk = self._chunk([])
            chunk["usage"] = self.usage()
            events.append(sse_event(chunk))
        events.append(SSE_DONE)
        return events

    # ---- whole response -----------------------------------------------------------------
    def full_response(self) -> dict:
        choices = []
        for state in self.choices:
            if self.chat:
                message, stream = self._chat_message(state)
                choice = {
                    "index": state.index,
                    "message": message,
                    "logprobs": self.chat_logprobs(state.logprobs),
                    "finish_reason": self._chat_finish_reason(state, stream),
                }
            else:
                choice = {
                    "index": state.index,
                    "text": state.text,
                    "logprobs": self.completion_logprobs(state.logprobs, 0),
                    "finish_reason": state.finish_reason,
                }
            choice["stop_reason"] = state.stop_reason
            choices.append(choice)
        return {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
