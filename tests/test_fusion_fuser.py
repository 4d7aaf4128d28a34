"""Fuser shapes, layer mapping, gates, save/load and clear errors on mismatched pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from semcomm.errors import (
    ConfigError,
    CorruptEntryError,
    NamespaceMismatchError,
    UnsupportedModelError,
)
from semcomm.fusion import (
    Fuser,
    FuserConfig,
    ModelSpec,
    estimate_parameters,
    layer_mapping,
    load_fuser,
    model_spec,
    save_fuser,
)

from ._fusion_helpers import _one_thread  # noqa: F401  (autouse fixture)


def spec(layers: int, heads: int, dim: int, fp: str = "") -> ModelSpec:
    return ModelSpec("toy", layers, heads, dim, 100, fp)


@pytest.mark.parametrize(
    ("strategy", "n_recv", "n_sharer", "expected"),
    [
        ("last_aligned", 4, 6, [2, 3, 4, 5]),
        ("last_aligned", 6, 4, [0, 0, 0, 1, 2, 3]),  # extra receiver layers clamp to sharer 0
        ("last_aligned", 3, 3, [0, 1, 2]),
        ("uniform", 3, 5, [0, 2, 4]),
        ("uniform", 5, 2, [0, 0, 0, 1, 1]),  # round half to even
        ("first_aligned", 4, 2, [0, 1, 1, 1]),
        ([1, 0, 1], 3, 2, [1, 0, 1]),
    ],
)
def test_layer_mapping_table(strategy, n_recv, n_sharer, expected) -> None:
    assert layer_mapping(strategy, n_recv, n_sharer) == expected


def test_layer_mapping_real_pairs() -> None:
    # Qwen3-0.6B (28) <- Qwen2.5-0.5B (24): receiver layers 0-4 read sharer layer 0
    m = layer_mapping("last_aligned", 28, 24)
    assert m[:5] == [0] * 5 and m[5] == 1 and m[-1] == 23
    assert layer_mapping("last_aligned", 28, 36) == list(range(8, 36))


@pytest.mark.parametrize(
    ("mapping", "message"),
    [("nearest", "unknown strategy"), ([0, 1], "2 entries"), ([0, 1, 9], "out of range")],
)
def test_layer_mapping_errors(mapping, message) -> None:
    with pytest.raises(ConfigError, match=message):
        layer_mapping(mapping, 3, 4)


@pytest.mark.parametrize(
    ("sharer", "receiver"),
    [
        (spec(3, 1, 16), spec(2, 2, 32)),  # GQA 1 head x16 -> 2 heads x32, deeper sharer
        (spec(2, 4, 8), spec(5, 2, 16)),  # deeper receiver
        (spec(4, 2, 64), spec(4, 8, 128)),  # Qwen2.5-0.5B-like -> Qwen3-0.6B-like head layouts
    ],
)
def test_fuser_shapes_and_parameter_count(sharer: ModelSpec, receiver: ModelSpec) -> None:
    cfg = FuserConfig(
        sharer=sharer, receiver=receiver, hidden_dim=16, num_blocks=1, intermediate_mult=2
    )
    fuser = Fuser(cfg).eval()
    b, n = 2, 5
    s_layers = [
        (torch.randn(b, sharer.num_kv_heads, n, sharer.head_dim),) * 2
        for _ in range(sharer.num_layers)
    ]
    r_layers = [
        (torch.randn(b, receiver.num_kv_heads, n, receiver.head_dim),) * 2
        for _ in range(receiver.num_layers)
    ]
    fuser.set_gate_mode("open")
    out = fuser.fuse(s_layers, r_layers)
    assert len(out) == receiver.num_layers
    for k, v in out:
        assert k.shape == (b, receiver.num_kv_heads, n, receiver.head_dim) == v.shape
    # exact parameter count: per branch in(Ds*Hs + Dt*Ht -> h, +bias) + blocks + norm + out + weight head + gate
    h, inner = 16, 32
    d_in, d_out = sharer.kv_dim + receiver.kv_dim, receiver.kv_dim
    per_branch = (
        (d_in * h + h)
        + (h + h * inner + inner * h)
        + h
        + (h * d_out + d_out)
        + (h * receiver.num_kv_heads + receiver.num_kv_heads)
        + 1
    )
    assert (
        fuser.num_parameters() == 2 * receiver.num_layers * per_branch == estimate_parameters(cfg)
    )


def test_estimate_for_real_pair_matches_the_paper_scale() -> None:
    # Qwen3-0.6B (28 layers, 8x128) <- Qwen2.5-0.5B (24 layers, 2x64), the paper's fuser size
    cfg = FuserConfig(
        sharer=spec(24, 2, 64),
        receiver=spec(28, 8, 128),
        hidden_dim=1024,
        num_blocks=2,
        intermediate_mult=1.0,
    )
    n = estimate_parameters(cfg)
    assert 3.0e8 < n < 5.5e8  # C2C reports 478 M for its layout (one more FFN per branch)


def _layers(spec_: ModelSpec, n: int = 6, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, spec_.num_kv_heads, n, spec_.head_dim)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for _ in range(spec_.num_layers)
    ]


@pytest.fixture
def pair_fuser() -> Fuser:
    torch.manual_seed(0)
    cfg = FuserConfig(
        sharer=spec(3, 1, 16), receiver=spec(2, 2, 8), hidden_dim=16, num_blocks=1, zero_init=False
    )
    return Fuser(cfg).eval()


def test_closed_gate_leaves_receiver_cache_bit_identical(pair_fuser: Fuser) -> None:
    s, r = _layers(pair_fuser.config.sharer), _layers(pair_fuser.config.receiver, seed=1)
    ref = [(k.clone(), v.clone()) for k, v in r]
    for mode in ("closed", "hard"):
        pair_fuser.set_gate_mode(mode)
        if mode == "hard":  # all gates negative: hard gate closes every branch
            with torch.no_grad():
                pair_fuser.gate_logit.fill_(-1.0)
        out = pair_fuser.fuse(s, r)
        for (k, v), (k0, v0) in zip(out, ref):
            assert torch.equal(k, k0) and torch.equal(v, v0)
    # and an open gate does change it (the test above would pass with fusion off otherwise)
    pair_fuser.set_gate_mode("open")
    out = pair_fuser.fuse(s, r)
    assert not torch.equal(out[0][0], ref[0][0])


def test_mask_limits_fusion_to_shared_tokens(pair_fuser: Fuser) -> None:
    s, r = _layers(pair_fuser.config.sharer), _layers(pair_fuser.config.receiver, seed=1)
    pair_fuser.set_gate_mode("open")
    mask = torch.tensor([[0.0, 1, 1, 0, 1, 0]])
    out = pair_fuser.fuse(s, r, mask)
    for (k, v), (k0, v0) in zip(out, r):
        for t in range(6):
            same = torch.equal(k[:, :, t], k0[:, :, t]) and torch.equal(v[:, :, t], v0[:, :, t])
            assert same == (mask[0, t] == 0)


def test_gate_hard_at_inference_soft_in_training(pair_fuser: Fuser) -> None:
    s, r = _layers(pair_fuser.config.sharer), _layers(pair_fuser.config.receiver, seed=1)
    with torch.no_grad():
        pair_fuser.gate_logit[0::2] = 0.5  # keys open
        pair_fuser.gate_logit[1::2] = -0.5  # values closed
    assert pair_fuser.gates() == {"key": [True, True], "value": [False, False]}
    pair_fuser.eval()  # auto -> hard
    hard = pair_fuser.fuse(s, r)
    for (k, v), (k0, v0) in zip(hard, r):
        assert v is v0 and not torch.equal(k, k0)
    pair_fuser.set_gate_mode("open")
    full = pair_fuser.fuse(s, r)
    pair_fuser.set_gate_mode("auto")
    pair_fuser.train()
    pair_fuser.config.dropout = 0.0
    pair_fuser.set_step(0)
    torch.manual_seed(0)
    soft = pair_fuser.fuse(s, r)
    for layer in range(2):
        for kv in range(2):
            d_full = (full[layer][kv] - r[layer][kv]).detach()
            d_soft = (soft[layer][kv] - r[layer][kv]).detach()
            big = d_full.abs() > 1e-4
            ratio = d_soft[big] / d_full[big]
            # a relaxed gate strictly between closed and open, for values too
            assert float(ratio.min()) > 0 and float(ratio.max()) < 1


def test_temperature_anneals_geometrically(pair_fuser: Fuser) -> None:
    c = pair_fuser.config
    assert pair_fuser.set_step(0) == pytest.approx(c.tau_start)
    assert pair_fuser.set_step(c.anneal_steps // 2) == pytest.approx(
        (c.tau_start * c.tau_end) ** 0.5, rel=1e-2
    )
    assert pair_fuser.set_step(10 * c.anneal_steps) == pytest.approx(c.tau_end)


def test_save_load_round_trip(pair_fuser: Fuser, tmp_path: Path) -> None:
    save_fuser(pair_fuser, tmp_path, extra={"answer_mode": "loglik"})
    loaded = load_fuser(
        tmp_path, sharer=pair_fuser.config.sharer, receiver=pair_fuser.config.receiver
    )
    s, r = _layers(pair_fuser.config.sharer), _layers(pair_fuser.config.receiver, seed=1)
    for f in (pair_fuser, loaded):
        f.set_gate_mode("open")
    for (a, b), (c, d) in zip(pair_fuser.fuse(s, r), loaded.fuse(s, r)):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert loaded.config.to_dict() == pair_fuser.config.to_dict()
    assert json.loads((tmp_path / "fuser.json").read_text())["meta"]["answer_mode"] == "loglik"


def test_load_refuses_other_pair_and_bad_files(pair_fuser: Fuser, tmp_path: Path) -> None:
    cfg = pair_fuser.config
    save_fuser(pair_fuser, tmp_path)
    with pytest.raises(ConfigError, match="built for receiver"):
        load_fuser(tmp_path, sharer=cfg.sharer, receiver=spec(2, 4, 8))
    # same shapes, different models: fingerprints differ
    fp_cfg = FuserConfig(
        sharer=spec(3, 1, 16, "aa"), receiver=spec(2, 2, 8, "bb"), hidden_dim=16, num_blocks=1
    )
    other = tmp_path / "other"
    save_fuser(Fuser(fp_cfg), other)
    with pytest.raises(NamespaceMismatchError, match="trained for another sharer"):
        load_fuser(other, sharer=spec(3, 1, 16, "cc"), receiver=spec(2, 2, 8, "bb"))
    # weights that do not fit the config
    doc = json.loads((tmp_path / "fuser.json").read_text())
    doc["hidden_dim"] = 32
    (tmp_path / "fuser.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="has shape"):
        load_fuser(tmp_path)
    doc["hidden_dim"] = 16
    (tmp_path / "fuser.json").write_text(json.dumps(doc))
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "fuser.safetensors"))
    del state["w_out"]
    save_file(state, str(tmp_path / "fuser.safetensors"))
    with pytest.raises(ConfigError, match="missing"):
        load_fuser(tmp_path)
    (tmp_path / "fuser.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CorruptEntryError, match="unreadable"):
        load_fuser(tmp_path)
    with pytest.raises(ConfigError, match="no fuser config"):
        load_fuser(tmp_path / "nowhere")
    doc["hidden_size"] = 1
    (tmp_path / "fuser.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="unknown keys"):
        load_fuser(tmp_path)


def test_model_spec_reads_layout_and_refuses_sliding_window() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    s = model_spec(Qwen2ForCausalLM(cfg))
    assert (s.num_layers, s.num_kv_heads, s.head_dim) == (2, 2, 8) and len(s.fingerprint) == 32
    assert model_spec(Qwen2ForCausalLM(cfg)).fingerprint != s.fingerprint  # other weights
    cfg_sw = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
    )
    with pytest.raises(UnsupportedModelError, match="sliding"):
        model_spec(Qwen2ForCausalLM(cfg_sw))
