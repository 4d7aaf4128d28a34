"""The memory plan: its arithmetic against measured tensor sizes, the fit check, KV admission."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import transformers as T
from transformers import DynamicCache

from semcomm.engine._cache_adapter import cache_kwargs
from semcomm.errors import ConfigError, InvalidInputError, OverloadedError
from semcomm.models import is_pulled, model_path
from semcomm.runtime._memplan import (
    KVAccountant,
    MemoryPlan,
    ModelPlan,
    kv_shape_from_config,
    weight_bytes,
    weight_bytes_from_dir,
)

from ._engine_models import FAMILIES, tiny_model


def _measured_kv_bytes(model: torch.nn.Module, tokens: int) -> int:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(3, 200, (1, tokens - 1)), use_cache=True,
              **cache_kwargs(model, cache))
        model(torch.randint(3, 200, (1, 1)), use_cache=True, **cache_kwargs(model, cache))
    return sum(layer.keys.numel() * layer.keys.element_size()
               + layer.values.numel() * layer.values.element_size() for layer in cache.layers)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("gpt2", "opt", "falcon",
                                                                      "falcon_alibi", "gpt_neox")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_per_token_matches_the_cache_transformers_builds(family: str,
                                                                  dtype: torch.dtype) -> None:
    model = tiny_model(family).to(dtype)
    shape = kv_shape_from_config(model.config, dtype)
    for tokens in (2, 17):
        assert _measured_kv_bytes(model, tokens) == shape.bytes_for(tokens), (family, tokens)
    assert shape.bytes_per_token * 17 == shape.bytes_for(17)


def test_sliding_layers_are_planned_at_their_window() -> None:
    cfg = T.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=256)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    shape = kv_shape_from_config(cfg)
    assert (shape.full_layers, shape.sliding_layers, shape.window) == (1, 3, 8)
    for tokens in (5, 9, 40):
        assert _measured_kv_bytes(model, tokens) == shape.bytes_for(tokens), tokens
    # past the window only the full layer grows
    assert shape.bytes_for(41) - shape.bytes_for(40) == 2 * 16 * 2 * 4


def test_weight_bytes_count_tied_tensors_once_and_match_the_safetensors_headers(
    tmp_path: Path,
) -> None:
    model = tiny_model("llama", tie_word_embeddings=True)
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert weight_bytes(model) == sum(params.values()) + buffers
    model.save_pretrained(tmp_path)
    assert weight_bytes_from_dir(tmp_path) == sum(params.values())
    assert weight_bytes_from_dir(tmp_path, "bfloat16") == sum(params.values()) // 2
    with pytest.raises(InvalidInputError, match="no \\*.safetensors"):
        weight_bytes_from_dir(tmp_path / "nowhere")


def test_an_engine_keeps_nothing_beside_the_models_weights() -> None:
    """The plan counts the weights only: an engine adds no copy of them, before or after a
    request."""
    from semcomm.engine import HFEngine
    from semcomm.kv import MemoryStore

    model = tiny_model("llama")
    before = weight_bytes(model)
    engine = HFEngine(model, store=MemoryStore(), chunk_size=16, device="cpu")
    engine.generate(list(range(3, 40)), max_new_tokens=4)
    assert weight_bytes(model) == before


@pytest.mark.skipif(not is_pulled("smollm2-135m-instruct"), reason="smollm2 not pulled")
def test_real_model_plan_matches_the_loaded_model() -> None:
    path = model_path("smollm2-135m-instruct", pull_missing=False)
    model = T.AutoModelForCausalLM.from_pretrained(path).eval()
    shape = kv_shape_from_config(model.config)
    # 30 layers x 3 KV heads x (64 + 64) x 4 bytes
    assert shape.bytes_per_token == 30 * 3 * 128 * 4
    assert _measured_kv_bytes(model, 33) == shape.bytes_for(33)
    planned = weight_bytes_from_dir(path)
    assert abs(weight_bytes(model) - planned) <= 64 * 1024  # rotary buffers only


def _plan(limit: int | None, *, pinned: bool = True, budget: int = 2**20) -> MemoryPlan:
    shape = kv_shape_from_config(tiny_model("qwen2").config)
    return MemoryPlan(limit_bytes=limit, baseline_bytes=100 * 2**20, prefix_cache_bytes=2**20,
                      models={"m": ModelPlan("m", weight_bytes=50 * 2**20, kv=shape,
                                             max_context=256, kv_budget_bytes=budget,
                                             pinned=pinned)})


def test_a_plan_that_does_not_fit_is_refused_with_the_numbers() -> None:
    ok = _plan(400 * 2**20)
    ok.check()
    assert ok.planned_bytes == 100 * 2**20 + 2**20 + 50 * 2**20 + 2**20
    with pytest.raises(ConfigError, match=r"memory_bytes = 120\.0 MiB.*weights 50\.0 MiB \(pinned\)"):
        _plan(120 * 2**20).check()
    with pytest.raises(ConfigError, match="below the plan's"):
        _plan(151 * 2**20 + 2**19).check()
    _plan(None).check()  # no limit, nothing to refuse


def test_kv_admission_waits_then_refuses_and_frees_on_release() -> None:
    plan = _plan(None, budget=0)
    m = plan.models["m"]
    one = m.kv.bytes_for(100)
    m.kv_budget_bytes = int(one * 1.5)  # room for one 100-token request at a time
    acct = KVAccountant(plan.models, max_wait_s=0.2)
    r1 = acct.reserve("m", 100)
    assert acct.live_bytes("m") == one
    t0 = time.monotonic()
    with pytest.raises(OverloadedError) as err:
        acct.reserve("m", 100)
    assert time.monotonic() - t0 >= 0.2 and err.value.retry_after_s > 0
    assert acct.refused["m"] == 1
    # a waiting request gets in once the running one finishes
    threading.Timer(0.05, acct.release, args=(r1,)).start()
    r2 = acct.reserve("m", 100, wait_s=2.0)
    acct.release(r2)
    acct.release(r2)  # idempotent
    assert acct.live_bytes("m") == 0
    with pytest.raises(OverloadedError, match="KV budget"):
        acct.reserve("m", 250)  # can never fit: refused at once
    with pytest.raises(InvalidInputError, match="max_context"):
        acct.reserve("m", 300)
    assert acct.reserve("upstream-model", 10).nbytes == 0  # not ours to plan


def test_build_plan_shares_what_the_limit_leaves_and_keeps_set_budgets() -> None:
    from semcomm.runtime._memplan import ModelFacts, build_plan

    a, b = tiny_model("llama"), tiny_model("qwen2")
    facts = {
        "a": ModelFacts(a.config, weight_bytes(a), True, max_context=128, kv_bytes=2**20),
        "b": ModelFacts(b.config, weight_bytes(b), True, max_context=128, pinned=True),
    }
    plan = build_plan(facts, limit_bytes=64 * 2**20, prefix_cache_bytes=4 * 2**20,
                      baseline_bytes=32 * 2**20)
    assert plan.models["a"].kv_budget_bytes == 2**20  # set in the config: kept
    left = 64 * 2**20 - 32 * 2**20 - 4 * 2**20 - weight_bytes(a) - weight_bytes(b) - 2**20
    assert plan.models["b"].kv_budget_bytes == left  # the only model without a budget
    assert plan.planned_bytes == 64 * 2**20  # the whole limit is planned
    plan.check()
    unlimited = build_plan({"b": ModelFacts(b.config, 1, False, max_context=100, max_batch=3)},
                           limit_bytes=None, prefix_cache_bytes=0, baseline_bytes=0)
    shape = kv_shape_from_config(b.config)
    assert unlimited.models["b"].kv_budget_bytes == 3 * shape.bytes_for(100)
    assert unlimited.as_dict()["models"]["b"]["kv_bytes_per_token"] == shape.bytes_per_token


def test_the_plan_counts_each_models_anchor_pool(tmp_path: Path) -> None:
    """``[models.X] anchor_bytes`` is memory the process holds between requests: in the
    model's planned bytes, taken out of what the limit leaves for KV budgets, in the rows
    ``serve --check`` prints; a model without a pool is planned as before."""
    from semcomm.runtime._memplan import ModelFacts, build_plan
    from semcomm.server._wiring import plan_config

    a = tiny_model("llama")
    facts = {"a": ModelFacts(a.config, weight_bytes(a), True, max_context=128,
                             anchor_bytes=3 * 2**20)}
    plan = build_plan(facts, limit_bytes=64 * 2**20, prefix_cache_bytes=0,
                      baseline_bytes=32 * 2**20)
    m = plan.models["a"]
    assert m.anchor_budget_bytes == 3 * 2**20
    assert m.kv_budget_bytes == 64 * 2**20 - 32 * 2**20 - weight_bytes(a) - 3 * 2**20
    assert plan.planned_bytes == 64 * 2**20
    assert plan.as_dict()["models"]["a"]["anchor_budget_bytes"] == 3 * 2**20
    assert any("+ 3.0 MiB anchors" in row[3] for row in plan.rows())
    cfg = _server(tmp_path, anchor_bytes=2**20)
    checked = plan_config(cfg).models["tiny"]
    assert checked.anchor_budget_bytes == 2**20
    assert checked.planned_bytes == checked.weight_bytes + checked.kv_budget_bytes + 2**20
    assert plan_config(_server(tmp_path)).models["tiny"].anchor_budget_bytes == 0
    with pytest.raises(ConfigError, match="anchor_bytes"):
        _server(tmp_path, anchor_bytes=2**20, kv_cache=False)


# ------------------------------------------------------------- in the server
def _server(tmp: Path, **model: object):  # type: ignore[no-untyped-def]
    from semcomm.server import load_config

    return load_config(None, overrides={
        "server": {"state_dir": str(tmp), "kv_wait_s": 0.0},
        "models": {"tiny": {"path": "tiny", **model}},
        "kv": {"tiers": ["memory"], "memory_bytes": 8 * 2**20},
        "semantic": {"enabled": False}}, defaults=False, environ={})


def test_the_server_exports_its_plan_and_what_each_model_holds(tmp_path: Path) -> None:
    from .test_server_support import live_server

    with live_server(_server(tmp_path)) as srv, srv.client() as c:
        r = c.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello there " * 20}]})
        assert r.status_code == 200, r.text
        gw = srv.gateway
        model = gw.backends["tiny"].runner.model
        mem = c.get("/health").json()["memory"]
        m = mem["models"]["tiny"]
        assert m["weight_bytes"] == weight_bytes(model)
        assert m["kv_bytes_per_token"] == kv_shape_from_config(model.config).bytes_per_token
        assert m["kv_live_bytes"] == 0  # the request finished: its reservation is released
        held = gw.kv_store.namespace_bytes()
        assert m["kv_cached_bytes"] == sum(held.values()) > 0  # its prompt's chunks in memory
        assert mem["planned_bytes"] == (mem["baseline_bytes"] + 8 * 2**20 + m["weight_bytes"]
                                        + m["kv_budget_bytes"])
        text = c.get("/metrics").text
        assert f'semcomm_memory_weight_bytes{{model="tiny"}} {float(m["weight_bytes"])}' in text
        assert f'semcomm_memory_kv_bytes{{model="tiny"}} {float(m["kv_bytes"])}' in text
        assert "semcomm_memory_planned_bytes " in text


def test_a_config_that_does_not_fit_is_refused_at_start(tmp_path: Path) -> None:
    from semcomm.server import create_app, load_config

    cfg = _server(tmp_path)
    small = load_config(None, overrides={**cfg.model_dump(), "server": {
        **cfg.server.model_dump(), "memory_bytes": 64 * 2**20}}, defaults=False, environ={})
    with pytest.raises(ConfigError, match=r"memory_bytes = 64\.0 MiB cannot hold.*tiny: weights"):
        create_app(small)


def test_requests_beyond_the_kv_budget_get_429_with_retry_after(tmp_path: Path) -> None:
    from .test_server_support import live_server

    # room for one short request's KV, not for a long one
    cfg = _server(tmp_path, kv_bytes=40_000)
    with live_server(cfg) as srv, srv.client() as c:
        ok = c.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text
        big = c.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": "word " * 200}]})
        assert big.status_code == 429, big.text
        assert int(big.headers["Retry-After"]) >= 1 and "KV budget" in big.text
        assert srv.gateway.memory.accountant.live_bytes("tiny") == 0


def test_serve_check_prints_the_plan_and_refuses_one_that_does_not_fit(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    cfg = tmp_path / "semcomm.toml"
    body = ('[server]\nstate_dir = "{}"\n{}\n[models.tiny]\npath = "tiny"\nmax_context = 256\n'
            '[semantic]\nenabled = false\n')
    cfg.write_text(body.format(tmp_path, ""))
    cmd = [sys.executable, "-m", "semcomm.cli", "serve", "--check", "--config", str(cfg)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    ok = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    plan = json.loads(ok.stdout)["memory_plan"]
    m = plan["models"]["tiny"]
    assert m["weight_bytes"] > 0 and m["max_context"] == 256
    assert plan["planned_bytes"] == (plan["baseline_bytes"] + plan["prefix_cache_bytes"]
                                     + m["weight_bytes"] + m["kv_budget_bytes"])
    assert "memory plan" in ok.stderr and "planned" in ok.stderr
    cfg.write_text(body.format(tmp_path, "memory_bytes = 104857600"))  # 100 MiB < baseline
    bad = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert "memory_bytes = 100.0 MiB cannot hold" in bad.stderr.replace("\n", " ")


_VERIFIER_PROBE = r"""
import json, sys
from semcomm.server import create_app, load_config
from semcomm.runtime._memplan import current_rss_bytes

cfg = load_config(None, overrides={
    "server": {"state_dir": sys.argv[1], "torch_threads": 1},
    "models": {"tiny": {"path": "tiny"}},
    "kv": {"tiers": ["memory"], "memory_bytes": 2**20, "chunk_size": 8},
    "semantic": {"enabled": True, "backend": "memory"}}, defaults=False, environ={})
gw = create_app(cfg).state.gateway
scorer = gw.semantic.cache.policy.scorer
calls_at_build = scorer.calls
rss_built = current_rss_bytes()
import asyncio
asyncio.run(gw.startup())
print(json.dumps({"verifier": type(scorer).__name__, "calls_at_build": calls_at_build,
                  "baseline": gw.memory.plan.baseline_bytes, "rss_built": rss_built,
                  "rss_warm": current_rss_bytes(), "up": gw.semantic.up}))
"""


def test_the_plan_baseline_counts_the_semantic_embedder_and_cross_encoder(tmp_path: Path
                                                                         ) -> None:
    """The embedder and the verifier (about 90 MB each) are loaded before the baseline is
    measured, so the gateway's warm-up adds next to nothing the plan did not count (a fresh
    process: nothing cached)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _VERIFIER_PROBE, str(tmp_path)], check=True,
                         capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1",
                              "HF_HUB_OFFLINE": "1"})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["verifier"] == "CrossEncoderVerifier" and got["up"]
    assert got["calls_at_build"] >= 1  # loaded (and run once) before the plan was made
    # warm-up loads nothing big the plan did not count (it added 105 MiB when both loaded there)
    assert got["rss_warm"] - got["rss_built"] < 24 * 2**20


# ------------------------------------------------ the plan against what the engine holds

@pytest.mark.skipif(not is_pulled("smollm2-135m-instruct"), reason="smollm2 not pulled")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_before_load_is_what_the_engine_holds(tmp_path: Path, dtype: str) -> None:
    """SmolLM2 through ``serve --check``'s plan, then loaded by the engine with the same
    ``dtype``: the same weight bytes (rotary buffers apart), nothing beside them."""
    from semcomm.engine import HFEngine
    from semcomm.server import load_config
    from semcomm.server._wiring import plan_config

    cfg = load_config(None, overrides={
        "server": {"state_dir": str(tmp_path)},
        "models": {"small": {"path": "smollm2-135m-instruct", "max_context": 256,
                             "dtype": dtype}},
        "kv": {"tiers": ["memory"], "memory_bytes": 2**20},
        "semantic": {"enabled": False}}, defaults=False, environ={})
    planned = int(plan_config(cfg).models["small"].weight_bytes)
    path = model_path("smollm2-135m-instruct", pull_missing=False)
    eng = HFEngine(str(path), device="cpu", dtype=dtype)
    eng.generate("The capital of France is", max_new_tokens=4)
    assert abs(weight_bytes(eng.model) - planned) <= 64 * 1024  # rotary buffers only
