"""The private APIs prefixserve leans on exist in the installed ray, torch and triton, and the
tested ranges the adapters state are the bounds ``pyproject.toml`` gives.

No Ray start: the Serve check reads classes and modules only. A failure names the installed
version, what it lacks and the tested range, so an upgrade that breaks an adapter says so here
rather than as an ``AttributeError`` in a replica.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import tomllib
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_specifier(name: str, extra: str | None = None) -> SpecifierSet:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["optional-dependencies"][extra] if extra else project["dependencies"]
    for line in lines:
        requirement = Requirement(line)
        if requirement.name == name:
            return requirement.specifier
    raise AssertionError(f"pyproject.toml names no {name} in {extra or 'dependencies'}")


def _installed(name: str) -> Version:
    return Version(importlib.metadata.version(name))


def test_serve_internals_exist_in_the_installed_ray():
    import ray

    from cluster.serve_compat import TESTED_RAY, missing_serve_internals

    missing = missing_serve_internals()
    assert not missing, (
        f"ray {ray.__version__} lacks {missing}, which cluster/serve_compat.py needs "
        f"(tested with ray{TESTED_RAY})"
    )


def test_serve_check_error_names_the_version_and_range():
    """The error a missing internal raises names what is missing, the installed Ray and the
    tested range (the check is run on a name no Ray has)."""
    import ray

    from cluster import serve_compat

    message = serve_compat.missing_message(["RequestRouter.no_such_hook"])
    assert "RequestRouter.no_such_hook" in message
    assert ray.__version__ in message and serve_compat.TESTED_RAY in message


def test_stream_handle_asks_serve_for_the_chosen_transport():
    from cluster import serve_compat

    assert serve_compat.has_grpc_transport()  # the installed Ray's handles can use gRPC

    class Handle:
        def options(self, **options):
            return options

    assert serve_compat.stream_handle(Handle(), grpc=True) == {
        "stream": True,
        "_by_reference": False,
    }
    assert serve_compat.stream_handle(Handle(), grpc=False)["_by_reference"] is True


def test_a_serve_without_the_grpc_transport_streams_on_actor_calls(monkeypatch):
    from cluster import serve_compat

    class Handle:
        def options(self, **options):
            return options

    monkeypatch.setattr(serve_compat, "has_grpc_transport", lambda: False)
    assert serve_compat.stream_handle(Handle(), grpc=True) == {"stream": True}


def test_kv_pull_order_and_peer_call_use_what_serve_internals_provide():
    """The request router's pull order rides in the pending call's kwargs, and a replica calls
    its peer's actor with the pickled ``RequestMetadata`` Serve's replicas unpack (the
    live path is ``tests/cluster/test_kv_pull_serve.py``)."""
    import asyncio
    import pickle
    from types import SimpleNamespace

    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    from cluster import serve_compat

    async def check():
        metadata = RequestMetadata(request_id="r", internal_request_id="r")
        pending = PendingRequest(args=["r"], kwargs={"block_hashes": []}, metadata=metadata)
        serve_compat.set_request_kwarg(pending, "kv_pull", {"peer_id": "p"})
        assert pending.kwargs["kv_pull"] == {"peer_id": "p"}
        serve_compat.set_request_kwarg(pending, "kv_pull", None)
        assert "kv_pull" not in pending.kwargs

    asyncio.run(check())
    sent = []
    actor = SimpleNamespace(handle_request=SimpleNamespace(remote=lambda *a: sent.append(a)))
    serve_compat.PeerReplica(actor, "app").export_prefix.remote([b"h"], [1, 2], None)
    ((pickled, *args),) = sent
    metadata = pickle.loads(pickled)
    assert (metadata.call_method, metadata.app_name) == ("export_prefix", "app")
    assert args == [[b"h"], [1, 2], None]


@pytest.mark.parametrize("packing", ["oneDNN", "MKL"])
def test_packing_ops_exist_where_their_library_does(packing):
    from kernels import torch_compat

    backend = torch.backends.mkldnn if packing == "oneDNN" else torch.backends.mkl
    if not backend.is_available():
        pytest.skip(f"this torch build has no {packing}: plain tiles, by design")
    missing = torch_compat.missing_ops(packing)
    assert not missing, (
        f"torch {torch.__version__} lacks {missing}, which kernels/torch_compat.py needs "
        f"(tested with torch{torch_compat.TESTED_TORCH})"
    )
    assert packing in torch_compat.available_packings()
    weight, x = torch.randn(48, 64), torch.randn(8, 64)
    ops = torch_compat.packing_ops(packing)
    product = ops.multiply(x, ops.pack(weight, 32), weight, 8)
    torch.testing.assert_close(product, x @ weight.T, rtol=1e-4, atol=1e-4)


def test_missing_packing_op_error_names_the_version_and_range():
    from kernels import torch_compat

    message = torch_compat.missing_message("MKL", ["torch.ops.mkl._no_such_op"])
    assert "torch.ops.mkl._no_such_op" in message
    assert torch.__version__ in message and torch_compat.TESTED_TORCH in message


def test_triton_interpreter_internals_exist():
    """``kernels/triton_common.patch_interpreter`` replaces these; without them it skips its
    fixes and the interpreted kernels lose the bits the tests expect."""
    triton = pytest.importorskip("triton")
    from triton.runtime import interpreter

    needed = ["InterpreterBuilder", "TensorHandle", "_patch_lang_tensor", "_get_np_dtype"]
    missing = [name for name in needed if not hasattr(interpreter, name)]
    builder = getattr(interpreter, "InterpreterBuilder", object)
    missing += [
        f"InterpreterBuilder.{m}" for m in ("create_dot", "cast_impl") if not hasattr(builder, m)
    ]
    assert not missing, (
        f"triton {triton.__version__} lacks triton.runtime.interpreter's {missing} "
        f"(patched by kernels/triton_common.py; tested with triton"
        f"{_pyproject_specifier('triton', 'triton')})"
    )


@pytest.mark.parametrize(
    ("name", "extra", "adapter_range"),
    [
        ("ray", None, "cluster.serve_compat:TESTED_RAY"),
        ("torch", None, "kernels.torch_compat:TESTED_TORCH"),
        ("triton", "triton", None),
    ],
)
def test_pyproject_bounds_match_the_adapters_and_the_installed_versions(name, extra, adapter_range):
    specifier = _pyproject_specifier(name, extra)
    assert any(s.operator in ("<", "<=", "==", "~=") for s in specifier), (
        f"pyproject.toml's {name}{specifier} has no upper bound: its private APIs are tested "
        "against a range"
    )
    if adapter_range is not None:
        module, attribute = adapter_range.split(":")
        stated = getattr(importlib.import_module(module), attribute)
        assert SpecifierSet(stated) == specifier, (
            f"{module}.{attribute} = {stated!r} but pyproject.toml says {name}{specifier}"
        )
    try:
        installed = _installed(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed")
    release = Version(re.sub(r"\+.*", "", str(installed)))  # 2.13.0+cpu -> 2.13.0
    assert specifier.contains(release, prereleases=True), (
        f"installed {name} {installed} is outside pyproject.toml's tested range {specifier}"
    )
