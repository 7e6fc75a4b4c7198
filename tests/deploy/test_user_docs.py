"""The docs a newcomer follows, tried the way they would try them: README's quick start stays
at the top; its OpenAI SDK snippet is valid Python aimed at the server's default address;
every `prefixserve` command in README parses with the real CLI (a misspelt or removed flag
fails here, not on the user's first try); docs/openai_api.md has a row for every request
field and none for a field that is gone; deploy/README.md's `helm install` commands render
manifests that validate."""

from __future__ import annotations

import ast
import re
import shlex

import pytest

from tests.deploy import chart

README = chart.REPO_ROOT / "README.md"
OPENAI_DOC = chart.REPO_ROOT / "docs" / "openai_api.md"
DEPLOY_README = chart.REPO_ROOT / "deploy" / "README.md"


def _code_blocks(text: str, language: str) -> list[str]:
    """Fenced blocks of ``language``, indented ones (inside list items) included."""
    return re.findall(rf"^[ ]*```{language}\n(.*?)^[ ]*```", text, flags=re.M | re.S)


def _commands(text: str, program: str, inline: bool = True) -> list[str]:
    """Commands starting with ``program`` in bash blocks (continuations joined) and, with
    ``inline``, in inline code that passes flags (a bare ``prefixserve batch`` is a mention)."""
    found = []
    for block in _code_blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(program + " "):
                found.append(line)
    if inline:
        found += [
            m for m in re.findall(r"`([^`\n]+)`", text) if m.startswith(program + " ") and " -" in m
        ]
    return found


def test_quick_start_commands_stay_first() -> None:
    first_block = _code_blocks(README.read_text(), "bash")[0].splitlines()
    assert first_block[0].startswith("make serve")
    assert first_block[1].startswith("make test")


def test_openai_sdk_snippet_targets_the_default_server() -> None:
    from cluster.config import DEFAULT_PORT

    (snippet,) = [
        b for b in _code_blocks(README.read_text(), "python") if "from openai import" in b
    ]
    tree = ast.parse(snippet)  # a syntax error fails here
    (call,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "OpenAI"
    ]
    kwargs = {kw.arg: kw.value for kw in call.keywords}
    assert ast.literal_eval(kwargs["base_url"]) == f"http://127.0.0.1:{DEFAULT_PORT}/v1"
    assert "PREFIXSERVE_API_KEY" in ast.unparse(kwargs["api_key"])
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{DEFAULT_PORT}/v1", api_key="none")
    assert str(client.base_url) == f"http://127.0.0.1:{DEFAULT_PORT}/v1/"


def _readme_cli_commands() -> list[str]:
    return [
        c
        for c in _commands(README.read_text(), "prefixserve")
        if "..." not in c and "--help" not in c and "[" not in c
    ]


def test_readme_names_the_commands_a_newcomer_needs() -> None:
    commands = _readme_cli_commands()
    assert any(c.startswith("prefixserve bench serve ") for c in commands)
    assert any("--device cuda" in c for c in commands)
    assert any(re.search(r"--model [\w.-]+/[\w.-]+", c) for c in commands), "no hub-id example"
    assert any(".gguf" in c for c in commands), "no GGUF example"


@pytest.mark.parametrize("command", _readme_cli_commands())
def test_readme_commands_parse_with_the_real_cli(command: str) -> None:
    from cluster.cli import build_parser

    try:
        args = build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit as exc:
        pytest.fail(f"README command does not parse (exit {exc.code}): {command}")
    if args.command == "bench":
        from bench.loadgen.cli import make_conversations

        assert make_conversations(args), "the documented workload is empty"


def _documented_fields() -> set[str]:
    names = set()
    for line in OPENAI_DOC.read_text().splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            names.update(re.findall(r"`([^`]+)`", first_cell))
    return names


def test_openai_fields_table_covers_every_request_field() -> None:
    from cluster.anthropic_messages import MessagesRequest
    from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest
    from cluster.openai_responses import ResponsesRequest

    fields = (
        set(ChatCompletionRequest.model_fields)
        | set(CompletionRequest.model_fields)
        | set(ResponsesRequest.model_fields)
        | set(MessagesRequest.model_fields)
    )
    documented = _documented_fields()
    top_level = {name for name in documented if "." not in name and "[" not in name}
    missing = fields - top_level
    assert not missing, f"docs/openai_api.md has no row for {sorted(missing)}"
    stale = top_level - fields
    assert not stale, f"docs/openai_api.md documents fields the API no longer has: {sorted(stale)}"
    assert "openai_api.md" in README.read_text()


def _helm_installs() -> list[list[str]]:
    """The value flags of each `helm install <release> deploy/helm/prefixserve ...` command."""
    installs = []
    for command in _commands(DEPLOY_README.read_text(), "helm", inline=False):
        words = shlex.split(command)
        if words[1:2] == ["install"] and words[3:4] == ["deploy/helm/prefixserve"]:
            installs.append(words[4:])
    return installs


def test_deploy_readme_has_gpu_and_cpu_installs() -> None:
    installs = _helm_installs()
    assert len(installs) >= 2
    assert any("hfToken.existingSecret=hf-token" in args for args in installs)


@pytest.mark.usefixtures("helm")
@pytest.mark.parametrize("args", _helm_installs(), ids=lambda a: " ".join(a)[:60])
def test_deploy_readme_installs_render_valid_manifests(args: list[str]) -> None:
    docs = chart.render_args(args)
    for doc in docs:
        chart.validate_manifest(doc)
    engine = chart.serve_config(docs)["applications"][0]["args"]["engine"]
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--set" and value.startswith("engine.model="):
            assert engine["model"] == value.split("=", 1)[1]
