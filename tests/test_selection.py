"""The kernel-selection table's environment override (MTLQWEN_SELECT), used to try a row on the device."""

from __future__ import annotations

import pytest

from mtlqwen.kernels.selection import SELECT, _apply_env_overrides


def test_overrides_set_named_rows_and_refuse_anything_else():
    table = dict(SELECT)
    _apply_env_overrides(table, " gdn_state_inplace=0, qmv_mma_min_rows = 7 ,")
    assert table == {**SELECT, "gdn_state_inplace": 0, "qmv_mma_min_rows": 7}
    _apply_env_overrides(table, "")  # unset: nothing changes
    assert table["qmv_mma_min_rows"] == 7
    for bad in ("gdn_state_inplace", "no_such_row=1", "qmv_max_rows=eight", "=3", "qmv_max_rows=1.5"):
        with pytest.raises(ValueError, match="MTLQWEN_SELECT"):
            _apply_env_overrides(dict(SELECT), bad)
