"""Sliding-window families: exact KV reuse at prompts longer than the window.

A sliding layer of window ``w`` needs only the last ``w - 1`` positions of a cached prefix
(transformers masks ``kv_idx > q_idx - w``); a hit restores exactly those and keeps full layers
whole. Greedy output must equal the model's own without a cache, cold, warm, partially warm
and after a restart from a disk store, at chunk boundaries +-1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from semcomm.engine import HFEngine, KVSnapshot
from semcomm.engine import _cache_adapter as ca
from semcomm.kv import DiskStore, MemoryStore

from ._engine_models import SLIDING, WINDOW, prompt_ids, reference_greedy, tiny_model

CHUNK = 16
NEW = 10  # decode runs past the window too


@pytest.fixture(scope="module", params=sorted(SLIDING))
def family(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, tiny_model(request.param)


def _full_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()


def test_windows_are_read_from_the_config(family: tuple[str, Any]) -> None:
    name, model = family
    engine = HFEngine(model, device="cpu")
    windows = engine.layout.windows
    assert len(windows) == engine.layout.num_layers and WINDOW in windows
    expected = {"gemma3": (8, 8, None, 8), "mistral_sw": (8, 8), "qwen2_sw": (None, None, 8, 8),
                "gemma2": (8, None)}
    assert windows == expected[name]


@pytest.mark.parametrize("n", [WINDOW - 1, WINDOW, WINDOW + 1, 2 * CHUNK - 1, 2 * CHUNK,
                               2 * CHUNK + 1, 45])
@pytest.mark.parametrize("keep_logits", [True, False], ids=["logits", "recompute"])
def test_cold_warm_partial_equal_generate_without_cache(family: tuple[str, Any], n: int,
                                                        keep_logits: bool) -> None:
    _, model = family
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu",
                      keep_logits=keep_logits)
    # a whole hit with its logits, or its last chunk recomputed whole
    restored = n if keep_logits else (n - 1) // CHUNK * CHUNK
    ids = prompt_ids(n, seed=n)
    ref = reference_greedy(model, ids, NEW)
    cold = engine.generate(ids, max_new_tokens=NEW)
    assert cold.token_ids == ref and cold.stats.hit_tokens == 0
    warm = engine.generate(ids, max_new_tokens=NEW)
    assert warm.token_ids == ref
    assert warm.stats.hit_tokens == restored and warm.stats.recomputed_tokens == n - restored
    # the logits of the warm prefill match the model's own full forward
    pre = engine.prefill(ids)
    assert pre.stats.hit_tokens == restored
    torch.testing.assert_close(pre.last_logits, _full_logits(model, ids), rtol=1e-4, atol=1e-4)
    if n > CHUNK:  # shares the first full chunk, recomputes the rest
        ids2 = ids[:CHUNK] + prompt_ids(n - CHUNK, seed=100 + n)
        part = engine.generate(ids2, max_new_tokens=NEW)
        assert part.token_ids == reference_greedy(model, ids2, NEW)
        assert part.stats.hit_tokens == CHUNK


@pytest.mark.parametrize("keep_logits", [True, False], ids=["logits", "recompute"])
def test_a_hit_restores_only_the_window_of_sliding_layers(family: tuple[str, Any],
                                                          keep_logits: bool) -> None:
    _, model = family
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu",
                      keep_logits=keep_logits)
    ids = prompt_ids(45, seed=2)
    cold = engine.prefill(ids)
    warm = engine.prefill(ids)
    r = 45 if keep_logits else 32  # restored tokens (without the logits, [32, 45) recomputed)
    assert warm.stats.hit_tokens == r
    for i, (lc, lw) in enumerate(zip(cold.cache.layers, warm.cache.layers)):
        w = engine.layout.windows[i]
        # restored up to r tokens; a sliding layer holds [r - (w - 1), 45), a full one [0, 45)
        first = 0 if w is None else r - (w - 1)
        assert lw.start == first and lw.get_seq_length() == 45
        assert lw.keys.shape[2] == 45 - first
        # the restored bits are the stored bits
        assert lw.keys[:, :, : r - first].equal(lc.keys[:, :, first:r])
        assert lw.values[:, :, : r - first].equal(lc.values[:, :, first:r])


def test_after_a_restart_from_disk_and_snapshots(family: tuple[str, Any], tmp_path: Path) -> None:
    _, model = family
    ids = prompt_ids(41, seed=9)
    ref = reference_greedy(model, ids, NEW)
    first = HFEngine(model, store=DiskStore(tmp_path / "kv"), chunk_size=CHUNK, device="cpu")
    assert first.generate(ids, max_new_tokens=NEW).token_ids == ref
    again = HFEngine(model, store=DiskStore(tmp_path / "kv"), chunk_size=CHUNK, device="cpu")
    r = again.generate(ids, max_new_tokens=NEW)
    assert r.token_ids == ref and r.stats.hit_tokens == 41 and set(r.stats.hit_tiers) == {"disk"}
    # a snapshot of the restored prompt carries every layer's K/V (the stored bytes)
    snap = KVSnapshot.from_bytes(again.snapshot(ids[:37]).to_bytes())
    other = HFEngine(model, store=MemoryStore(), chunk_size=8, device="cpu")  # re-chunks it
    assert other.import_snapshot(snap) == 5
    assert other.generate(ids, max_new_tokens=NEW, snapshot=snap).token_ids == ref
    r2 = other.generate(ids[:37], max_new_tokens=NEW)
    assert r2.stats.hit_tokens == 32 and r2.token_ids == reference_greedy(model, ids[:37], NEW)


def test_decoding_past_the_buffer_compacts_sliding_layers() -> None:
    """``prefill`` sizes the cache for the prompt; decoding on from it grows full layers and
    keeps only the window in sliding ones, token for token as the model."""
    model = tiny_model("gemma3")
    # without stored logits, so the warm prefill restores a window and recomputes a chunk
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, device="cpu",
                      keep_logits=False)
    ids = prompt_ids(30, seed=4)
    ref = reference_greedy(model, ids, 20)
    engine.prefill(ids)
    pre = engine.prefill(ids)  # warm: sliding layers hold only their window
    runner = ca.ModelRunner(model)
    out = [int(pre.last_logits.argmax())]
    with torch.no_grad():
        for _ in range(19):
            out.append(int(runner.forward(torch.tensor([[out[-1]]]), pre.cache).argmax()))
    assert out == ref
    layers: list[Any] = list(pre.cache.layers)
    sliding = [la for la in layers if isinstance(la, ca.BufferWindowLayer)]
    # restored [22, 29) + the recomputed 29; full at 30, compacted once to the last w - 1 = 7
    assert sliding and all((la.start, la.length, la.capacity) == (23, 49, 30) for la in sliding)
    full = [la for la in layers if isinstance(la, ca.BufferLayer)]
    assert all((la.start, la.length, la.capacity) == (0, 49, 60) for la in full)  # doubled


@pytest.mark.slow
def test_real_gemma3_270m_over_its_window(tmp_path: Path) -> None:
    """gemma-3-270m: 18 layers, 15 with a 512-token window; a 600-token prompt, restored from
    disk by a second engine (a restart). The reference is the model's own ``generate`` (its
    ``DynamicSlidingWindowLayer`` cache), with logits checked against the cold prefill."""
    from semcomm.models import is_pulled, model_path

    if not is_pulled("gemma-3-270m"):
        pytest.skip("gemma-3-270m is not pulled (semcomm models pull gemma-3-270m)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path("gemma-3-270m")).eval()
    ids = [i + 1000 for i in prompt_ids(600, seed=3)]  # ordinary vocabulary ids
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6,
                             do_sample=False)[0, len(ids):].tolist()
    engine = HFEngine(model, store=DiskStore(tmp_path / "kv"), chunk_size=256, device="cpu")
    assert engine.layout.windows.count(512) == 15
    cold = engine.prefill(ids)
    assert cold.stats.chunks_stored == 3 and int(cold.last_logits.argmax()) == ref[0]
    again = HFEngine(model, store=DiskStore(tmp_path / "kv"), chunk_size=256, device="cpu")
    warm = again.generate(ids, max_new_tokens=6)
    assert warm.token_ids[: len(ref)] == ref and warm.stats.hit_tokens == 600
    assert set(warm.stats.hit_tiers) == {"disk"}
    torch.testing.assert_close(again.prefill(ids).last_logits, cold.last_logits,
                               rtol=1e-4, atol=1e-4)
