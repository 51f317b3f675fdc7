"""benchmarks/model_l2.py, the LRU model of the backward's DRAM traffic: with a cache that holds everything it
reads each row and key block once and writes each dq row back once (the compulsory traffic), a smaller cache never
moves less, and every order's plan covers the same entries."""

from __future__ import annotations

import pytest
import torch

from benchmarks.model_l2 import dram_bytes, main, random_selection


def _plan(order, sel, Bs=16, G=4, bins=40):
    from flash_msa_rt.ops.sparse_plan import chunk_plans

    (plan,), = chunk_plans(sel, Bs, G, sel.shape[1], sel.shape[2], ((4, 3),), order, bin_queries=bins).values()
    return plan


def test_random_selection_is_causal_with_the_own_block():
    sel = random_selection(2, 3, 200, 4, 16)
    own = (torch.arange(200) // 16).view(1, 1, 200, 1)
    assert sel.shape == (2, 3, 200, 4) and sel.dtype == torch.int32
    assert ((sel <= own) | (sel == -1)).all() and (sel[..., :1] == own).all()
    s = torch.sort(sel, dim=-1).values
    assert not ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any()  # distinct blocks per row


@pytest.mark.parametrize("order", ["list", "query", "bins"])
def test_model_bytes(order):
    G, D, Bs = 4, 8, 16
    sel = random_selection(1, 2, 300, 4, Bs)
    plan = _plan(order, sel, Bs, G)
    live = int((sel >= 0).sum())
    assert int(plan.items[:int(plan.item_count), 3].sum()) == live
    queries = {(bp, q) for bp in range(2) for q in range(300) if (sel[0, bp, q] >= 0).any()}
    blocks = {(int(i[0]), int(i[1])) for i in plan.items[:int(plan.item_count)]}
    whole = dram_bytes(plan, G, D, Bs, 1 << 40, 8, 2.0)
    assert whole["read_gb"]["q, dO rows"] * 1e9 == pytest.approx(len(queries) * 4 * G * D)
    assert whole["read_gb"]["dq rows"] * 1e9 == pytest.approx(len(queries) * 4 * G * D)
    assert whole["dq_written_gb"] * 1e9 == pytest.approx(len(queries) * 4 * G * D)
    assert whole["read_gb"]["key blocks"] * 1e9 == pytest.approx(len(blocks) * 4 * Bs * D)
    small = dram_bytes(plan, G, D, Bs, 20 * 4 * G * D, 8, 2.0)
    assert small["total_gb"] > whole["total_gb"]



def test_model_runs_on_block_halves(tmp_path, capsys):
    """--halves: the selection of blocks of 2 Bs reaches the plan as D 256's kernels take it (split_blocks)."""
    import json

    main(["--cfg", "a", "--seqlen", "512", "--block-size", "16", "--top-k", "64", "--halves", "--orders",
          "list,bins:128", "--out", str(tmp_path / "m.json")])
    r = json.loads((tmp_path / "m.json").read_text())
    assert r["halves"] and set(r["orders"]) == {"list", "bins:128"}
    assert r["orders"]["bins:128"]["items"] >= r["orders"]["list"]["items"] > 0
    assert "list:" in capsys.readouterr().out
