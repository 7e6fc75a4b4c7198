"""One tiny cluster (``start_tiny_cluster``) for every module of this package: the OpenAI API
tests and the batch client share it, so CI starts Ray, Serve and two replicas once for both.
Package scope ends it before any other cluster test starts its own Ray."""

from __future__ import annotations

import os

import openai
import pytest

from tests.cluster.conftest import (
    REUSE_ENV,
    TINY_MAX_BODY_BYTES,
    TINY_MAX_MODEL_LEN,
    Server,
    start_tiny_cluster,
)


@pytest.fixture(scope="package")
def tiny_server(tmp_path_factory):
    if os.environ.get(REUSE_ENV):
        url, key, model = os.environ[REUSE_ENV].split()
        yield Server(url, key, model, TINY_MAX_MODEL_LEN, TINY_MAX_BODY_BYTES)
        return
    server, teardown = start_tiny_cluster(tmp_path_factory.mktemp("tiny-llama"), lora=True)
    yield server
    teardown()


@pytest.fixture(scope="package")
def client(tiny_server) -> openai.OpenAI:
    """The official OpenAI client on the tiny cluster (no retries: a failure shows)."""
    return openai.OpenAI(
        base_url=f"{tiny_server.url}/v1", api_key=tiny_server.api_key, max_retries=0
    )


@pytest.fixture(scope="package")
def model(client) -> str:
    """The base model's id (listed first, before the LoRA adapters)."""
    return client.models.list().data[0].id
