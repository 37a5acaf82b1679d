"""`Linear`: `nn.Linear` whose float32 inference on the CPU runs through oneDNN on AMD CPUs.

Why: on the CPU, `F.linear` in float32 is one MKL sgemm, and MKL picks its fastest kernels
only on Intel's CPUs. torch also ships oneDNN, whose inner-product kernels take the same
plain [out, in] weight (no packed copy, so no second copy of the weights in memory) and,
measured on an AVX-512 AMD EPYC with the 25 M-parameter model of ``perf/prefix_reuse.py``
(2 threads, paired runs), run:

- the four linears of a layer 1.34x faster at 208 rows, 1.19x at 1,936, 1.4-1.9x at 1-4 rows
  (decode, where the weights' memory traffic dominates);
- a whole 208-token prefill over 1,728 cached tokens 1.19x faster, a 1,936-token one 1.03x
  (attention, unchanged, is most of it), a decode step 1.44x.

On an Intel Xeon (AVX-512, same model and threads) MKL is the faster: oneDNN took a decode
step at 0.79x MKL's speed and a 1,936-token prefill at 0.81x, a reusing prefill at 1.0-1.1x.
So oneDNN is the default on AMD CPUs only (``vendor_id`` AuthenticAMD in /proc/cpuinfo);
`prefer_onednn` overrides that choice either way (``perf/cpu_linear.py`` measures both).

A oneDNN call costs ~14 us more than an MKL one, so a weight of fewer than
`MIN_WEIGHT_ELEMENTS` (512 x 512) stays on MKL: below that, MKL was faster at 1-208 rows
(e.g. 0.2-0.8x at 64 x 128); from it up, oneDNN was 1.05-1.8x at every row count measured
(on the EPYC).

oneDNN builds (JIT-compiles) one kernel per input shape, ~0.8 ms and ~0.7 MB each, and keeps
it in a cache of 1,024. Prompts of every length would fill that cache (~700 MB) and pay the
build on most prefills, so the rows are brought to a bounded set of sizes first, as CUDA
graphs are captured per batch-size bucket:

- up to 8 rows as they are (decode steps);
- up to `CHUNK_ROWS` rows, padded with zero rows to the next multiple of 8 (to 64), of 16
  (to `CHUNK_ROWS`): at most 7.7% more rows at 208, none at a multiple of 16;
- more rows in chunks of `CHUNK_ROWS` (as fast per row as one large call), the last one
  padded as above, written into one output.

That is at most 8 + 7 + 12 = 27 kernels per weight shape. A padded row is zeros and its output
is dropped: no row's result depends on another's.

Everything else goes to `F.linear` unchanged: other CPUs (above), small weights, other
dtypes (torch already runs bfloat16 through oneDNN), other devices, autograd (oneDNN's op has
no backward here), a torch without oneDNN, and ``torch.backends.mkldnn.enabled = False``,
which turns this path off.
Results equal MKL's to float32 rounding (~1e-6 relative), not bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["CHUNK_ROWS", "MIN_WEIGHT_ELEMENTS", "Linear", "cpuinfo_field", "linear",
           "onednn_by_default", "padded_rows", "prefer_onednn"]

CHUNK_ROWS = 256  # rows per oneDNN call at most; as fast per row as 2k rows
MIN_WEIGHT_ELEMENTS = 1 << 18  # smaller weights stay on MKL: oneDNN's ~14 us per call

_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_ONEDNN = _onednn_linear is not None and torch.backends.mkldnn.is_available()


def cpuinfo_field(name: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The value of the first ``name : value`` line of `cpuinfo` (Linux's /proc/cpuinfo), or
    None where there is no such line or no file."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


def onednn_by_default(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU's float32 linears go through oneDNN unless told otherwise: on an AMD
    CPU (where MKL's sgemm is the slower); elsewhere, or where `cpuinfo` cannot be read, no."""
    return cpuinfo_field("vendor_id", cpuinfo) == "AuthenticAMD"


_DEFAULT = onednn_by_default()  # read once: the CPU does not change
_prefer = _DEFAULT


def prefer_onednn(enabled: bool | None) -> None:
    """Send float32 CPU linears through oneDNN (True) or MKL (False) from now on, in this
    process; None: back to this CPU's default (`onednn_by_default`)."""
    global _prefer
    _prefer = _DEFAULT if enabled is None else bool(enabled)


def padded_rows(rows: int) -> int:
    """The row count (<= `CHUNK_ROWS`) a call of `rows` rows runs at: a bounded set of sizes."""
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 16
    return -(-rows // step) * step


def _uses_onednn(x: Tensor, weight: Tensor) -> bool:
    return (_ONEDNN and _prefer and weight.numel() >= MIN_WEIGHT_ELEMENTS
            and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.is_contiguous()
            and x.numel() > 0 and torch._C._get_mkldnn_enabled()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _onednn_rows(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, in] (M <= CHUNK_ROWS) -> [M, out], run at `padded_rows(M)` rows."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
    return _onednn_linear(x, weight, bias, "none", [], "")[:rows]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN where that is the faster (see the
    module)."""
    if not _uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= CHUNK_ROWS:
        out = _onednn_rows(rows, weight, bias)
    else:
        out = rows.new_empty(rows.shape[0], weight.shape[0])
        for start in range(0, rows.shape[0], CHUNK_ROWS):
            chunk = rows[start: start + CHUNK_ROWS]
            out[start: start + chunk.shape[0]] = _onednn_rows(chunk, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state dict) that runs through `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
