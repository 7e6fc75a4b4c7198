"""Mixed steps over padded static buffers with the Triton kernels (the CUDA path).

``worker/cuda_graphs.py`` pads a step that is not a plain decode to a token bucket over
``max_num_seqs`` sequence slots: the slots past the batch are sequences of zero tokens,
which the attention kernel skips, and the tokens past the batch belong to no sequence. This
runs a whole engine with staggered arrivals (so prefill chunks share steps with decodes) and
checks every step's logits and KV writes bitwise against the unpadded step: here under the
interpreter with the padded buffers run eagerly, on a GPU with the captured graphs replayed.
"""

from __future__ import annotations

from tests.kernels.conftest import DEVICE
from tests.worker.helpers import check_every_step_against_eager, staggered_run
from worker.config import EngineConfig
from worker.cuda_graphs import StepGraphs
from worker.engine import LLMEngine
from worker.testing import make_tiny_model

SMALL_VOCAB = 512
"""The interpreter runs every program of the LM-head matmul in numpy: a small vocabulary
keeps this end-to-end test to seconds."""


def test_every_step_of_a_run_gives_eager_bits(tmp_path, smollm2_path):
    path = make_tiny_model(tmp_path / "llama", "llama", vocab_size=SMALL_VOCAB)
    engine = LLMEngine(
        EngineConfig(
            model=path,
            kernel_backend="triton",
            device=DEVICE,
            deterministic=True,
            block_size=16,
            num_kv_blocks=64,
            max_num_seqs=4,
            max_num_batched_tokens=32,
        )
    )
    runner = engine.runner
    graphs = runner.step_graphs or StepGraphs(
        lambda ids, positions, meta, rows: runner.model.forward(
            ids, positions, runner.kv_caches, meta, rows
        ),
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_blocks_per_seq=runner.max_blocks_per_seq,
        block_size=runner.block_size,
        vocab_size=SMALL_VOCAB,
        device=runner.device,
        capture=False,
    )
    shapes = check_every_step_against_eager(runner, graphs)
    staggered_run(engine, [5, 40, 3, 21])
    mixed = [s for s in shapes if s is not None and not s.decode]
    assert mixed and any(s.tokens > 16 for s in mixed)  # prefill chunks beside decodes
    assert any(s is not None and s.decode and s.seqs > 1 for s in shapes)
