"""The kernel-selection table's environment override (MTLQWEN_SELECT), used to try a row on the device."""

from __future__ import annotations

import pytest

from mtlqwen.kernels.selection import SELECT, _apply_env_overrides, parse_rows, selected


def test_overrides_set_named_rows_and_refuse_anything_else():
    table = dict(SELECT)
    _apply_env_overrides(table, " gdn_state_inplace=0, qmv_mma_min_rows = 7 ,")
    assert table == {**SELECT, "gdn_state_inplace": 0, "qmv_mma_min_rows": 7}
    _apply_env_overrides(table, "")  # unset: nothing changes
    assert table["qmv_mma_min_rows"] == 7
    for bad in ("gdn_state_inplace", "no_such_row=1", "qmv_max_rows=eight", "=3", "qmv_max_rows=1.5"):
        with pytest.raises(ValueError, match="MTLQWEN_SELECT"):
            _apply_env_overrides(dict(SELECT), bad)


def test_parse_rows_names_its_source_and_refuses_unknown_rows():
    assert parse_rows("attn_min_split_keys=64, qmv_m1_rows=2") == {"attn_min_split_keys": 64, "qmv_m1_rows": 2}
    assert parse_rows("") == {}
    with pytest.raises(ValueError, match="--variants: 'qmv_m1_row=2'"):
        parse_rows("qmv_m1_row=2", source="--variants")


def test_selected_changes_rows_inside_the_block_only():
    before = dict(SELECT)
    with selected({"attn_min_split_keys": before["attn_min_split_keys"] + 1, "qmv_nibble_pairs": 0}):
        assert SELECT == {**before, "attn_min_split_keys": before["attn_min_split_keys"] + 1, "qmv_nibble_pairs": 0}
    assert SELECT == before
    with pytest.raises(RuntimeError), selected({"qmv_nibble_pairs": 0}):
        raise RuntimeError  # restored on an error too
    assert SELECT == before
    with pytest.raises(ValueError, match="unknown selection rows"), selected({"no_such_row": 1}):
        pass
    assert SELECT == before


def test_kv_inplace_is_a_row_of_the_table(monkeypatch):
    """The in-place KV write is switched by SELECT["kv_inplace"] (MTLQWEN_SELECT="kv_inplace=0" turns it
    off for a process); with the row off the op returns None (the caller scatters) without trying the kernel."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from mtlqwen.kernels import dispatch, write_kv_inplace  # noqa: PLC0415

    code = "from mtlqwen.kernels.selection import SELECT; print(SELECT['kv_inplace'])"
    env = {**__import__("os").environ, "MTLQWEN_SELECT": "kv_inplace=0"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout == "0\n"
    assert SELECT["kv_inplace"] == 1
    token, calls = object(), []
    with dispatch.inject("write_kv_inplace", lambda *a: calls.append(a) or token):
        assert write_kv_inplace(None, None, None, None, None, (1, 1, 32), None) is token
        monkeypatch.setitem(SELECT, "kv_inplace", 0)
        assert write_kv_inplace(None, None, None, None, None, (1, 1, 32), None) is None
    assert len(calls) == 1
