"""Block hash v1: golden vectors (frozen) and an independent re-derivation from docs/design.md."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from router.protocol import ReplicaStats, hash_blocks, hash_seed

GOLDEN_SEED = {
    ("smollm2", ""): "6c0e5ddf2e87a9da9365048d2945cdbe",
    ("smollm2", "tenant-a"): "ab0fe67527d3d268ba9bd9863a60e464",
}
GOLDEN_CHAIN_0_TO_39 = ["de6595798cf7172bd7c8aa8d662f77da", "b42ab358363a524d4ed2eb261e400317"]
GOLDEN_SALTED_EDGE_TOKENS = ["31a37d49ec8eb214a9e829f412cb9067"]


def test_golden_seeds():
    for (model, salt), hexdigest in GOLDEN_SEED.items():
        assert hash_seed(model, salt).hex() == hexdigest


def test_golden_chain():
    hashes = hash_blocks(list(range(40)), 16, "SmolLM2-135M-Instruct")
    assert [h.hex() for h in hashes] == GOLDEN_CHAIN_0_TO_39  # 40 tokens: 2 full blocks only
    edge = hash_blocks([0, 1, 2**32 - 1, 70000], 4, "m", "salt")
    assert [h.hex() for h in edge] == GOLDEN_SALTED_EDGE_TOKENS


def test_matches_the_written_spec(test_seed):
    """Re-derive with numpy packing and the streaming hasher, straight from docs/design.md."""
    rng = np.random.default_rng(test_seed)
    tokens = rng.integers(0, 2**32, size=int(rng.integers(16, 200)), dtype=np.uint64).tolist()
    model, salt, bs = "model-x", "s1", 16
    seed = xxhash.xxh3_128(b"prefixserve/v1\0" + model.encode() + b"\0" + salt.encode()).digest()
    prev, expected = seed, []
    for i in range(len(tokens) // bs):
        h = xxhash.xxh3_128()
        h.update(prev)
        h.update(np.asarray(tokens[i * bs : (i + 1) * bs], dtype="<u4").tobytes())
        prev = h.digest()
        expected.append(prev)
    assert hash_blocks(tokens, bs, model, salt) == expected


def test_salts_and_models_never_share_blocks():
    toks = list(range(32))
    a = hash_blocks(toks, 16, "m")
    assert a != hash_blocks(toks, 16, "m", "tenant")
    assert a != hash_blocks(toks, 16, "other-model")
    assert hash_blocks(toks, 16, "m", None) == hash_blocks(toks, 16, "m", "")


def test_chain_continuation_equals_full_hash():
    toks = list(range(100))
    full = hash_blocks(toks, 16, "m")
    tail = hash_blocks(toks, 16, "m", parent=full[2], start_block=3)
    assert full[3:] == tail


def test_bad_inputs():
    with pytest.raises(ValueError):
        hash_blocks([1, 2], 0, "m")
    with pytest.raises(ValueError):
        hash_blocks([-1] * 16, 16, "m")
    with pytest.raises(ValueError):
        hash_blocks(list(range(32)), 16, "m", start_block=1)


def test_replica_stats_round_trip():
    s = ReplicaStats(num_waiting=3, num_running=2, kv_usage=0.5, prefill_tokens_per_s=900.0)
    assert ReplicaStats.from_dict(s.to_dict()) == s
