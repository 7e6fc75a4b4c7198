"""What the Triton facade and every Triton kernel module share: argument checks, the
interpreter switch and its fixes, the persistent-grid size.

``kernels/triton_ops.py`` (the facade) imports the kernel modules (``triton_*.py``) lazily;
the kernel modules take their helpers from here, never from the facade, so no import cycle
runs through the package. Like the facade, importing this module never needs triton:
``patch_interpreter`` imports it only when interpreting.

Argument checks
    Every launcher calls ``check_tensor`` on each argument: a tensor of the wrong rank, dtype
    or device raises ``ValueError`` naming the argument, before any kernel starts. The device
    must be CUDA, or the CPU when the interpreter runs the kernels.

Interpreter fixes (``patch_interpreter``, applied only when ``TRITON_INTERPRET=1``)
    Triton 3.5's interpreter stores scalars as one-element arrays and converts them with
    ``int(array)``, which numpy >= 2.4 rejects (so ``range(0, loaded_value, step)`` fails);
    multiplies bfloat16 bit patterns as integers in ``tl.dot``; and truncates float32 to
    bfloat16 where the GPU rounds to nearest even. All three are patched in the interpreter
    only: scalars via ``.item()``, bfloat16 dot operands widened to float32 (exact; the GPU
    also accumulates bf16 products in float32), and a round-to-nearest-even cast. Compiled
    kernels are untouched.

    ``tl.dot`` itself is replaced too. The interpreter hands it to ``np.matmul``, i.e. to
    whatever BLAS numpy was built with, and OpenBLAS picks its kernel by CPU: its AVX2
    ("Haswell") sgemm gives an output element different bits depending on where its row
    and column fall in the matrix (edge micro-tiles reduce in another order), while its
    AVX-512 kernel does not. A GPU's MMA computes every element of a tile with the same
    instruction sequence, so the batch-invariance the kernels promise rests on "a row's
    result depends on its data and the tile shape, not its position in the tile". The
    replacement (``_position_independent_dot``) keeps exactly that property on every CPU:
    each element is its K products summed in one fixed order. Without it the bitwise
    invariance tests would test the host's BLAS, not the kernels.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Activation and cache dtypes every kernel accepts."""
INTERPRETER_NUM_SMS = 1
"""Stand-in SM count for persistent grids under the interpreter: one, so the CPU tests'
small matrices still give each program several tiles and exercise the persistent loop."""


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter instead of compiling them."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def patch_interpreter() -> None:
    """Fix the interpreter defects above; idempotent, a no-op unless interpreting.

    Each fix applies only where the internals it replaces exist in the installed triton
    (bfloat16 ones only where bfloat16 is held as uint16 bit patterns), so a triton that
    changed them is left alone rather than broken.
    """
    if not interpreting():
        return
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_prefixserve_patched", False):
        return
    interpreter._prefixserve_patched = True
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original_patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if original_patch_tensor is not None:

        def patch_tensor(tensor, *args):
            original_patch_tensor(tensor, *args)
            tensor.__index__ = lambda self: int(self.handle.data.item())

        interpreter._patch_lang_tensor = patch_tensor

    if builder is None:
        return
    original_dot = builder.create_dot
    get_np_dtype = getattr(interpreter, "_get_np_dtype", None)
    bf16_as_bits = get_np_dtype is not None and str(get_np_dtype(tl.bfloat16)) == "uint16"

    def widen(handle):
        if handle.dtype != tl.bfloat16:
            return handle
        data = (handle.data.astype("uint32") << 16).view("float32")
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, *args):
        if bf16_as_bits:
            a, b = widen(a), widen(b)
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original_dot(self, a, b, d, *args)  # fp8: the interpreter's own widening
        product = _position_independent_dot(a.data, b.data, d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    if not bf16_as_bits:
        return
    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return original_cast(self, src, dst_type)
        bits = src.data.astype("float32").view("uint32")
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16  # round to nearest even
        data = rounded.astype("uint16")
        data[src.data != src.data] = 0x7FC0  # NaN stays a (quiet) NaN
        return interpreter.TensorHandle(data, tl.bfloat16)

    builder.cast_impl = cast_impl


def _position_independent_dot(a, b, acc_dtype):
    """``a @ b`` ([..., M, K] @ [..., K, N]) accumulated in ``acc_dtype``, where every output
    element is its K products summed in the same order: its bits depend on its row of ``a``,
    its column of ``b`` and K, never on M, N or its position (see this module's docstring)."""
    products = a.astype(acc_dtype)[..., :, :, None] * b.astype(acc_dtype)[..., None, :, :]
    return products.sum(axis=-2, dtype=acc_dtype)


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    shape: tuple[int | None, ...] | None = None,
) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``tensor`` fits the kernel.

    ``shape`` entries of ``None`` match any size. The device must be CUDA, or the CPU when
    the interpreter runs the kernels.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {tensor.dtype}")
    if shape is not None:
        for dim, (want, got) in enumerate(zip(shape, tensor.shape, strict=True)):
            if want is not None and want != got:
                raise ValueError(
                    f"{name} has size {got} in dimension {dim}, expected {want} "
                    f"(shape {tuple(tensor.shape)})"
                )
    want_device = "cpu" if interpreting() else "cuda"
    if tensor.device.type != want_device:
        raise ValueError(f"{name} must be on {want_device}, got {tensor.device}")


def output_or_new(name: str, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``out`` checked to match ``like`` (shape, dtype, device, contiguous), or a new tensor."""
    if out is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    check_tensor(name, out, ndim=like.dim(), dtypes=(like.dtype,), shape=tuple(like.shape))
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return out


def num_sms(device: torch.device) -> int:
    """Programs in a persistent grid: the device's SM count (a stand-in under the interpreter)."""
    if interpreting():
        return INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
