"""Every attention kernel of the runtime's registry (flexmesh.runtime.model.attention_kernels) names the
cost model's function that prices it, and that function exists and prices the runtime's stack."""

from __future__ import annotations

import importlib

import pytest

from flexmesh.runtime.model.attention_kernels import KERNELS


def resolve(path: str) -> object:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(path)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_kernel_names_what_prices_it(name):
    kernel = KERNELS[name]
    assert kernel.cost.startswith("flexmesh.cost."), f"{name} names no cost function"
    assert callable(resolve(kernel.cost))


def test_the_runtimes_stack_prices_them_so():
    """The kernels priced by the FlashAttention-2 fits are what the runtime's stack prices."""
    from flexmesh.cost import CostModel
    from flexmesh.cost.device.flash2 import flash2_kernels
    from flexmesh.layout.stack import RUNTIME_STACK
    from flexmesh.spec import parse_cluster, parse_model

    assert RUNTIME_STACK.attention == "flash2"
    cm = CostModel(parse_model("llama2-7b"), parse_cluster("8xH100"))
    fitted = flash2_kernels(cm.hw.kernels, cm.cluster.device.architecture, cm.hw.peak_flops)
    # exact: the same function of the same constants
    assert cm.timing.kernels.attention(1e12, 4096.0) == fitted.attention(1e12, 4096.0) != cm.hw.kernels.attention(
        1e12, 4096.0)  # Hopper: FlashAttention-2's own fit, not the fastest fused kernel
    assert {k.cost for k in KERNELS.values()} == {f"{flash2_kernels.__module__}.{flash2_kernels.__name__}"}
