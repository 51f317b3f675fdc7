"""flash_msa_rt.integrations.transformers against transformers' own MiniMax-M3, on the CPU reference in float32.

A small random-weight M3 (tests/m3_transformers.py: a sparse layer with its indexer, a full-attention layer, a
dense MLP and a MoE), 64-token blocks over 256 to 512 tokens:
- attn_implementation="flash_msa": logits and every parameter's gradient equal the model's "sdpa" path (its
  (B, H, S, S) block mask) within float32 rounding;
- the blocks flash-msa selects from the indexer's idx_q / idx_k equal the indexer's own except near ties
  (counted);
- training mode (enable_msa_training): sparse equals the "sdpa" path (index_local_blocks 1 and 2), warmup equals
  dense attention, proxy_scale / local_blocks reach flash_msa_func, the KL trains the indexer only, and a packed
  batch (position_ids restarting per document) equals each document alone.
The GPU forms are in test_transformers_m3_gpu.py.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.minimax_m3_vl", reason="the [transformers] extra is not installed")

import flash_msa_rt  # noqa: E402
import flash_msa_rt.integrations.transformers as fmt  # noqa: E402
from tests.m3_transformers import m3_config, m3_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ATOL = 2e-5  # float32 logits / gradients of O(1): summation order only
SPARSE = 0  # the sparse layer of m3_config's pattern


@pytest.fixture(autouse=True)
def _quiet_reference():
    with warnings.catch_warnings():  # the CPU reference's once-per-process notice
        warnings.filterwarnings("ignore", message=".*pure-PyTorch reference.*")
        yield


def _tokens(B, S, seed=1, vocab=256):
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def _lm_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def _step(model, ids, position_ids=None, extra_loss=None, lm_loss=_lm_loss):
    """Logits and every parameter's gradient of the summed LM loss (+ extra_loss(logits))."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, position_ids=position_ids).logits
    loss = lm_loss(logits, ids)
    if extra_loss is not None:
        loss = loss + extra_loss(logits)
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(a, b, what, atol=ATOL):
    err = (a - b).abs().max().item()
    assert err <= atol * max(1.0, b.abs().max().item()), f"{what}: max |diff| {err:.3g}"


def _assert_grads_equal(got, want, names=None):
    names = sorted(want) if names is None else names
    assert set(names) <= set(got), f"missing gradients: {sorted(set(names) - set(got))}"
    for n in names:
        _assert_close(got[n], want[n], f"grad of {n}")


def _sparse_layer(model):
    return model.model.layers[SPARSE].self_attn


# --- attn_implementation="flash_msa" -----------------------------------------------------------------------------

def test_flash_msa_equals_the_sdpa_path_logits_and_every_gradient():
    model = m3_model()
    ids = _tokens(2, 256)
    logits_sdpa, grads_sdpa = _step(model, ids)
    fmt.use_flash_msa(model)
    assert model.config._attn_implementation == "flash_msa"
    logits, grads = _step(model, ids)
    _assert_close(logits, logits_sdpa, "logits")
    assert set(grads) == set(grads_sdpa)  # the indexer has no gradient in either (a selection only)
    _assert_grads_equal(grads, grads_sdpa)


def test_the_alias_loads_through_transformers_own_setter():
    model = m3_model(m3_config(attn_implementation=fmt.ALIAS))
    ids = _tokens(1, 256)
    logits = model(ids).logits
    model.set_attn_implementation("sdpa")
    _assert_close(logits.detach(), model(ids).logits.detach(), "logits")


def test_flash_msa_compiles_fullgraph():
    model = fmt.use_flash_msa(m3_model(m3_config(mlp_layer_types=("dense", "dense"))))
    ids = _tokens(1, 256)
    want = model(ids).logits.detach()
    compiled = torch.compile(lambda x: model(x).logits, fullgraph=True, backend="aot_eager")
    got = compiled(ids)
    got.sum().backward()
    _assert_close(got.detach(), want, "compiled logits")
    assert _sparse_layer(model).q_proj.weight.grad is not None


# --- selection -----------------------------------------------------------------------------------------------------

def _indexer_inputs(model, ids):
    """The sparse layer's indexer inputs (its normed hidden states and position embeddings) from a hook."""
    seen = {}
    attn = _sparse_layer(model)

    def grab(module, args, kwargs):
        seen["hidden"], seen["pos"] = kwargs["hidden_states"], kwargs["position_embeddings"]

    handle = attn.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(ids)
    handle.remove()
    return attn.indexer, seen["hidden"], seen["pos"]


def _block_scores(idx_q, idx_k, block_size):
    """M3's block scores: unscaled fp32 dot products, causal, max over each block's keys (B, Hp, S, nb)."""
    S = idx_q.shape[2]
    s = idx_q.double() @ idx_k.double().transpose(-1, -2)
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    nb = -(-S // block_size)
    s = torch.nn.functional.pad(s, (0, nb * block_size - S), value=float("-inf"))
    return s.view(*s.shape[:3], nb, block_size).amax(-1)


def _as_sets(indices):
    return [set(row) - {-1} for row in indices.flatten(0, 2).tolist()]


def test_selected_blocks_equal_the_indexers_except_near_ties():
    model = m3_model(m3_config(topk_blocks=3))
    ids = _tokens(2, 512, seed=3)
    indexer, hidden, pos = _indexer_inputs(model, ids)
    position_ids = torch.arange(512).expand(2, -1)
    with torch.no_grad():
        theirs = indexer(hidden, pos, None, position_ids)
        idx_q, idx_k = fmt.indexer_proxy(indexer, hidden, pos)
    ours = flash_msa_rt.select_blocks(idx_q, idx_k, indexer.topk_blocks * indexer.block_size,
                                      block_size=indexer.block_size)
    scores = _block_scores(idx_q, idx_k, indexer.block_size).flatten(0, 2)
    rows = list(zip(_as_sets(ours), _as_sets(theirs)))
    differing = [r for r, (a, b) in enumerate(rows) if a != b]
    for r in differing:  # a swap between two blocks whose scores agree to rounding
        a, b = rows[r]
        gap = (scores[r, sorted(a - b)].min() - scores[r, sorted(b - a)].max()).abs().item()
        assert gap <= 1e-4 * scores[r][scores[r].isfinite()].abs().max().item(), (r, a, b, gap)
    print(f"selection: {len(differing)} of {len(rows)} rows differ, every one a near tie")
    assert len(differing) <= len(rows) // 100


# --- training mode -------------------------------------------------------------------------------------------------

def _main_parameters(grads):
    return sorted(n for n in grads if ".indexer." not in n)


def test_training_sparse_equals_the_sdpa_path():
    model = m3_model()
    ids = _tokens(2, 256)
    logits_sdpa, grads_sdpa = _step(model, ids)
    msa = fmt.enable_msa_training(model, mode="sparse", kl_value="exact")
    logits, grads = _step(model, ids)
    _assert_close(logits, logits_sdpa, "logits")
    _assert_grads_equal(grads, grads_sdpa, _main_parameters(grads_sdpa))
    assert not [n for n in grads if ".indexer." in n]  # the LM loss alone does not reach the indexer
    assert msa.kl_loss().item() > 0


def test_training_warmup_equals_dense_attention():
    model = m3_model()
    ids = _tokens(1, 256)
    _sparse_layer(model).indexer.topk_blocks = 4  # every block of 256 tokens: the sdpa path turns dense
    logits_dense, grads_dense = _step(model, ids)
    _sparse_layer(model).indexer.topk_blocks = 2
    fmt.enable_msa_training(model, mode="warmup")
    logits, grads = _step(model, ids)
    _assert_close(logits, logits_dense, "logits")
    _assert_grads_equal(grads, grads_dense, _main_parameters(grads_dense))


def test_the_kl_trains_the_indexer_only_and_deferred_writes_the_metric():
    model = m3_model()
    ids = _tokens(1, 256)
    msa = fmt.enable_msa_training(model, mode="sparse", kl_value="exact")
    exact = _step(model, ids, extra_loss=lambda _: msa.kl_loss())[1]
    kl_exact = msa.kl_loss().item()
    lm_only = _step(model, ids)[1]
    msa.kl_value = "deferred"
    deferred = _step(model, ids, extra_loss=lambda _: 3.0 * msa.kl_loss())[1]
    assert msa.kl_loss().item() == 0.0  # deferred: the value arrives with the backward
    assert msa.kl_metrics()[SPARSE].item() == pytest.approx(kl_exact, rel=1e-5)
    indexer = [n for n in exact if ".indexer." in n]
    assert sorted(indexer) == sorted(n for n, _ in model.named_parameters() if ".indexer." in n)
    for n in indexer:
        assert exact[n].abs().sum() > 0 and exact[n].isfinite().all(), n
        _assert_close(deferred[n], 3.0 * exact[n], f"deferred grad of {n}")
    _assert_grads_equal(exact, lm_only, _main_parameters(lm_only))  # the KL reaches no main parameter


def test_mode_switches_and_disable_restores_the_model():
    model = m3_model()
    ids = _tokens(1, 256)
    want = model(ids).logits.detach()
    msa = fmt.enable_msa_training(model, mode="warmup")
    msa.set_mode("sparse")
    _assert_close(model(ids).logits.detach(), want, "sparse logits")
    msa.disable()
    assert model.config._attn_implementation == "sdpa"
    assert type(_sparse_layer(model).indexer).__name__ == "MiniMaxM3VLIndexer"
    _assert_close(model(ids).logits.detach(), want, "restored logits")


def _packed(doc_lengths):
    return torch.cat([torch.arange(n) for n in doc_lengths]).unsqueeze(0)


def test_a_packed_batch_equals_each_document_alone():
    """Documents of 320 and 192 tokens in one row (the second starts mid-block: its blocks restart with it). Loss:
    each document's summed LM loss, plus the KL weighted by tokens (kl_loss is a mean over tokens), so the packed
    step's gradients are the sum of the documents'."""
    lengths = (320, 192)
    bounds = torch.tensor((0, *lengths)).cumsum(0).tolist()
    model = m3_model()
    msa = fmt.enable_msa_training(model, mode="sparse", kl_value="exact")
    ids = _tokens(1, sum(lengths), seed=5)

    def per_document_lm_loss(logits, ids):
        return sum(_lm_loss(logits[:, a:b], ids[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:]))

    def kl_sum(n_tokens):
        return lambda _: msa.kl_loss() * n_tokens

    logits, grads = _step(model, ids, _packed(lengths), kl_sum(sum(lengths)), per_document_lm_loss)
    alone_logits, alone_grads = [], {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        doc_logits, doc_grads = _step(model, ids[:, a:b], None, kl_sum(b - a))
        alone_logits.append(doc_logits)
        for name, g in doc_grads.items():
            alone_grads[name] = alone_grads.get(name, 0) + g
    _assert_close(logits, torch.cat(alone_logits, 1), "packed logits")
    assert set(grads) == set(alone_grads)
    _assert_grads_equal(grads, alone_grads)


def test_cu_seqlens_from_position_ids_marks_documents_and_rows():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [5, 6, 0, 1, 2, 3]])
    cu = fmt.cu_seqlens_from_position_ids(position_ids)
    assert cu.dtype == torch.int32 and cu.numel() == 13
    assert cu.tolist() == [0, 3, 5, 6, 8, 12, 12, 12, 12, 12, 12, 12, 12]


# --- errors and boundaries ---------------------------------------------------------------------------------------

def test_errors_name_the_argument_and_what_is_supported():
    model = m3_model()
    with pytest.raises(ValueError, match=r"mode='dense'.*'sparse', 'warmup'"):
        fmt.enable_msa_training(model, mode="dense")
    with pytest.raises(ValueError, match=r"kl_value='later'"):
        fmt.enable_msa_training(model, kl_value="later")
    dense_only = m3_model(m3_config(layer_types=("full_attention",), mlp_layer_types=("dense",)))
    with pytest.raises(ValueError, match="no MiniMax-M3 sparse layer"):
        fmt.enable_msa_training(dense_only)
    fmt.enable_msa_training(model)
    with pytest.raises(RuntimeError, match="already enabled"):
        fmt.enable_msa_training(model)


def test_training_passes_proxy_scale_and_local_blocks(monkeypatch):
    """flash_msa_func gets M3's indexer scale and index_local_blocks by default, the handle's where given."""
    calls = []
    for name in ("flash_msa_func", "flash_msa_varlen_func", "flash_msa_warmup_func", "flash_msa_warmup_varlen_func"):
        real = getattr(flash_msa_rt, name)
        monkeypatch.setattr(flash_msa_rt, name,
                            lambda *a, _real=real, **kw: calls.append(kw) or _real(*a, **kw))
    model = m3_model(m3_config(index_head_dim=32, topk_blocks=3, local_blocks=2))
    ids = _tokens(1, 256)
    msa = fmt.enable_msa_training(model, mode="sparse", kl_value="exact")
    model(ids)
    assert calls[-1]["proxy_scale"] == 32 ** -0.5 and calls[-1]["local_blocks"] == 2
    kl_default = msa.kl_loss().item()
    msa.disable()
    msa = fmt.enable_msa_training(model, mode="warmup", kl_value="exact", proxy_scale=0.25, local_blocks=1,
                                  packed=False)
    model(ids)
    assert calls[-1]["proxy_scale"] == 0.25 and calls[-1]["local_blocks"] == 1
    msa.disable()
    msa = fmt.enable_msa_training(model, mode="sparse", kl_value="exact", proxy_scale=0.25)
    model(ids)
    assert calls[-1]["proxy_scale"] == 0.25 and calls[-1]["local_blocks"] == 2
    assert msa.kl_loss().item() != pytest.approx(kl_default)  # the proxy scale reaches the KL


def test_training_sparse_with_two_local_blocks_equals_the_sdpa_path():
    """index_local_blocks = 2: M3 forces the query's block and the one before; so does local_blocks."""
    model = m3_model(m3_config(topk_blocks=3, local_blocks=2))
    ids = _tokens(2, 256)
    logits_sdpa, grads_sdpa = _step(model, ids)
    fmt.enable_msa_training(model, mode="sparse", kl_value="exact")
    logits, grads = _step(model, ids)
    _assert_close(logits, logits_sdpa, "logits")
    _assert_grads_equal(grads, grads_sdpa, _main_parameters(grads_sdpa))


def test_only_the_integrations_import_transformers():
    for path in (REPO / "flash_msa_rt").rglob("*.py"):
        if "integrations" in path.relative_to(REPO).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            assert not [n for n in names if n.split(".")[0] == "transformers"], f"{path} imports transformers"


def test_sparse_layers_of_one_forward_share_one_offsets_tensor(monkeypatch):
    """Every sparse layer of a forward gets the same cu_seqlens tensor (flash_msa_rt reads a device tensor's
    offsets once per tensor and version: one synchronisation per forward, not per layer); a new position_ids, or
    the same one written in place, makes new offsets."""
    seen = []
    real = flash_msa_rt.flash_msa_varlen_func
    monkeypatch.setattr(flash_msa_rt, "flash_msa_varlen_func",
                        lambda *a, **kw: seen.append(a[5]) or real(*a, **kw))
    model = m3_model(m3_config(layer_types=("minimax_m3_sparse", "minimax_m3_sparse"),
                               mlp_layer_types=("dense", "dense")))
    fmt.enable_msa_training(model, mode="sparse", kl_value="exact")
    ids = _tokens(1, 256)
    position_ids = _packed((160, 96))
    model(ids, position_ids=position_ids)
    assert len(seen) == 2 and seen[0] is seen[1]
    assert seen[0].tolist()[:3] == [0, 160, 256]
    position_ids[0, 200] = 7  # an in-place write: the next forward forms its offsets again
    model(ids, position_ids=position_ids)
    assert len(seen) == 4 and seen[2] is seen[3] and seen[2] is not seen[0]
    assert seen[2].tolist()[:5] == [0, 160, 200, 201, 256]


def test_packed_training_under_compile_says_to_use_unpacked(monkeypatch):
    model = m3_model()
    fmt.enable_msa_training(model, mode="sparse")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match=r"packed=False"):
        model(_tokens(1, 256), position_ids=_packed((160, 96)))


def test_unpacked_training_compiles_fullgraph():
    """packed=False (what the compile error names) traces whole: logits and the KL equal eager's."""
    model = m3_model()
    msa = fmt.enable_msa_training(model, mode="sparse", kl_value="exact", packed=False)
    ids = _tokens(1, 256)
    want = model(ids).logits.detach()
    kl_want = msa.kl_loss().detach()
    compiled = torch.compile(lambda x: model(x).logits, fullgraph=True, backend="aot_eager")
    got = compiled(ids)
    _assert_close(got.detach(), want, "compiled logits")
    _assert_close(msa.kl_loss().detach(), kl_want, "compiled kl_loss")
