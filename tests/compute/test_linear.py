"""`omni.compute.models._linear`: float32 CPU linears through oneDNN at a bounded set of row
counts, equal to `F.linear` to float32 rounding; everything else on `F.linear` itself. The
oneDNN path is the default on AMD CPUs only; these tests turn it on wherever they run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omni.compute.models import _linear
from omni.compute.models._linear import CHUNK_ROWS, MIN_WEIGHT_ELEMENTS, Linear, linear, padded_rows

needs_onednn = pytest.mark.skipif(not _linear._ONEDNN, reason="this torch has no oneDNN")

IN, OUT = 512, 768  # >= MIN_WEIGHT_ELEMENTS: the oneDNN path


@pytest.fixture(autouse=True)
def onednn_preferred():
    """The oneDNN path on, whatever this CPU's default; the default back afterwards."""
    _linear.prefer_onednn(True)
    yield
    _linear.prefer_onednn(None)


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


@pytest.mark.parametrize(("vendor", "expected"), [("AuthenticAMD", True),
                                                  ("GenuineIntel", False), (None, False)])
def test_onednn_is_the_default_on_amd_cpus_only(tmp_path, vendor, expected) -> None:
    """MKL's sgemm is the faster on Intel's CPUs, oneDNN on AMD's (perf/cpu_linear.py); no
    vendor line (another architecture) or no /proc/cpuinfo: MKL, torch's own choice."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\n" + (f"vendor_id\t: {vendor}\n" if vendor else "")
                       + "model name\t: a CPU\n")
    assert _linear.onednn_by_default(cpuinfo) is expected
    assert _linear.onednn_by_default(tmp_path / "missing") is False
    assert _linear.cpuinfo_field("model name", cpuinfo) == "a CPU"
    assert _linear.cpuinfo_field("flags", cpuinfo) is None


@needs_onednn
def test_prefer_onednn_switches_the_path_and_none_restores_the_default(
        onednn_calls: list[int]) -> None:
    weight, x = torch.randn(OUT, IN), torch.randn(3, IN)
    with torch.inference_mode():
        _linear.prefer_onednn(False)
        linear(x, weight)
        assert onednn_calls == []
        _linear.prefer_onednn(True)
        linear(x, weight)
        assert onednn_calls == [3]
        _linear.prefer_onednn(None)
        linear(x, weight)
    assert len(onednn_calls) == (2 if _linear.onednn_by_default() else 1)
