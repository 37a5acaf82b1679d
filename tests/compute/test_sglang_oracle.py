"""The conformance table and Omni's sampler against SGLang's own code, where sglang imports.

Runs only where `sglang` is importable (the table itself is always tested against Omni, in
test_sglang_conformance.py); ``python -m tests.compute.sglang_oracle`` runs the same check.
"""

import pytest

pytest.importorskip("sglang.srt.sampling.sampling_params")

from tests.compute import sglang_oracle
from tests.compute.sglang_conformance import PARAM_ROWS, SAMPLING_ROWS, STOP_ROWS


def test_every_table_row_and_random_rows_agree_with_sglang():
    checked, failures = sglang_oracle.run(num_random=200)
    assert failures == []
    assert checked == len(PARAM_ROWS) + len(SAMPLING_ROWS) + len(STOP_ROWS) + 400
