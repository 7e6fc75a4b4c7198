"""One tool call through the Responses API, end to end, against a running server.

    python -m bench.responses_tool_call --base-url http://127.0.0.1:8000 [--out FILE]

Streams a ``responses.create`` with one function tool and ``tool_choice: required`` (the
server needs ``--tool-call-parser``; ``auto`` also ``--enable-auto-tool-choice``), prints
every event as it arrives (type, and the text or argument pieces), sends the call's output
back on ``previous_response_id`` and prints the answer. ``--agent`` then runs an OpenAI
Agents SDK agent with one function tool against the same server (``pip install
openai-agents``; its first turn forces a call). ``--out`` writes the transcript as markdown.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def run(base_url: str, api_key: str, model: str | None) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key)
    model = model or client.models.list().data[0].id
    lines = [f"model `{model}` at {base_url}, openai {openai.__version__}", ""]
    start = time.monotonic()
    final = None
    stream = client.responses.create(
        model=model,
        input="What is the weather in Paris right now?",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
        stream=True,
    )
    for event in stream:
        ms = (time.monotonic() - start) * 1000
        piece = getattr(event, "delta", None)
        lines.append(f"- {ms:7.1f} ms `{event.type}`" + (f" {json.dumps(piece)}" if piece else ""))
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    calls = [item for item in final.output if item.type == "function_call"]
    lines += ["", f"status `{final.status}`, usage {final.usage.model_dump_json()}"]
    for call in calls:
        lines.append(f"call `{call.name}` `{call.arguments}` (call_id `{call.call_id}`)")
    if calls:
        answer = client.responses.create(
            model=model,
            previous_response_id=final.id,
            input=[
                {
                    "type": "function_call_output",
                    "call_id": calls[0].call_id,
                    "output": "18 C, sunny",
                }
            ],
            max_output_tokens=48,
            temperature=0,
        )
        lines += ["", f"answer after the call's output: {json.dumps(answer.output_text)}"]
    return lines


def run_agent(base_url: str, api_key: str, model: str | None) -> list[str]:
    """The OpenAI Agents SDK's Responses model, one function tool, up to 4 turns."""
    import agents
    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key)
    model = (
        model or openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key).models.list().data[0].id
    )
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"18 C and sunny in {city}"

    agent = Agent(
        name="weather",
        instructions="Answer with the weather the tool reports.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=128, temperature=0
        ),
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    return [
        "",
        "## An OpenAI Agents SDK agent with one function tool",
        "",
        f"tool called with {cities}; items {[type(i).__name__ for i in result.new_items]}",
        f"final output: {json.dumps(result.final_output)}",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--agent", action="store_true", help="also run an Agents SDK agent")
    args = ap.parse_args(argv)
    lines = run(args.base_url, args.api_key, args.model)
    if args.agent:
        lines += run_agent(args.base_url, args.api_key, args.model)
    text = "\n".join(lines)
    print(text)
    if args.out:
        command = "python -m bench.responses_tool_call " + " ".join(argv or sys.argv[1:])
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        head = f"`{command}` ({when}; client on {platform.processor() or platform.machine()})"
        args.out.write_text(
            f"# A tool call through the Responses API, streamed\n\n{head}\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
