"""The CUDA paths: engine exactness, cross-device chunk sharing, lossy codecs and C2C fusion.

Skipped where CUDA is unavailable (CI has no GPU). ``tools/gpu_check.sh`` runs this file
on a GPU machine.

``SEMCOMM_TEST_DEVICE`` picks the device the test bodies run on: ``cuda`` (the default), or
``cuda:N``, or ``cpu``. With ``SEMCOMM_TEST_DEVICE=cpu`` nothing is skipped and every body runs
on the CPU (the cross-device tests then move chunks between two CPU engines), so the file can
be exercised on a machine without a GPU::

    SEMCOMM_TEST_DEVICE=cpu python -m pytest tests/test_cuda.py -q

Token ids are compared exactly; floats with tolerances for fp32 with TF32 off (a fixture turns
TF32 off for every test). Cross-device token comparisons use prompts whose greedy top-2 logit
gaps are far above fp32 noise (>= 3e-4, against ~1e-6 of CPU/GPU difference).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from semcomm.engine import HFEngine
from semcomm.engine import _cache_adapter as ca
from semcomm.fusion import (
    Fuser,
    FuserConfig,
    FusionPipeline,
    FusionTrainer,
    ModelSide,
    TrainConfig,
    load_fuser,
)
from semcomm.fusion._kvio import align_layers, cache_to_layers, output_cache
from semcomm.kv import DiskStore, MemoryStore, TieredStore
from semcomm.kv._codecs import relative_error

from ._engine_models import FAMILIES, prompt_ids, reference_greedy, tiny_model
from ._fusion_helpers import word_examples
from ._fusion_toy import toy_pair

DEVICE = os.environ.get("SEMCOMM_TEST_DEVICE", "cuda")
DEV = torch.device(DEVICE)

pytestmark = pytest.mark.skipif(
    DEV.type == "cuda" and not torch.cuda.is_available(),
    reason="needs CUDA (SEMCOMM_TEST_DEVICE=cpu runs these test bodies on the CPU)",
)

CHUNK = 16
NEW = 8


@pytest.fixture(autouse=True)
def _strict_fp32() -> Iterator[None]:
    """IEEE fp32 matmuls on the GPU (TF32 off); one CPU thread for tiny models on the CPU.

    ``set_float32_matmul_precision("highest")`` is the one documented switch for this (it sets
    ``torch.backends.cuda.matmul.allow_tf32 = False``; no convolutions run here, so cuDNN's
    own TF32 flag does not matter).
    """
    precision = torch.get_float32_matmul_precision()
    threads = torch.get_num_threads()
    torch.set_float32_matmul_precision("highest")
    if DEV.type == "cuda":
        assert not torch.backends.cuda.matmul.allow_tf32
    else:
        torch.set_num_threads(1)
    yield
    torch.set_float32_matmul_precision(precision)
    torch.set_num_threads(threads)


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type == DEV.type


def _cache_on_device(cache: Any) -> bool:
    return all(_on_device(k) and _on_device(v) for k, v in ca.layer_tensors(cache))


def _device_model(family: str, **kw: Any) -> Any:
    return tiny_model(family, **kw).to(DEV)


# ----------------------------------------------------------------------------- engine


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cold_warm_partial_exact_on_device(family: str) -> None:
    model = _device_model(family)
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, keep_logits=False, device=DEVICE)
    assert engine.device.type == DEV.type
    ids = prompt_ids(45)
    ref = reference_greedy(model, ids, NEW)

    cold = engine.generate(ids, max_new_tokens=NEW)
    assert cold.token_ids == ref
    assert cold.stats.hit_tokens == 0
    assert cold.stats.chunks_stored == 3  # two full chunks + the 13-token tail

    warm = engine.generate(ids, max_new_tokens=NEW)
    assert warm.token_ids == ref
    assert warm.stats.hit_chunks == 2  # the tail chunk is recomputed, not restored
    assert warm.stats.hit_tokens == 32  # without stored logits the last chunk is recomputed
    assert warm.stats.recomputed_tokens == 13
    assert warm.stats.chunks_stored == 0

    ids2 = ids[:37] + prompt_ids(11, seed=7)  # shares two full chunks
    part = engine.generate(ids2, max_new_tokens=NEW)
    assert part.token_ids == reference_greedy(model, ids2, NEW)
    assert part.stats.hit_tokens == 32
    assert part.stats.recomputed_tokens == 16


def _store(kind: str, root: Path) -> Any:
    if kind == "memory":
        return MemoryStore()
    if kind == "disk":
        return DiskStore(root / "kv")
    return TieredStore([MemoryStore(), DiskStore(root / "kv")])


@pytest.mark.parametrize("kind", ["memory", "disk", "tiered"])
def test_each_lossless_store_exact_on_device(kind: str, tmp_path: Path) -> None:
    model = _device_model("llama")
    ids = prompt_ids(40, seed=3)
    ref = reference_greedy(model, ids, NEW)
    engine = HFEngine(model, store=_store(kind, tmp_path), chunk_size=CHUNK, keep_logits=False, device=DEVICE)
    assert engine.generate(ids, max_new_tokens=NEW).token_ids == ref
    warm = engine.generate(ids, max_new_tokens=NEW)
    assert warm.token_ids == ref and warm.stats.hit_tokens == 32
    assert warm.stats.bytes_loaded > 0
    if kind != "memory":  # a fresh store object over the same directory (restart)
        engine2 = HFEngine(model, store=_store(kind, tmp_path), chunk_size=CHUNK, keep_logits=False, device=DEVICE)
        again = engine2.generate(ids, max_new_tokens=NEW)
        assert again.token_ids == ref and again.stats.hit_tokens == 32
        assert set(again.stats.hit_tiers) == {"disk"}
        if kind == "tiered":  # promoted to memory on that hit
            assert set(engine2.generate(ids, max_new_tokens=NEW).stats.hit_tiers) == {"memory"}


def test_prefill_restores_the_stored_bits_on_device() -> None:
    model = _device_model("qwen2")
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, keep_logits=False, device=DEVICE)
    ids = prompt_ids(30, seed=4)
    cold = engine.prefill(ids)
    warm = engine.prefill(ids)
    assert _cache_on_device(cold.cache) and _cache_on_device(warm.cache)
    assert _on_device(warm.last_logits)
    assert cold.cache.get_seq_length() == warm.cache.get_seq_length() == 30
    assert warm.stats.hit_tokens == 16 and cold.stats.chunks_stored == 2
    assert int(warm.last_logits.argmax()) == reference_greedy(model, ids, 1)[0]
    assert torch.allclose(warm.last_logits, cold.last_logits, rtol=1e-4, atol=1e-5)
    for lc, lw in zip(cold.cache.layers, warm.cache.layers):
        assert lc.keys[:, :, :16].equal(lw.keys[:, :, :16])  # restored bits are the stored bits
        assert lc.values[:, :, :16].equal(lw.values[:, :, :16])


def test_stream_and_seeded_sampling_on_device() -> None:
    model = _device_model("qwen2")
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, keep_logits=False, device=DEVICE)
    ids = prompt_ids(33, seed=5)
    ref = reference_greedy(model, ids, NEW)
    stream = engine.generate(ids, max_new_tokens=NEW, stream=True)
    assert list(stream) == ref
    assert stream.result is not None and stream.result.stats.chunks_stored == 3
    # sampling draws from a generator on the engine's device
    a = engine.generate(ids, max_new_tokens=12, temperature=1.5, seed=11)
    b = engine.generate(ids, max_new_tokens=12, temperature=1.5, seed=11)
    c = engine.generate(ids, max_new_tokens=12, temperature=1.5, seed=12)
    assert a.token_ids == b.token_ids != c.token_ids
    one = engine.generate(ids, max_new_tokens=12, temperature=1.5, top_k=1, seed=3)
    assert one.token_ids == reference_greedy(model, ids, 12)  # top-1 sampling is greedy


def test_bfloat16_restore_is_bit_exact_on_device() -> None:
    model = tiny_model("llama")
    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, keep_logits=False, device=DEVICE,
                      dtype="bfloat16")
    assert engine.dtype == torch.bfloat16 and engine.namespace.dtype == "bfloat16"
    ids = prompt_ids(45)
    cold = engine.prefill(ids)
    warm = engine.prefill(ids)
    assert warm.stats.hit_tokens == 32 and warm.stats.recomputed_tokens == 13
    for lc, lw in zip(cold.cache.layers, warm.cache.layers):
        assert lw.keys.dtype == torch.bfloat16 and _on_device(lw.keys)
        assert lc.keys[:, :, :32].equal(lw.keys[:, :, :32])
        assert lc.values[:, :, :32].equal(lw.values[:, :, :32])
    # the last token, fed alone on the restored cache, sees what the full prefill saw
    scale = float(cold.last_logits.abs().max())
    assert float((warm.last_logits - cold.last_logits).abs().max()) <= 0.05 * scale + 1e-3
    g1 = engine.generate(ids, max_new_tokens=NEW)
    g2 = engine.generate(ids, max_new_tokens=NEW)
    assert g1.stats.hit_tokens == g2.stats.hit_tokens == 32
    assert g1.token_ids == g2.token_ids and g1.token_ids  # (may stop early at EOS)


# ------------------------------------------------------------------ cross-device sharing


@pytest.mark.parametrize("family", ["llama", "qwen3", "falcon_alibi"])
def test_chunks_written_on_cpu_restore_on_device(family: str, tmp_path: Path) -> None:
    cpu_model = tiny_model(family)
    dev_model = tiny_model(family)  # same seed: the same weights, a second copy
    ids = prompt_ids(45)
    writer = HFEngine(cpu_model, store=DiskStore(tmp_path / "kv"), chunk_size=CHUNK, keep_logits=False, device="cpu")
    reader = HFEngine(dev_model, store=DiskStore(tmp_path / "kv"), chunk_size=CHUNK, keep_logits=False,
                      device=DEVICE)
    # the namespace names the model, not the device it sits on
    assert reader.namespace_digest == writer.namespace_digest
    assert reader.chunk_keys(ids) == writer.chunk_keys(ids)
    ref_cpu = reference_greedy(cpu_model, ids, NEW)
    ref_dev = reference_greedy(dev_model, ids, NEW)
    assert ref_cpu == ref_dev  # the two devices agree without any cache (precondition)

    wrote = writer.generate(ids, max_new_tokens=NEW)
    assert wrote.token_ids == ref_cpu and wrote.stats.chunks_stored == 3
    got = reader.generate(ids, max_new_tokens=NEW)
    assert got.stats.hit_tokens == 32 and got.stats.chunks_stored == 0
    assert set(got.stats.hit_tiers) == {"disk"}
    assert got.token_ids == ref_dev

    # the restored device cache holds exactly the bits the CPU computed
    cpu_pre = writer.prefill(ids, store=False)
    dev_pre = reader.prefill(ids, store=False)
    assert _cache_on_device(dev_pre.cache)
    for (kc, vc), (kd, vd) in zip(ca.layer_tensors(cpu_pre.cache), ca.layer_tensors(dev_pre.cache)):
        assert kc[:, :, :32].equal(kd[:, :, :32].cpu()) and vc[:, :, :32].equal(vd[:, :, :32].cpu())


def test_chunks_written_on_device_restore_on_cpu_and_snapshots_travel(tmp_path: Path) -> None:
    dev_model = _device_model("qwen2")
    cpu_model = tiny_model("qwen2")
    ids = prompt_ids(45)
    writer = HFEngine(dev_model, store=DiskStore(tmp_path / "kv"), chunk_size=CHUNK, keep_logits=False,
                      device=DEVICE)
    reader = HFEngine(cpu_model, store=DiskStore(tmp_path / "kv"), chunk_size=CHUNK, keep_logits=False, device="cpu")
    ref = reference_greedy(cpu_model, ids, NEW)
    assert reference_greedy(dev_model, ids, NEW) == ref  # precondition: devices agree

    assert writer.generate(ids, max_new_tokens=NEW).stats.chunks_stored == 3
    got = reader.generate(ids, max_new_tokens=NEW)
    assert got.stats.hit_tokens == 32 and got.token_ids == ref

    # a snapshot exported on the device continues on the CPU (and back)
    snap = writer.snapshot(ids[:35])
    cpu_only = HFEngine(cpu_model, store=MemoryStore(), chunk_size=CHUNK, keep_logits=False, device="cpu")
    r = cpu_only.generate(ids, max_new_tokens=NEW, snapshot=snap)
    assert r.stats.hit_tokens == 32 and set(r.stats.hit_tiers) == {"snapshot"}
    assert r.token_ids == ref
    snap_cpu = cpu_only.snapshot(ids[:35])
    dev_only = HFEngine(dev_model, store=MemoryStore(), chunk_size=CHUNK, keep_logits=False, device=DEVICE)
    assert dev_only.import_snapshot(snap_cpu.to_bytes()) == 3
    r2 = dev_only.generate(ids[:35], max_new_tokens=NEW)
    assert r2.stats.hit_tokens == 32
    assert r2.token_ids == reference_greedy(dev_model, ids[:35], NEW)


# ------------------------------------------------------------------------ lossy codecs

# relative K/V error of a restore, against the lossless cache (int8 is ~0.5%, int4 ~7%)
_CODEC_BOUNDS = {"int8": 0.02, "int4": 0.15}


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_lossy_codecs_on_device(spec: str, tmp_path: Path) -> None:
    model = _device_model("llama")
    ids = prompt_ids(45)
    ref = reference_greedy(model, ids, NEW)
    lossless = HFEngine(model, chunk_size=CHUNK, keep_logits=False, device=DEVICE).prefill(ids, store=False)

    engine = HFEngine(model, store=MemoryStore(), chunk_size=CHUNK, keep_logits=False, codec=spec, device=DEVICE)
    cold = engine.generate(ids, max_new_tokens=NEW)
    assert cold.token_ids == ref and cold.stats.chunks_stored == 3  # cold: no codec in the loop
    assert cold.stats.codec.startswith(spec)
    warm = engine.generate(ids, max_new_tokens=NEW)
    assert warm.stats.hit_tokens == 32 and warm.token_ids
    if spec == "int8":
        assert warm.token_ids == ref  # int8 keeps a short prompt's greedy answer

    pre = engine.prefill(ids, store=False)
    assert _cache_on_device(pre.cache)
    k_err = max(relative_error(a[:, :, :32].cpu(), b[:, :, :32].cpu()) for (a, _), (b, _)
                in zip(ca.layer_tensors(lossless.cache), ca.layer_tensors(pre.cache)))
    v_err = max(relative_error(a[:, :, :32].cpu(), b[:, :, :32].cpu()) for (_, a), (_, b)
                in zip(ca.layer_tensors(lossless.cache), ca.layer_tensors(pre.cache)))
    assert 0.0 < k_err <= _CODEC_BOUNDS[spec] and 0.0 < v_err <= _CODEC_BOUNDS[spec]


def test_int8_chunks_from_cpu_give_the_cpu_answer_on_device(tmp_path: Path) -> None:
    cpu_model, dev_model = tiny_model("qwen2"), tiny_model("qwen2")
    ids = prompt_ids(45)
    cpu = HFEngine(cpu_model, store=DiskStore(tmp_path / "kv"), chunk_size=CHUNK, keep_logits=False, codec="int8",
                   device="cpu")
    dev = HFEngine(dev_model, store=DiskStore(tmp_path / "kv"), chunk_size=CHUNK, keep_logits=False, codec="int8",
                   device=DEVICE)
    assert cpu.namespace_digest == dev.namespace_digest
    cpu.generate(ids, max_new_tokens=NEW)
    cpu_warm = cpu.generate(ids, max_new_tokens=NEW)
    dev_warm = dev.generate(ids, max_new_tokens=NEW)
    assert cpu_warm.stats.hit_tokens == dev_warm.stats.hit_tokens == 32
    assert dev_warm.token_ids == cpu_warm.token_ids == reference_greedy(cpu_model, ids, NEW)


# ------------------------------------------------------------------------------ fusion

FUSER = {"hidden_dim": 32, "num_blocks": 1, "dropout": 0.0}
SHARED = "The Quick  brown fox — café 東京"


def _sides(seed: int = 0) -> tuple[ModelSide, ModelSide]:
    """The toy Qwen2 -> Qwen3 pair (one in-process BPE tokenizer), on the test device."""
    pair = toy_pair("qwen", seed=seed)
    return (
        ModelSide(pair.sharer.to(DEV), pair.sharer_tokenizer),
        ModelSide(pair.receiver.to(DEV), pair.receiver_tokenizer, prefix="context: ",
                  suffix=" answer:"),
    )


def _open_fuser(s: ModelSide, r: ModelSide) -> Fuser:
    torch.manual_seed(0)
    f = Fuser(
        FuserConfig(sharer=s.spec, receiver=r.spec, hidden_dim=16, num_blocks=1, zero_init=False)
    )
    with torch.no_grad():
        f.gate_logit.fill_(1.0)  # hard gates open
        f.w_out.mul_(50)  # a strong projection, so fusion visibly changes the cache
    return f.to(DEV).eval()


def test_training_on_device_lowers_the_loss() -> None:
    s, r = _sides()
    cfg = TrainConfig(steps=40, batch_size=8, lr=3e-3, warmup=5, checkpoint_every=0, fuser=FUSER,
                      device=DEVICE)
    tr = FusionTrainer(s, r, word_examples(), cfg)
    assert all(_on_device(p) for p in tr.fuser.parameters())
    alone = tr.evaluate_loss(fused=False)
    before = tr.evaluate_loss()
    assert before == pytest.approx(alone, abs=1e-5)  # zero-init projection: the receiver alone
    res = tr.train()
    after = tr.evaluate_loss()
    assert res.steps == 40 and all(x == x for x in res.losses)  # no NaN on the way
    assert after < before - 0.2, (before, after)
    assert not any(p.requires_grad for p in r.model.parameters())  # the models stayed frozen
    assert _on_device(next(r.model.parameters())) and _on_device(next(s.model.parameters()))


def test_checkpoint_and_resume_on_device(tmp_path: Path) -> None:
    s, r = _sides()
    cfg = TrainConfig(steps=4, batch_size=2, checkpoint_every=2, seed=3, fuser=FUSER,
                      device=DEVICE)
    FusionTrainer(s, r, word_examples(8), cfg, out=tmp_path).train()
    saved = load_fuser(tmp_path).state_dict()  # loads on the CPU
    cfg2 = TrainConfig(steps=6, batch_size=2, checkpoint_every=2, seed=3, fuser=FUSER,
                       device=DEVICE)
    tr2 = FusionTrainer(s, r, word_examples(8), cfg2, out=tmp_path, resume=True)
    assert tr2.step == 4
    for k, v in tr2.fuser.state_dict().items():
        assert _on_device(v) and torch.equal(v.cpu(), saved[k])
    moments = [t for st in tr2.optimizer.state.values() for n, t in st.items() if n != "step"]
    assert moments and all(_on_device(t) for t in moments)  # restored next to the parameters
    assert tr2.train().steps == 6


def test_closed_gates_leave_the_receiver_cache_bit_identical_on_device() -> None:
    s, r = _sides(seed=1)
    fuser = _open_fuser(s, r)
    pipe = FusionPipeline(s, r, fuser)
    fp = pipe.encode(SHARED)
    with torch.no_grad():
        out = r.model(input_ids=torch.tensor([fp.receiver.input_ids[:-1]], device=DEV),
                      use_cache=True)
    r_layers = cache_to_layers(output_cache(out))
    before = [(k.clone(), v.clone()) for k, v in r_layers]
    s_layers, _ = pipe.sharer_layers(fp.sharer.input_ids)
    aligned = align_layers(s_layers, fp.alignment.weights[None].to(DEV))
    mask = fp.alignment.mask[None].to(DEV)
    assert 0 < int(mask.sum()) < mask.shape[1]  # some tokens fused, some not

    fuser.set_gate_mode("closed")
    with torch.no_grad():
        closed = fuser.fuse(aligned, r_layers, mask)
    for (k, v), (k0, v0), (kc, vc) in zip(r_layers, before, closed):
        assert kc is k and vc is v  # the receiver's own tensors, untouched
        assert kc.equal(k0) and vc.equal(v0)

    # hard gates: only receiver layer 0's key branch open
    fuser.set_gate_mode("hard")
    with torch.no_grad():
        fuser.gate_logit.fill_(-1.0)
        fuser.gate_logit[Fuser.group(0, "key")] = 1.0
        part = fuser.fuse(aligned, r_layers, mask)
    off = mask[0] == 0
    k_fused = part[0][0]
    assert _on_device(k_fused) and not k_fused.equal(r_layers[0][0])
    assert k_fused[:, :, off].equal(before[0][0][:, :, off])  # unfused tokens keep their bits
    for i, (k, v) in enumerate(part):
        assert v is r_layers[i][1]
        if i:
            assert k is r_layers[i][0]


def test_pipeline_with_closed_gates_is_the_receiver_alone_on_device() -> None:
    s, r = _sides(seed=1)
    fuser = _open_fuser(s, r)
    pipe = FusionPipeline(s, r, fuser)
    opened = pipe.generate(SHARED, max_new_tokens=6)
    assert opened.stats["fused_tokens"] > 0
    fuser.set_gate_mode("closed")
    closed = pipe.generate(SHARED, max_new_tokens=6)
    alone = pipe.generate(SHARED, max_new_tokens=6, fuse=False)
    assert closed.token_ids == alone.token_ids
    assert closed.stats["fused_tokens"] > 0 and alone.stats["fused_tokens"] == 0
    # and the receiver alone through HF's plain forward over the full prompt, greedy
    ids = r.encode(SHARED).input_ids
    seq = list(ids)
    with torch.no_grad():
        for _ in range(len(closed.token_ids)):
            x = torch.tensor([seq], device=DEV)
            seq.append(int(r.model(input_ids=x).logits[0, -1].argmax()))
    assert closed.token_ids == seq[len(ids):]


@pytest.mark.parametrize("engine_device", ["same", "cpu"])
def test_fused_generation_with_a_sharer_store_hit_on_device(engine_device: str) -> None:
    s, r = _sides(seed=1)
    fuser = _open_fuser(s, r)
    if engine_device == "cpu":  # the sharer's engine on the CPU, the receiver on the device
        e_model, e_dev = copy.deepcopy(s.model).cpu(), "cpu"
    else:
        e_model, e_dev = s.model, DEVICE
    engine = HFEngine(e_model, s.tokenizer, store=MemoryStore(capacity_bytes=64 << 20),
                      chunk_size=4, device=e_dev)
    with_engine = FusionPipeline(s, r, fuser, sharer_engine=engine)
    direct = FusionPipeline(s, r, fuser)
    first = with_engine.generate(SHARED, max_new_tokens=4)
    second = with_engine.generate(SHARED, max_new_tokens=4)
    ref = direct.generate(SHARED, max_new_tokens=4)
    e1, e2 = first.stats["sharer_engine_stats"], second.stats["sharer_engine_stats"]
    assert first.stats["sharer_source"] == "engine" and e1["hit_tokens"] == 0
    n = second.stats["sharer_prompt_tokens"]
    assert e2["hit_tokens"] >= n - 4 and e2["recomputed_tokens"] <= 4
    assert first.stats["fused_tokens"] > 0
    assert first.token_ids == second.token_ids == ref.token_ids  # lossless restore: same answer


def test_reference_pair_scores_the_same_on_device_as_on_cpu() -> None:
    from semcomm.cli._tools.fusion_reference import load_reference_sides, reference_items
    from semcomm.fusion import shipped_fuser_path
    from semcomm.fusion._eval import EvalSettings, _option_ids, score_options
    from semcomm.reference import build_world

    s, r = load_reference_sides()
    fuser = load_fuser(shipped_fuser_path(), sharer=s.spec, receiver=r.spec)
    items = reference_items(build_world(seed=0), heldout=True, limit=6)
    fmt = EvalSettings().option_format

    def scores(pipe: FusionPipeline) -> list[list[float]]:
        out = []
        for it in items:
            fp = pipe.encode(it.qa_prompt)
            layers, _ = pipe.fused_layers(fp)
            ids = fp.receiver.input_ids
            out.append(score_options(r.model, layers, [ids[-1]], len(ids) - 1,
                                     _option_ids(r, it, fmt)))
        return out

    runs: dict[str, dict[str, list[list[float]]]] = {}
    for where in ("cpu", DEVICE):
        s.model.to(where)
        r.model.to(where)
        fuser.to(where)
        pipe = FusionPipeline(s, r, fuser)
        runs[where] = {}
        for mode in ("hard", "open"):  # the shipped gates, and every branch fused
            fuser.set_gate_mode(mode)
            runs[where][mode] = scores(pipe)
    assert _on_device(next(r.model.parameters()))
    checked = 0
    for mode in ("hard", "open"):
        for c, d in zip(runs["cpu"][mode], runs[DEVICE][mode]):
            assert d == pytest.approx(c, abs=1e-3)
            top = sorted(c)
            if top[-1] - top[-2] > 2e-3:  # a clear choice must be the same choice
                assert max(range(len(d)), key=d.__getitem__) == max(
                    range(len(c)), key=c.__getitem__
                )
                checked += 1
    assert checked >= len(items)  # most items have a clear choice in both modes
