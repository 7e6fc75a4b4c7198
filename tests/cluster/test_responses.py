"""Response shapes built from replica outputs: SSE framing, usage, logprobs, n > 1."""

from __future__ import annotations

import json

from cluster.responses import SSE_DONE, ResponseBuilder, sse_event
from tests.cluster.helpers import delta
from worker.outputs import TokenLogprob


def token_to_str(token_id: int) -> str:
    return f"<{token_id}>"


def output(index, new_text, new_ids, finish=None, text=None, logprobs=None, cached=0):
    return delta(index, new_text, new_ids, finish, text, logprobs, cached)


def builder(**kw) -> ResponseBuilder:
    defaults = dict(
        chat=True,
        request_id="chatcmpl-1",
        model="m",
        n=1,
        num_prompts=1,
        want_logprobs=False,
        token_to_str=token_to_str,
    )
    return ResponseBuilder(**{**defaults, **kw})


def decode(events: list[str]) -> list:
    payloads = []
    for event in events:
        assert event.startswith("data: ") and event.endswith("\n\n")
        body = event[len("data: ") : -2]
        payloads.append(body if body == "[DONE]" else json.loads(body))
    return payloads


def test_chat_stream_sends_role_then_deltas_then_usage_and_done():
    b = builder(include_usage=True)
    events = b.stream_events(0, output(0, "Hel", [1], cached=3))
    events += b.stream_events(0, output(0, "lo", [2], finish="stop", text="Hello", cached=3))
    events += b.closing_events()
    chunks = decode(events)
    assert chunks[-1] == "[DONE]" and events[-1] == SSE_DONE
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:3]) == "Hello"
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in chunks[:3])
    usage = chunks[3]["usage"]
    assert chunks[3]["choices"] == []
    assert usage == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_full_response_with_n_2_counts_every_choice_and_ignores_repeats():
    b = builder(n=2)
    b.add(0, output(0, "a", [1]))
    b.add(0, output(1, "b", [2], finish="length", text="b"))
    b.add(0, output(1, "zzz", [3], finish="length", text="zzz"))  # already finished: ignored
    b.add(0, output(0, "c", [4], finish="stop", text="ac"))
    response = b.full_response()
    assert [c["message"]["content"] for c in response["choices"]] == ["ac", "b"]
    assert [c["finish_reason"] for c in response["choices"]] == ["stop", "length"]
    assert response["usage"]["completion_tokens"] == 3
    assert response["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_logprobs_shapes_for_chat_and_completions():
    entries = [TokenLogprob(7, -0.5, [(7, -0.5), (8, -1.5)])]
    chat = builder(want_logprobs=True)
    chat.add(0, output(0, "x", [7], finish="stop", text="x", logprobs=entries))
    content = chat.full_response()["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "<7>" and content[0]["logprob"] == -0.5
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["<7>", "<8>"]
    assert content[0]["bytes"] == list(b"<7>")
    completion = builder(chat=False, want_logprobs=True, request_id="cmpl-1")
    completion.add(0, output(0, "x", [7], finish="stop", text="x", logprobs=entries))
    choice = completion.full_response()["choices"][0]
    assert choice["text"] == "x"
    assert choice["logprobs"]["tokens"] == ["<7>"]
    assert choice["logprobs"]["top_logprobs"] == [{"<7>": -0.5, "<8>": -1.5}]
    assert choice["logprobs"]["text_offset"] == [0]


def test_completion_top_logprobs_hold_the_sampled_token_too():
    """A sampled token outside the top ``logprobs`` still appears in its position's
    top_logprobs (up to logprobs + 1 entries), as OpenAI's and vLLM's legacy completions."""
    entries = [
        TokenLogprob(9, -4.0, [(7, -0.5), (8, -1.5)]),
        TokenLogprob(7, -0.5, [(7, -0.5), (8, -1.5)]),
    ]
    completion = builder(chat=False, want_logprobs=True, request_id="cmpl-1")
    completion.add(0, output(0, "xy", [9, 7], finish="stop", text="xy", logprobs=entries))
    top = completion.full_response()["choices"][0]["logprobs"]["top_logprobs"]
    assert top == [{"<7>": -0.5, "<8>": -1.5, "<9>": -4.0}, {"<7>": -0.5, "<8>": -1.5}]


def test_batched_completion_choices_are_numbered_by_prompt():
    b = builder(chat=False, n=2, num_prompts=2)
    b.add(1, output(1, "q", [5], finish="stop", text="q"))
    choices = b.full_response()["choices"]
    assert len(choices) == 4
    assert choices[3]["text"] == "q" and choices[3]["index"] == 3
    assert b.full_response()["usage"]["prompt_tokens"] == 5


def test_replica_rejections_map_to_statuses():
    from cluster.stream_items import Rejected, RejectKind

    def status(kind: RejectKind) -> int:
        return Rejected(kind, "max_tokens=5 too many").api_error().status

    assert status(RejectKind.INVALID) == 400 and status(RejectKind.OVERLOADED) == 429
    assert status(RejectKind.DEAD) == 503 and status(RejectKind.INTERNAL) == 500
    invalid = Rejected(RejectKind.INVALID, "max_tokens=5 too many").api_error()
    assert invalid.param == "max_tokens"
    assert Rejected(RejectKind.OVERLOADED, "").api_error().retry_after_s >= 1


def test_check_item_raises_what_a_refusal_or_an_engine_failure_stands_for():
    import pytest

    from cluster.errors import APIError
    from cluster.stream_items import Rejected, RejectKind, check_item

    ok = delta(0, "a", [1])
    assert check_item(ok) is ok
    with pytest.raises(APIError) as refused:
        check_item(Rejected(RejectKind.OVERLOADED, "queue full"))
    assert refused.value.status == 429
    failed = delta(0, "", [], finish="error")
    failed.error = "grammar rejected every token"
    with pytest.raises(APIError) as internal:
        check_item(failed)
    assert internal.value.status == 500 and "grammar" in str(internal.value)


def test_sse_events_carry_the_standard_librarys_compact_json():
    """Streamed chunks are encoded by orjson: the text the standard library's compact form
    writes, for the shapes the responses carry (non-ASCII text, nulls, floats, vLLM's
    integer-keyed prompt logprobs); a float in exponent form is spelled without Python's
    leading zero (2.5e-7), the same number to a parser."""
    payloads = [
        {"id": "cmpl-1", "choices": [{"index": 0, "text": " héllo ✓", "logprobs": None}]},
        {"choices": [{"logprobs": {"token_logprobs": [-0.1234567891, -1.75, 0.0]}}]},
        {"prompt_logprobs": [None, {17: {"logprob": -1.75, "rank": 2, "decoded_token": "a"}}]},
        {"usage": {"prompt_tokens": 32, "total_tokens": 160, "cached": True}},
    ]
    for payload in payloads:
        expected = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        assert sse_event(payload) == f"data: {expected}\n\n"
    tiny = {"logprob": -2.5e-07}
    assert sse_event(tiny) == 'data: {"logprob":-2.5e-7}\n\n'
    assert json.loads(sse_event(tiny).removeprefix("data: ")) == tiny


def test_a_float_json_cannot_carry_is_sent_as_null():
    assert sse_event({"logprob": float("-inf"), "x": float("nan")}) == (
        'data: {"logprob":null,"x":null}\n\n'
    )


def test_outputs_that_arrived_together_stream_as_one_chunk_of_their_events():
    """The ingress writes one chunk per list of outputs ``merge`` hands it: each token keeps
    its own SSE event in it; a refusal after them ends the stream with an error event."""
    import asyncio

    from cluster.ingress import Ingress
    from cluster.stream_items import Rejected, RejectKind

    class _Ingress:
        def _count_finished(self, *args) -> None:
            pass

    async def merged():
        yield 0, [output(0, "a", [1])]
        yield 0, [output(0, "b", [2]), output(0, "c", [3])]
        yield 0, [Rejected(RejectKind.INTERNAL, "engine step failed")]

    b = builder()

    async def relay() -> list[str]:
        chunks = Ingress.func_or_class._relay(_Ingress(), merged(), b, 0.0, b.stream_events)
        return [chunk async for chunk in chunks]

    chunks = asyncio.run(relay())
    assert len(chunks) == 3 and b.failed
    second = decode([event + "\n\n" for event in chunks[1].split("\n\n") if event])
    assert [p["choices"][0]["delta"]["content"] for p in second] == ["b", "c"]
    assert "engine step failed" in chunks[2]


def _general_path(b: ResponseBuilder) -> ResponseBuilder:
    b._plain_parts = None  # every event through the chunk dicts
    return b


def test_a_tokens_event_made_from_the_parts_rendered_once_is_the_general_paths():
    """A plain token's event is joined from parts rendered once per request; it must be the
    event the chunk dicts make, byte for byte, for any text (quotes, escapes, non-ASCII,
    the empty text of a token that decoded to nothing yet), any choice index and a model
    name or request id holding the index's stand-in digits."""
    texts = ["Hi", ' "quoted"', "\\back\nslash\t", "é 中文 🙂", "", "\u2028", '}"]']
    stand_in = str(ResponseBuilder._INDEX_STAND_IN)
    for chat in (True, False):
        for kw in (
            {},
            {"n": 2, "include_usage": True},
            {"num_prompts": 2, "model": stand_in, "request_id": f"x{stand_in}"},
        ):
            fast, slow = builder(chat=chat, **kw), _general_path(builder(chat=chat, **kw))
            assert fast._plain_parts is not None
            slow.created = fast.created
            got, want = [], []
            for step, text in enumerate(texts):
                for choice in range(kw.get("n", 1)):
                    for prompt in range(kw.get("num_prompts", 1)):
                        out = output(choice, text, [step])
                        got += fast.stream_events(prompt, out)
                        want += slow.stream_events(prompt, out)
            last = output(0, "!", [99], "stop", text="".join(texts) + "!")
            got += fast.stream_events(0, last) + fast.closing_events()
            want += slow.stream_events(0, last) + slow.closing_events()
            assert got == want


def test_requests_that_ask_for_more_than_text_build_every_event_from_the_chunk_dicts():
    for kw in (
        {"want_logprobs": True},
        {"continuous_usage": True, "include_usage": True},
        {"chat": False, "echo_prompts": [("p", [1])]},
        {"chat": False, "want_prompt_logprobs": True},
    ):
        assert builder(**kw)._plain_parts is None
