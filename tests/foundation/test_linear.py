"""The provided prepacked linear (s00 linear.py) computes F.linear, alone or as one product for a
group of layers, and never from a stale copy (not graded: this code is given, not written)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from s00_foundation import device as device_module
from s00_foundation import linear as linear_module
from s00_foundation.device import cpu_vendor
from s00_foundation.linear import MIN_PREPACKED_ROWS, Linear, PackedWeight, linear_group

needs_onednn = pytest.mark.skipif(
    not linear_module.PREPACKING,
    reason="this CPU or torch build has no oneDNN x86 kernels: every product is F.linear here",
)


def layer(bias: bool, out_features: int = 160, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return Linear(96, out_features, bias=bias).eval()


def group(bias: bool) -> list[Linear]:
    """Three layers that read the same input, of different widths (q, k, v)."""
    return [layer(bias, width, seed) for seed, width in enumerate((160, 48, 48))]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 64, 130])
def test_equals_f_linear(rows, bias):
    lin, x = layer(bias), torch.randn(rows, 96)
    with torch.inference_mode():
        got = lin(x)
    expected = F.linear(x, lin.weight, lin.bias)
    if rows < MIN_PREPACKED_ROWS:
        assert torch.equal(got, expected), f"{rows} rows: fewer than {MIN_PREPACKED_ROWS} must be F.linear itself"
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_takes_the_prepacked_path_from_min_rows():
    lin = layer(bias=True)
    with torch.inference_mode():
        if MIN_PREPACKED_ROWS > 1:
            lin(torch.randn(MIN_PREPACKED_ROWS - 1, 96))
            assert lin.packed.packed is None, "a product below MIN_PREPACKED_ROWS made a prepacked copy"
        lin(torch.randn(MIN_PREPACKED_ROWS, 96))
    assert lin.packed.packed is not None, "no prepacked copy after a product of MIN_PREPACKED_ROWS rows"


def test_prepacks_from_one_row_where_mkl_is_not_intel_tuned():
    # MKL (F.linear) chooses its kernels by vendor: on an Intel CPU it is faster below 4 rows, on an
    # AMD one slower at every size; a vendor that could not be read keeps the Intel choice
    assert linear_module.min_prepacked_rows("GenuineIntel") == 4
    assert linear_module.min_prepacked_rows("") == 4
    assert linear_module.min_prepacked_rows("AuthenticAMD") == 1
    assert linear_module.MIN_PREPACKED_ROWS == linear_module.min_prepacked_rows(cpu_vendor())


def test_cpu_vendor_reads_proc_cpuinfo_or_the_platform(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert cpu_vendor(cpuinfo) == "AuthenticAMD"
    # where there is no /proc/cpuinfo, Windows names the vendor in platform.processor()
    missing = tmp_path / "none"
    for processor, vendor in [
        ("AMD64 Family 25 Model 17 Stepping 1, AuthenticAMD", "AuthenticAMD"),
        ("Intel64 Family 6 Model 85 Stepping 7, GenuineIntel", "GenuineIntel"),
        ("arm", ""),
    ]:
        monkeypatch.setattr(device_module.platform, "processor", lambda processor=processor: processor)
        assert cpu_vendor(missing) == vendor, f"platform.processor() {processor!r}"


def test_a_changed_weight_is_never_read_stale():
    lin, x = layer(bias=False), torch.randn(16, 96)
    with torch.inference_mode():
        lin(x)  # makes the copy
    with torch.no_grad():
        lin.weight.mul_(2.0)  # written in place: the same tensor, a new version
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), atol=1e-5, rtol=1e-5)
    lin.weight = torch.nn.Parameter(torch.randn(160, 96))  # another tensor
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), atol=1e-5, rtol=1e-5)


def test_state_dict_names_are_nn_linear_s():
    assert set(layer(bias=True).state_dict()) == {"weight", "bias"}, "checkpoints load by nn.Linear's names"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 64, 130])
def test_group_equals_each_layer(rows, bias):
    layers, x = group(bias), torch.randn(rows, 96)
    with torch.inference_mode():
        got = linear_group(x, layers, PackedWeight())
    assert [g.shape for g in got] == [(rows, lin.out_features) for lin in layers]
    for i, (g, lin) in enumerate(zip(got, layers)):
        torch.testing.assert_close(g, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5, msg=f"layer {i}")


@needs_onednn
def test_group_is_one_prepacked_product():
    layers, packed = group(bias=True), PackedWeight()
    with torch.inference_mode():
        linear_group(torch.randn(MIN_PREPACKED_ROWS, 96), layers, packed)
    assert packed.packed is not None, "no stacked prepacked copy after a product of MIN_PREPACKED_ROWS rows"
    assert all(lin.packed.packed is None for lin in layers), "the group ran layer by layer, not as one product"


def test_a_changed_weight_in_a_group_is_never_read_stale():
    layers, packed, x = group(bias=False), PackedWeight(), torch.randn(16, 96)
    with torch.inference_mode():
        linear_group(x, layers, packed)  # makes the stacked copy
    with torch.no_grad():
        layers[2].weight.mul_(2.0)  # the last of the three, in place
    with torch.inference_mode():
        got = linear_group(x, layers, packed)
    torch.testing.assert_close(got[2], F.linear(x, layers[2].weight), atol=1e-5, rtol=1e-5)
    layers[1].weight = torch.nn.Parameter(torch.randn(48, 96))  # another tensor
    with torch.inference_mode():
        got = linear_group(x, layers, packed)
    torch.testing.assert_close(got[1], F.linear(x, layers[1].weight), atol=1e-5, rtol=1e-5)
