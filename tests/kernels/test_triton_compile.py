"""The Triton kernels compile for a Hopper GPU (sm_90), checked on a machine without one.

The CPU interpreter accepts code the GPU compiler rejects (loop-carried types, dot shapes),
so this test compiles each kernel to a cubin with triton's bundled ``ptxas``, with the
specialisation hints the JIT would attach (16-byte-aligned pointers and strides, unit
strides as constants), and checks the properties the launchers' docstrings rely on: the
K/V and matmul loads are software-pipelined (``cp.async``), the dots use Hopper's warpgroup
MMA, and two matmul programs fit one SM's shared memory (``PROGRAMS_PER_SM``). It runs in a
subprocess because this test session put triton into interpreter mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HOPPER_SHARED_BYTES = 227 * 1024  # usable shared memory per SM on H100/H200
DTYPE_NAMES = {"float16": "*fp16", "bfloat16": "*bf16"}


def compile_kernel(fn, values: dict, constexprs: dict, **options) -> dict:
    """Compile ``fn`` for sm_90 as the JIT would specialise it for the example ``values``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs, constexprs = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        value = values.get(name)
        if name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(value, str):  # a pointer or float type
            signature[name] = value
            if value.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif value == 1 and name not in fn.do_not_specialize:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0 and name not in fn.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ttgir = kernel.asm["ttgir"]
    return {
        "shared_bytes": kernel.metadata.shared,
        "async_copies": ttgir.count("async_copy_global_to_local"),
        "warpgroup_dots": ttgir.count("warp_group_dot "),
    }


def compile_all(dtype_name: str) -> dict:
    import torch
    import triton

    from kernels import triton_attention as attn
    from kernels import triton_matmul as mm

    ptr = DTYPE_NAMES[dtype_name]
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    group = heads // kv_heads
    values = dict.fromkeys(("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr"), ptr)
    values.update(block_tables_ptr="*i32", query_start_loc_ptr="*i32", seq_lens_ptr="*i32")
    values.update(qk_scale_log2="fp32", num_seqs=64, stride_bt=257)
    values.update(stride_ot=heads * head_dim, stride_qt=heads * head_dim, stride_oh=head_dim)
    values.update(stride_qh=head_dim, stride_kh=head_dim, stride_vh=head_dim)
    values.update(stride_kb=block_size * kv_heads * head_dim, stride_ko=kv_heads * head_dim)
    values.update(stride_vb=block_size * kv_heads * head_dim, stride_vo=kv_heads * head_dim)
    block_m = max(attn.BLOCK_M, triton.next_power_of_2(group))
    attention = compile_kernel(
        attn._paged_attention_kernel,
        values,
        dict(
            GROUP=group,
            GROUP_PAD=group,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            BLOCK_Q=block_m // group,
            KV_CHUNK=attn.KV_CHUNK,
            DOT_PRECISION="tf32",
        ),
        num_warps=attn.NUM_WARPS,
        num_stages=2,
    )
    block_m, block_n, block_k, num_warps, num_stages = mm._CONFIGS[getattr(torch, dtype_name)]
    values = dict.fromkeys(("out_ptr", "x_ptr", "w_ptr", "bias_ptr"), ptr)
    values.update(M=7, N=4096, K=4096, num_programs=264, stride_xm=4096, stride_xk=1)
    values.update(stride_wn=4096, stride_wk=1, stride_om=4096, stride_on=1)
    matmul = compile_kernel(
        mm._bi_matmul_kernel,
        values,
        dict(
            HAS_BIAS=True,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GROUP_M=mm.GROUP_M,
            DOT_PRECISION="tf32",
        ),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return {"attention": attention, "matmul": matmul, "programs_per_sm": mm.PROGRAMS_PER_SM}


@pytest.mark.parametrize("dtype_name", ["bfloat16"])
def test_kernels_compile_pipelined_for_hopper(dtype_name):
    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "tests.kernels.test_triton_compile", dtype_name]
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("attention", "matmul"):
        assert report[name]["async_copies"] > 0, f"{name} loads are not pipelined: {report}"
        assert report[name]["warpgroup_dots"] > 0, f"{name} does not use wgmma: {report}"
    assert report["matmul"]["shared_bytes"] * report["programs_per_sm"] <= HOPPER_SHARED_BYTES


if __name__ == "__main__":
    print(json.dumps(compile_all(sys.argv[1])))
