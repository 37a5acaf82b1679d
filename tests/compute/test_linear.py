"""`omni.compute.models._linear`: float32 CPU linears on MKL with packed weights (any row count
on one packed copy, repacked when the weight changes) or through oneDNN at a bounded set of
row counts, both equal to `F.linear` to float32 rounding; everything else on `F.linear`
itself. Each test picks the path it tests, whatever this CPU's default."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omni.compute.models import _linear
from omni.compute.models._linear import (
    CHUNK_ROWS,
    MIN_WEIGHT_ELEMENTS,
    PACKED_MAX_ROWS,
    Linear,
    PackedWeight,
    linear,
    padded_rows,
    set_cpu_linear_backend,
)

needs_onednn = pytest.mark.skipif(not _linear._ONEDNN, reason="this torch has no oneDNN")
needs_mkl_packed = pytest.mark.skipif(not _linear._MKL_PACKED,
                                      reason="this torch has no MKL packed sgemm")

IN, OUT = 512, 768  # >= MIN_WEIGHT_ELEMENTS: the fast paths


@pytest.fixture(autouse=True)
def onednn_preferred():
    """The oneDNN path on, whatever this CPU's default; the default back afterwards."""
    set_cpu_linear_backend("onednn")
    yield
    set_cpu_linear_backend(None)


@pytest.fixture
def packed_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The MKL packed path on, no weight shape checked yet; the row count of every packed call
    made while the test runs (the first-pack checks aside)."""
    set_cpu_linear_backend("mkl_packed")
    monkeypatch.setattr(_linear, "_packs_checked", {})
    calls: list[int] = []
    real = _linear._mkl_packed_linear

    def spy(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        calls.append(rows)
        return real(x, packed, weight, bias, rows)

    monkeypatch.setattr(_linear, "_mkl_packed_linear", spy)
    return calls


@pytest.fixture
def onednn_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every oneDNN call made while the test runs."""
    calls: list[int] = []
    real = _linear._onednn_linear

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(_linear, "_onednn_linear", spy)
    return calls


def test_padded_row_counts_are_a_small_bounded_set_never_below_the_rows() -> None:
    sizes = {padded_rows(rows) for rows in range(1, CHUNK_ROWS + 1)}
    assert all(padded_rows(rows) >= rows for rows in range(1, CHUNK_ROWS + 1))
    assert max(sizes) == CHUNK_ROWS and len(sizes) == 27
    assert [padded_rows(r) for r in (1, 8, 9, 64, 65, 208, 209)] == [1, 8, 16, 64, 80, 208, 224]


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 63, 200, 208, CHUNK_ROWS, CHUNK_ROWS + 1, 700])
def test_it_equals_f_linear_at_every_row_count(rows: int, onednn_calls: list[int]) -> None:
    torch.manual_seed(rows)
    weight, bias = torch.randn(OUT, IN) / IN**0.5, torch.randn(OUT)
    x = torch.randn(2, rows, IN)
    with torch.inference_mode():
        out = linear(x, weight, bias)
        expected = F.linear(x, weight, bias)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # 2 x rows rows in chunks of CHUNK_ROWS, each run at its padded size
    total, chunks = 2 * rows, []
    while total > 0:
        chunks.append(padded_rows(min(total, CHUNK_ROWS)))
        total -= CHUNK_ROWS
    assert onednn_calls == chunks


@needs_onednn
def test_a_padded_call_leaves_the_real_rows_unchanged(onednn_calls: list[int]) -> None:
    """Row i's output is the same whether the call had 200 rows (padded to 208) or one."""
    weight = torch.randn(OUT, IN) / IN**0.5
    x = torch.randn(200, IN)
    with torch.inference_mode():
        batch = linear(x, weight)
        alone = torch.cat([linear(x[i: i + 1], weight) for i in (0, 99, 199)])
    assert onednn_calls[0] == 208
    torch.testing.assert_close(batch[[0, 99, 199]], alone, rtol=1e-5, atol=1e-5)


def test_small_weights_other_dtypes_and_switched_off_onednn_are_plain_f_linear(
        onednn_calls: list[int]) -> None:
    x = torch.randn(5, 64)
    small = torch.randn(MIN_WEIGHT_ELEMENTS // 64 - 1, 64)
    big = torch.randn(OUT, IN)
    with torch.inference_mode():
        assert torch.equal(linear(x, small), F.linear(x, small))
        xb, wb = torch.randn(5, IN, dtype=torch.bfloat16), big.to(torch.bfloat16)
        assert torch.equal(linear(xb, wb), F.linear(xb, wb))
        torch.backends.mkldnn.enabled = False
        try:
            xf = torch.randn(5, IN)
            assert torch.equal(linear(xf, big), F.linear(xf, big))
        finally:
            torch.backends.mkldnn.enabled = True
    assert onednn_calls == []


def test_gradients_flow_through_f_linear(onednn_calls: list[int]) -> None:
    layer, reference = Linear(IN, OUT), nn.Linear(IN, OUT)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(3, IN)
    layer(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert onednn_calls == []
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)


def test_linear_keeps_nn_linears_parameters_and_state_dict() -> None:
    layer = Linear(IN, OUT, bias=False)
    assert isinstance(layer, nn.Linear)
    assert list(layer.state_dict()) == list(nn.Linear(IN, OUT, bias=False).state_dict())


@pytest.mark.parametrize(("vendor", "expected"), [("AuthenticAMD", "onednn"),
                                                  ("GenuineIntel", "mkl_packed"),
                                                  (None, "mkl_packed")])
def test_onednn_is_the_default_on_amd_cpus_only(tmp_path, vendor, expected) -> None:
    """MKL is the faster on Intel's CPUs with packed weights, oneDNN on AMD's
    (perf/cpu_linear.py); no vendor line (another architecture) or no /proc/cpuinfo: MKL."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\n" + (f"vendor_id\t: {vendor}\n" if vendor else "")
                       + "model name\t: a CPU\n")
    assert _linear.default_cpu_linear_backend(cpuinfo) == expected
    assert _linear.default_cpu_linear_backend(tmp_path / "missing") == "mkl_packed"
    assert _linear.cpuinfo_field("model name", cpuinfo) == "a CPU"
    assert _linear.cpuinfo_field("flags", cpuinfo) is None


@needs_onednn
@needs_mkl_packed
def test_the_backend_switches_the_path_and_none_restores_the_default(
        onednn_calls: list[int], packed_calls: list[int]) -> None:
    layer, x = Linear(IN, OUT), torch.randn(3, IN)
    with torch.inference_mode():
        for backend in ("mkl", "onednn", "mkl_packed"):
            set_cpu_linear_backend(backend)
            assert _linear.cpu_linear_backend() == backend
            layer(x)
        assert (onednn_calls, packed_calls) == ([3], [3])
        set_cpu_linear_backend(None)
        assert _linear.cpu_linear_backend() == _linear.default_cpu_linear_backend()
        layer(x)
    assert len(onednn_calls) + len(packed_calls) == 3


def test_an_unknown_backend_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'mkl-packed'.*mkl_packed, onednn, mkl"):
        set_cpu_linear_backend("mkl-packed")
    assert _linear.cpu_linear_backend() == "onednn"  # unchanged


# -- MKL with packed weights ---------------------------------------------------------------


@needs_mkl_packed
def test_one_packed_copy_serves_every_row_count_it_is_used_at(packed_calls: list[int]) -> None:
    """MKL's packed layout does not depend on the other operand's rows, which torch's op
    assumes it does: each call names its own row count, and every one from 2 to
    PACKED_MAX_ROWS tried gives F.linear's result on the one copy (every count to 256, then
    every 17th; 1 row, and more than PACKED_MAX_ROWS, are plain sgemm: faster there)."""
    torch.manual_seed(0)
    layer = Linear(IN, OUT)
    x = torch.randn(PACKED_MAX_ROWS + 1, IN)
    counts = [*range(1, 257), *range(257, PACKED_MAX_ROWS, 17), PACKED_MAX_ROWS,
              PACKED_MAX_ROWS + 1]
    with torch.inference_mode():
        for rows in counts:
            torch.testing.assert_close(layer(x[:rows]), F.linear(x[:rows], layer.weight,
                                                                layer.bias),
                                       rtol=1e-5, atol=1e-5, msg=f"at {rows} rows")
    assert packed_calls == counts[1:-1]


@needs_mkl_packed
def test_the_first_pack_of_each_shape_is_checked_against_f_linear_at_other_row_counts(
        packed_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[tuple[int, ...]] = []
    real = _linear._pack_works

    def spy(weight: torch.Tensor, packed: torch.Tensor) -> bool:
        checked.append(tuple(weight.shape))
        return real(weight, packed)

    monkeypatch.setattr(_linear, "_pack_works", spy)
    layers = [Linear(IN, OUT), Linear(IN, OUT), Linear(OUT, IN)]
    with torch.inference_mode():
        for layer in layers:  # once per weight shape, not per weight
            layer(torch.randn(4, layer.in_features))
    assert checked == [(OUT, IN), (IN, OUT)]
    assert _linear._packs_checked == {(OUT, IN): True, (IN, OUT): True}
    assert packed_calls == [4, 4, 4]


@needs_mkl_packed
def test_a_weight_is_packed_once_and_again_after_it_changes(
        packed_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    packs: list[tuple[int, ...]] = []
    real = _linear._mkl_pack

    def spy(weight: torch.Tensor, rows: int) -> torch.Tensor:
        packs.append(tuple(weight.shape))
        return real(weight, rows)

    monkeypatch.setattr(_linear, "_mkl_pack", spy)
    layer, x = Linear(IN, OUT), torch.randn(3, 5, IN)  # 15 rows, a 3-d input
    with torch.inference_mode():
        first = layer(x)
        layer(x)
        assert len(packs) == 1 and packed_calls == [15, 15]
        with torch.no_grad():  # in place: the version counter moves
            layer.weight.mul_(2)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
        assert len(packs) == 2
        layer.load_state_dict({"weight": torch.randn(OUT, IN) / IN**0.5,
                               "bias": torch.zeros(OUT)})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
        assert len(packs) == 3
    layer.weight = nn.Parameter(torch.randn(OUT, IN) / IN**0.5)  # another tensor
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
        assert len(packs) == 4
    assert first.shape == (3, 5, OUT)


@needs_mkl_packed
def test_a_model_with_packed_weights_copies_and_pickles(packed_calls: list[int]) -> None:
    """The packed copy (an opaque tensor) is not copied along: a copy packs its own."""
    import copy
    import pickle

    layer, x = Linear(IN, OUT), torch.randn(6, IN)
    with torch.inference_mode():
        out = layer(x)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert isinstance(clone.packed, PackedWeight)
        with torch.inference_mode():
            torch.testing.assert_close(clone(x), out)
    assert packed_calls == [6, 6, 6]


@needs_mkl_packed
def test_a_failed_first_check_falls_back_to_plain_sgemm_with_a_warning(
        packed_calls: list[int], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(_linear, "_pack_works", lambda weight, packed: False)
    layer, x = Linear(IN, OUT), torch.randn(6, IN)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert packed_calls == []
    assert "plain sgemm" in caplog.text


@needs_mkl_packed
def test_the_packed_path_leaves_autograd_small_weights_and_weightless_calls_to_f_linear(
        packed_calls: list[int]) -> None:
    layer, reference = Linear(IN, OUT), nn.Linear(IN, OUT)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(3, IN)
    layer(x).square().sum().backward()  # grad mode, weight requires grad
    reference(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)
    small = Linear(64, 64)
    with torch.inference_mode():
        small(torch.randn(4, 64))
        linear(torch.randn(4, IN), layer.weight)  # no PackedWeight to keep a copy in
    assert packed_calls == []


@needs_mkl_packed
def test_a_weight_made_in_inference_mode_is_packed_too(packed_calls: list[int]) -> None:
    """A model loaded under torch.inference_mode() has weights without a version counter;
    they are packed all the same (kept while the weight is the same tensor)."""
    with torch.inference_mode():
        layer = Linear(IN, OUT)
        x = torch.randn(5, IN)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
        layer(x)
    assert packed_calls == [5, 5]
