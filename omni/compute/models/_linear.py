"""`Linear`: `nn.Linear` whose float32 inference on the CPU runs on the faster of three paths.

On the CPU, `F.linear` in float32 is one MKL sgemm call, which packs the weight into MKL's
internal layout on every call. For a weight of `MIN_WEIGHT_ELEMENTS` (512 x 512) and up:

- **"mkl_packed"** (the default on Intel's and other non-AMD CPUs): the weight is packed once,
  at its first use, into MKL's packed layout (``torch.ops.mkl._mkl_reorder_linear_weight``,
  what torch.compile's freezing uses), and each call is one ``cblas_sgemm_compute`` on it.
  Measured on an Intel Xeon (Ice Lake, AVX-512, 2 threads) on the four linears of a layer of
  ``perf/prefix_reuse.py``'s model against plain sgemm: 0.97x at 1 row (sgemv), 1.03-1.07x
  at 2, 1.5x at 4-8, 1.4-2.6x at 16-64, 1.2-1.3x at 128-256, 1.1x at 512, 1.03-1.06x at
  768-1,024, 0.98x at 1,936; a whole 208-token prefill over 1,728 cached tokens 1.10-1.12x.
  So it is used from 2 rows to `PACKED_MAX_ROWS` (`packed_rows`), plain sgemm at 1 row and
  above.
  - Cost: the packed copy, about the weight's size again (6.5 MB for a 3,072 x 512 weight),
    kept next to the weight (which the state dict, autograd and other devices still use).
  - A packed weight serves calls of any row count. torch's op only uses a pack for the row
    count it names, so each call names its own; that MKL's layout of a packed weight does
    not depend on the other operand's row count is checked at the first pack of each weight
    shape, against `F.linear` at a few row counts (on a mismatch, a warning and plain sgemm
    for that shape from then on), and by the tests at every row count to 256 and at every
    17th up to `PACKED_MAX_ROWS`.
  - A weight is packed again when it changes: another tensor, or an in-place change (its
    version counter). Not seen: a change through ``weight.data``, which bypasses the counter,
    and an in-place change of a weight made in inference mode, which has none.
- **"onednn"** (the default on AMD CPUs, where MKL does not pick its fastest kernels): oneDNN's
  inner product on the plain weight (no second copy). Measured on an AVX-512 AMD EPYC, against
  plain sgemm: the linears of a layer 1.34x at 208 rows, 1.19x at 1,936, 1.4-1.9x at 1-4 rows;
  a 208-token prefill over 1,728 cached tokens 1.19x, a decode step 1.44x. On the Intel Xeon it
  was the slower: a decode step at 0.79x, a 1,936-token prefill at 0.81x.
  - A oneDNN call costs ~14 us more than an MKL one; below `MIN_WEIGHT_ELEMENTS` MKL was the
    faster at 1-208 rows (e.g. 0.2-0.8x at 64 x 128).
  - oneDNN builds (JIT-compiles) one kernel per input shape, ~0.8 ms and ~0.7 MB each, and
    keeps 1,024. Prompts of every length would fill that cache and pay the build on most
    prefills, so the rows go in at a bounded set of sizes: up to 8 rows as they are (decode);
    up to `CHUNK_ROWS`, padded with zero rows to the next multiple of 8 (to 64), of 16 (to
    `CHUNK_ROWS`): at most 7.7% more rows at 208; more rows in chunks of `CHUNK_ROWS`, written
    into one output. At most 27 kernels per weight shape. A padded row's output is dropped.
- **"mkl"**: plain `F.linear`, torch's own choice.

`set_cpu_linear_backend` picks one for this process (None: back to this CPU's default,
`default_cpu_linear_backend`). Everything else goes to `F.linear` unchanged: small weights,
other dtypes (torch already runs bfloat16 through oneDNN), other devices, autograd, a torch
without the backend's op, and ``torch.backends.mkldnn.enabled = False`` for the oneDNN path.
Results equal plain sgemm's to float32 rounding (~1e-6 relative), not bit for bit.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BACKENDS", "CHUNK_ROWS", "MIN_WEIGHT_ELEMENTS", "PACKED_MAX_ROWS", "Linear",
           "PackedWeight", "cpu_linear_backend", "cpuinfo_field", "default_cpu_linear_backend",
           "linear", "packed_rows", "padded_rows", "set_cpu_linear_backend"]

log = logging.getLogger(__name__)

BACKENDS = ("mkl_packed", "onednn", "mkl")
CHUNK_ROWS = 256  # rows per oneDNN call at most; as fast per row as 2k rows
MIN_WEIGHT_ELEMENTS = 1 << 18  # smaller weights stay on plain sgemm
PACKED_MAX_ROWS = 1024  # above this, plain sgemm was as fast or faster (see the module)
_PACK_ROWS = 256  # the row count a weight is packed for (any row count then uses it)
_CHECK_ROWS = (1, 5, 37)  # row counts the first pack is checked at against F.linear

_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_ONEDNN = _onednn_linear is not None and torch.backends.mkldnn.is_available()
_mkl_pack = getattr(torch.ops.mkl, "_mkl_reorder_linear_weight", None)
_mkl_packed_linear = getattr(torch.ops.mkl, "_mkl_linear", None)
_MKL_PACKED = (_mkl_pack is not None and _mkl_packed_linear is not None
               and torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available())
_packs_checked: dict[tuple[int, int], bool] = {}  # per weight shape: its first pack's check


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


def default_cpu_linear_backend(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This CPU's float32 linear path unless told otherwise: "onednn" on an AMD CPU (where
    MKL's sgemm is the slower), "mkl_packed" elsewhere (also where `cpuinfo` cannot be read)."""
    return "onednn" if cpuinfo_field("vendor_id", cpuinfo) == "AuthenticAMD" else "mkl_packed"


_DEFAULT = default_cpu_linear_backend()  # read once: the CPU does not change
_backend = _DEFAULT


def set_cpu_linear_backend(name: str | None) -> None:
    """Run float32 CPU linears on `name` (one of `BACKENDS`) from now on, in this process;
    None: back to this CPU's default (`default_cpu_linear_backend`)."""
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown CPU linear backend {name!r}: choose one of "
                         f"{', '.join(BACKENDS)} (or None for this CPU's default)")
    _backend = _DEFAULT if name is None else name


def cpu_linear_backend() -> str:
    """The float32 CPU linear path in use (see `set_cpu_linear_backend`)."""
    return _backend


def padded_rows(rows: int) -> int:
    """The row count (<= `CHUNK_ROWS`) a oneDNN call of `rows` rows runs at: a bounded set of
    sizes."""
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 16
    return -(-rows // step) * step


def packed_rows(rows: int) -> bool:
    """Whether a call of `rows` rows runs on the packed weight on the "mkl_packed" path (else
    plain sgemm, the faster there)."""
    return 2 <= rows <= PACKED_MAX_ROWS


def _fast_path(x: Tensor, weight: Tensor) -> bool:
    """Whether this call may leave `F.linear`: float32 inference on the CPU, a large weight."""
    return (weight.numel() >= MIN_WEIGHT_ELEMENTS and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.is_contiguous() and x.numel() > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


class PackedWeight:
    """The MKL-packed copy of one weight, made at first use and again when the weight changes
    (another tensor, or its version counter moved). Copies and pickles of it start empty.

    Threads may share it (engines on one model): the weight, its version and the copy are one
    tuple, replaced whole; two threads packing at once each use their own copy.
    """

    __slots__ = ("_entry",)

    def __init__(self) -> None:
        self._entry: tuple[weakref.ref[Tensor], int, Tensor] | None = None

    def __deepcopy__(self, memo: dict[int, object]) -> PackedWeight:
        return PackedWeight()

    def __reduce__(self) -> tuple[type[PackedWeight], tuple[()]]:
        return PackedWeight, ()

    def get(self, weight: Tensor) -> Tensor | None:
        """The packed copy of `weight`, or None where packing is not usable here."""
        version, entry = _version(weight), self._entry
        if entry is not None and entry[0]() is weight and entry[1] == version:
            return entry[2]
        self._entry = None  # the old copy goes before a new one is made
        packed = _pack(weight)
        if packed is not None:
            self._entry = (weakref.ref(weight), version, packed)
        return packed


def _version(weight: Tensor) -> int:
    """The weight's version counter; -1 for a tensor made in inference mode, which has none."""
    return -1 if weight.is_inference() else weight._version


def _pack(weight: Tensor) -> Tensor | None:
    """`weight` in MKL's packed layout; None where the first pack of its shape gave other
    results than `F.linear` (`_pack_works`)."""
    shape = (weight.shape[0], weight.shape[1])
    if _packs_checked.get(shape) is False:
        return None
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, kept across modes
        packed = _mkl_pack(weight, _PACK_ROWS)
        if shape not in _packs_checked:
            _packs_checked[shape] = _pack_works(weight, packed)
            if not _packs_checked[shape]:
                log.warning("MKL's packed %d x %d weights gave other results than F.linear "
                            "here: their float32 CPU linears use plain sgemm instead", *shape)
                return None
    return packed


def _pack_works(weight: Tensor, packed: Tensor) -> bool:
    """Whether `packed` gives `F.linear`'s results, to float32 rounding, at a few row counts
    other than the one it was packed for."""
    generator = torch.Generator().manual_seed(0)
    for rows in _CHECK_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=generator)
        got = torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)
        if not torch.allclose(got, F.linear(x, weight), rtol=1e-4, atol=1e-5):
            return False
    return True


def _onednn_rows(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, in] (M <= CHUNK_ROWS) -> [M, out], run at `padded_rows(M)` rows."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
    return _onednn_linear(x, weight, bias, "none", [], "")[:rows]


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= CHUNK_ROWS:
        out = _onednn_rows(rows, weight, bias)
    else:
        out = rows.new_empty(rows.shape[0], weight.shape[0])
        for start in range(0, rows.shape[0], CHUNK_ROWS):
            chunk = rows[start: start + CHUNK_ROWS]
            out[start: start + chunk.shape[0]] = _onednn_rows(chunk, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           packed: PackedWeight | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` on this CPU's faster path (see the module). The
    "mkl_packed" path needs `packed`, where the weight's packed copy is kept; without it,
    plain sgemm."""
    if _backend == "mkl" or not _fast_path(x, weight):
        return F.linear(x, weight, bias)
    if _backend == "onednn":
        if _ONEDNN and torch._C._get_mkldnn_enabled():
            return _onednn(x, weight, bias)
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if packed is not None and _MKL_PACKED and packed_rows(rows) and (
            bias is None or bias.dtype == torch.float32):
        packed_weight = packed.get(weight)
        if packed_weight is not None:
            return _mkl_packed_linear(x, packed_weight, weight, bias, rows)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state dict) that runs through `linear`, keeping
    its weight's packed copy where the "mkl_packed" path makes one."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.packed)
