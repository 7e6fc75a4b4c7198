"""LoRA adapters over HTTP on the shared tiny cluster (two engine replicas serving the tiny
llama with adapters ``sql`` and ``chat`` from the start): ``model`` picks an adapter and its
greedy tokens equal the offline ``LLM``'s, ``/v1/models`` lists the adapters after the base
model, an unknown model is a 404, and a runtime load then unload behaves as vLLM's does."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT_IDS = [11, 42, 7, 300, 5, 99, 123, 64, 17, 250, 31, 8, 77, 190, 3, 12, 500, 44, 21, 6]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_server) -> dict[str, str]:
    if not tiny_server.lora_modules:
        pytest.skip("the reused tiny server serves no LoRA adapters")
    return tiny_server.lora_modules


@pytest.fixture(scope="module")
def offline(tiny_server, adapters) -> dict[str | None, str]:
    """Greedy text of ``PROMPT_IDS`` per adapter (None: the base model), offline."""
    from worker import LLM, SamplingParams

    llm = LLM(tiny_server.model, lora_modules=adapters, max_model_len=tiny_server.max_model_len)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return {
        name: llm.generate([PROMPT_IDS], params, lora_name=name)[0].outputs[0].text
        for name in (None, *adapters)
    }


def complete(client, model: str) -> openai.types.Completion:
    return client.completions.create(
        model=model,
        prompt=PROMPT_IDS,
        max_tokens=NUM_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def test_model_picks_the_adapter_and_models_lists_them(client, model, adapters, offline):
    cards = client.models.list().data
    assert [c.id for c in cards] == [model, *adapters]
    for card in cards[1:]:
        assert card.parent == model and card.root == adapters[card.id]
    assert client.models.retrieve("sql").root == adapters["sql"]
    assert len(set(offline.values())) == 3, "each adapter changes the tiny model's output"
    for name in (model, *adapters):
        completion = complete(client, name)
        assert completion.model == name
        assert completion.choices[0].text == offline[None if name == model else name]
    chat = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "chat" and chat.usage.completion_tokens <= 4
    with pytest.raises(openai.NotFoundError) as info:
        complete(client, "no-such-adapter")
    assert info.value.status_code == 404 and info.value.body["code"] == "model_not_found"


def test_runtime_load_reaches_the_replicas_and_unload_removes_it(
    tiny_server, client, adapters, offline
):
    url, headers = tiny_server.url, tiny_server.headers

    def post(path: str, body: dict, **kw) -> httpx.Response:
        return httpx.post(f"{url}/v1/{path}", json=body, headers=headers, timeout=60, **kw)

    assert httpx.post(f"{url}/v1/load_lora_adapter", json={}).status_code == 401
    loaded = post("load_lora_adapter", {"lora_name": "sql2", "lora_path": adapters["sql"]})
    assert loaded.status_code == 200, loaded.text
    assert "sql2" in loaded.text
    again = post("load_lora_adapter", {"lora_name": "sql2", "lora_path": adapters["sql"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = post("load_lora_adapter", {"lora_name": "bad", "lora_path": tiny_server.model})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert "bad" not in [c.id for c in client.models.list().data]

    card = [c for c in client.models.list().data if c.id == "sql2"]
    assert card and card[0].root == adapters["sql"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # spread over the replicas
        texts = list(pool.map(lambda _: complete(client, "sql2").choices[0].text, range(4)))
    assert texts == [offline["sql"]] * 4

    assert post("unload_lora_adapter", {"lora_name": "sql2"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "sql2")
    gone = post("unload_lora_adapter", {"lora_name": "sql2"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    assert [c.id for c in client.models.list().data][1:] == list(adapters)


def test_every_replica_exports_lora_requests_info(tiny_server, adapters):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{tiny_server.url}/metrics", timeout=10).text
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name.endswith("lora_requests_info")
    ]
    assert len({s.labels["replica"] for s in family.samples}) >= 1
    for sample in family.samples:
        assert sample.value == 1.0 and sample.labels["max_lora"] == "8"
        assert set(sample.labels) >= {"running_lora_adapters", "waiting_lora_adapters"}
