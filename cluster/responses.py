"""OpenAI response shapes: streamed SSE chunks and whole responses, built from replica outputs.

The replica streams the engine's ``OutputDelta``s (``worker/outputs.py``): per step, each
advanced choice's ``new_text``, ``new_token_ids``, ``new_logprobs`` (``TokenLogprob``s) and,
once, its ``finish_reason``/``text``. ``ResponseBuilder`` is where they accumulate, once, and
turns them into
``chat.completion(.chunk)`` or ``text_completion`` objects; it owns the per-choice state
(text so far, token counts, logprobs) and the usage, whose
``prompt_tokens_details.cached_tokens`` is always filled. Choices of a batched completions
request are numbered ``prompt_index * n + output_index``. With a ``ToolPlan`` each chat
choice's text goes through its own tool-call parser (``cluster/tool_parsers.py``): streamed as
``content`` and ``tool_calls`` deltas, whole as ``message.tool_calls`` (``content`` null when
there are only calls), and a choice that ended by itself with calls has finish_reason
``tool_calls``. Nothing here raises on well-formed replica output; a choice that ends in an
engine error is reported by the caller.

Prompt logprobs come once per prompt, in the output that carries choice 0's first tokens, as
``prompt_logprobs``: ``[None, TokenLogprob (with its rank), ...]``. With
``echo`` (legacy completions) each choice's text, and its logprobs when asked for, start with
the prompt's: the first prompt token's logprob and top_logprobs are null, each other prompt
token's top_logprobs holds the token itself beside the top ``logprobs`` (OpenAI's shape, what
lm-eval-harness reads). vLLM's ``prompt_logprobs`` field (per completions choice, top level for
chat) maps token id -> ``{logprob, rank, decoded_token}``.

Streamed chunks are encoded with orjson (``compact_json``), once per streamed token, in a
tenth of the standard library's time: the same compact JSON, but a float in exponent form is
spelled without Python's leading zero (``2.5e-7``) and a float JSON cannot carry (NaN, an
infinity) is written as null, where the standard library wrote text no JSON parser reads. A
token that carries only its text is joined from parts of its chunk rendered once per request
(``_plain_event``), in a third of the time again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from cluster.tool_calls import ToolPlan
from cluster.tool_parsers import ToolCallStream
from worker.outputs import OutputDelta

SSE_DONE = "data: [DONE]\n\n"


def compact_json(payload) -> str:
    """``payload`` as compact JSON text, non-ASCII characters as they are; integer keys (vLLM's
    ``prompt_logprobs``) become strings, as the standard library writes them."""
    return orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS).decode()


def sse_event(payload: dict) -> str:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return f"data: {compact_json(payload)}\n\n"


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def _text_logprobs(
    tokens: list[str], token_logprobs: list, top_logprobs: list, start_offset: int
) -> dict:
    """Legacy completions' logprobs object: the per-token lists and each token's
    ``text_offset``, counted in characters from ``start_offset``."""
    offsets = []
    offset = start_offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
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
    echo_sent: bool = False

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
        echo_prompts: list[tuple[str, list[int]]] | None = None,
        num_top_logprobs: int = 0,
        want_prompt_logprobs: bool = False,
    ) -> None:
        """``echo_prompts``: (text, token ids) per prompt, to lead each choice (completions'
        ``echo``); ``num_top_logprobs``: the request's ``logprobs``, for the echoed prompt's
        top_logprobs; ``want_prompt_logprobs``: add vLLM's ``prompt_logprobs`` field."""
        self.chat = chat
        self.echo_prompts = echo_prompts
        self.num_top_logprobs = num_top_logprobs
        self.want_prompt_logprobs = want_prompt_logprobs
        self.prompt_logprobs: list[list | None] = [None] * num_prompts
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
        self.failed = False
        """The replicas' stream ended in an error before the response completed (the ingress
        sets it while relaying; the closing events are then not sent)."""
        plain = not (want_logprobs or echo_prompts or want_prompt_logprobs or continuous_usage)
        self._plain_parts = self._plain_event_parts() if plain and tool_plan is None else None

    # A streamed token whose event carries nothing but its text (no logprobs, echo, prompt
    # logprobs, running usage or tool-call parsing, not the choice's first chat event nor its
    # last) has the same JSON around the text as every other such token of the request: it is
    # rendered once, from the chunk ``stream_events`` builds, with stand-ins for the choice's
    # index and text, and each token's event is then those parts joined around the two.
    _INDEX_STAND_IN = 987654321012345
    _TEXT_STAND_IN = "\u2063index-and-text-go-here\u2063"

    def _plain_event_parts(self) -> tuple[str, str, str]:
        """(the event up to the choice's index, from it to its text, after the text)."""
        index, text = self._INDEX_STAND_IN, self._TEXT_STAND_IN
        if self.chat:
            choice = {"index": index, "delta": {"content": text}}
        else:
            choice = {"index": index, "text": text}
        choice |= {"logprobs": None, "finish_reason": None}
        event = sse_event(self._chunk([choice]))
        head, rest = event.rsplit(str(index), 1)  # the last: after the id and the model
        middle, tail = rest.split(compact_json(text), 1)
        return head, middle, tail

    def _plain_event(self, state: ChoiceState, new_text: str) -> str | None:
        """``state``'s event for ``new_text`` from the parts made once, or None when it needs
        more than its text (the general path then builds it)."""
        parts = self._plain_parts
        if parts is None or not new_text or state.finish_reason is not None:
            return None
        if self.chat and not state.role_sent:
            return None
        head, middle, tail = parts
        return f"{head}{state.index}{middle}{compact_json(new_text)}{tail}"

    # ---- accumulation -------------------------------------------------------------------
    def add(self, prompt_index: int, out: OutputDelta) -> list[tuple[ChoiceState, str, list]]:
        """Records one replica output; returns (choice, new text, new logprobs) per change."""
        self.num_prompt_tokens[prompt_index] = out.num_prompt_tokens
        self.num_cached_tokens[prompt_index] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs
        changes = []
        for completion in out.choices:
            state = self.choices[prompt_index * self.n + completion.index]
            if state.finish_reason is not None:
                continue
            new_text = completion.new_text
            new_logprobs = completion.new_logprobs or []
            state.text_parts.append(new_text)
            state.num_tokens += len(completion.new_token_ids)
            state.logprobs.extend(new_logprobs)
            if completion.finish_reason is not None:
                state.finish_reason = completion.finish_reason.value
                state.stop_reason = completion.stop_reason
                state.final_text = completion.text
            if new_text or completion.new_token_ids or state.finish_reason is not None:
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
        for sampled in entries:
            entry = self._token_entry(sampled.token_id, sampled.logprob)
            entry["top_logprobs"] = [self._token_entry(tid, lp) for tid, lp in sampled.top]
            content.append(entry)
        return {"content": content}

    def completion_logprobs(self, entries: list, start_offset: int) -> dict | None:
        if not self.want_logprobs:
            return None
        tokens, token_logprobs, top_logprobs = [], [], []
        for sampled in entries:
            token = self.token_to_str(sampled.token_id)
            alternatives = {self.token_to_str(tid): lp for tid, lp in sampled.top}
            # the sampled token too, as OpenAI and vLLM
            alternatives.setdefault(token, sampled.logprob)
            tokens.append(token)
            token_logprobs.append(sampled.logprob)
            top_logprobs.append(alternatives)
        return _text_logprobs(tokens, token_logprobs, top_logprobs, start_offset)

    def _echo_logprobs(self, prompt_index: int) -> dict:
        """The echoed prompt's part of a completion's logprobs (offsets from 0)."""
        _, prompt_ids = self.echo_prompts[prompt_index]
        entries = self.prompt_logprobs[prompt_index] or []
        tokens, token_logprobs, top_logprobs = [], [], []
        for position, token_id in enumerate(prompt_ids):
            token = self.token_to_str(token_id)
            entry = entries[position] if position < len(entries) else None
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                alternatives = {
                    self.token_to_str(tid): lp for tid, lp in entry.top[: self.num_top_logprobs]
                }
                alternatives.setdefault(token, entry.logprob)
                token_logprobs.append(entry.logprob)
                top_logprobs.append(alternatives)
            tokens.append(token)
        return _text_logprobs(tokens, token_logprobs, top_logprobs, 0)

    def _echoed(
        self, state: ChoiceState, text: str, entries: list, start_offset: int
    ) -> tuple[str, dict | None]:
        """A completion choice's text and logprobs, led by its prompt once when echoing."""
        if self.echo_prompts is None or state.echo_sent:
            return text, self.completion_logprobs(entries, start_offset)
        state.echo_sent = True
        prompt_index = state.index // self.n
        prompt_text = self.echo_prompts[prompt_index][0]
        logprobs = self.completion_logprobs(entries, start_offset + len(prompt_text))
        if logprobs is not None:
            lead = self._echo_logprobs(prompt_index)
            logprobs = {key: lead[key] + logprobs[key] for key in lead}
        return prompt_text + text, logprobs

    def vllm_prompt_logprobs(self, prompt_index: int) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token None or
        {id: {logprob, rank, decoded_token}}."""
        entries = self.prompt_logprobs[prompt_index]
        if entries is None:
            return None
        rendered = []
        for entry in entries:
            if entry is None:
                rendered.append(None)
                continue
            ranked = {
                str(tid): {"logprob": lp, "rank": i + 1, "decoded_token": self.token_to_str(tid)}
                for i, (tid, lp) in enumerate(entry.top)
            }
            ranked[str(entry.token_id)] = {
                "logprob": entry.logprob,
                "rank": entry.rank,
                "decoded_token": self.token_to_str(entry.token_id),
            }
            rendered.append(ranked)
        return rendered

    # ---- streaming ----------------------------------------------------------------------
    def _envelope(self, chat_object: str, choices: list[dict]) -> dict:
        """The fields every response and chunk starts with; ``chat_object`` names a chat one."""
        return {
            "id": self.request_id,
            "object": chat_object if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = self._envelope("chat.completion.chunk", choices)
        if self.continuous_usage:
            chunk["usage"] = self.usage()
        elif self.include_usage:
            chunk["usage"] = None
        return chunk

    def stream_events(self, prompt_index: int, out: dict) -> list[str]:
        """SSE events for one replica output."""
        events = []
        for state, new_text, new_logprobs in self.add(prompt_index, out):
            plain = self._plain_event(state, new_text)
            if plain is not None:
                state.num_chars += len(new_text)
                events.append(plain)
                continue
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
                    "delta": self.chat_delta(state, new_text),
                    "logprobs": self.chat_logprobs(new_logprobs),
                    "finish_reason": self.chat_finish_reason(state, state.tool_stream),
                }
            else:
                first = not state.echo_sent
                new_text, logprobs = self._echoed(state, new_text, new_logprobs, state.num_chars)
                choice = {
                    "index": state.index,
                    "text": new_text,
                    "logprobs": logprobs,
                    "finish_reason": state.finish_reason,
                }
                if self.want_prompt_logprobs and first:
                    choice["prompt_logprobs"] = self.vllm_prompt_logprobs(state.index // self.n)
            if state.finish_reason is not None:
                choice["stop_reason"] = state.stop_reason
            state.num_chars += len(new_text)
            events.append(sse_event(self._chunk([choice])))
        return events

    @staticmethod
    def chat_delta(state: ChoiceState, new_text: str) -> dict:
        """One chat choice's delta for ``new_text``: content, and tool-call pieces when the
        choice parses calls (the Responses API's stream reads the same)."""
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
    def chat_finish_reason(state: ChoiceState, stream: ToolCallStream | None) -> str | None:
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
                    "finish_reason": self.chat_finish_reason(state, stream),
                }
            else:
                state.echo_sent = False
                text, logprobs = self._echoed(state, state.text, state.logprobs, 0)
                choice = {
                    "index": state.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": state.finish_reason,
                }
                if self.want_prompt_logprobs:
                    choice["prompt_logprobs"] = self.vllm_prompt_logprobs(state.index // self.n)
            choice["stop_reason"] = state.stop_reason
            choices.append(choice)
        response = self._envelope("chat.completion", choices)
        response["usage"] = self.usage()
        if self.chat and self.want_prompt_logprobs:
            response["prompt_logprobs"] = self.vllm_prompt_logprobs(0)
        return response
