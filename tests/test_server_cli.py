"""`semcomm serve` as users run it: a subprocess on a free port, embedded defaults, offline."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from semcomm.errors import ConfigError
from semcomm.server import load_config

from .test_server_support import free_port


@contextmanager
def serve(args: list[str], env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from semcomm.cli import main; main()", "serve", "--port",
         str(port), "--log-level", "warning", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                raise AssertionError(f"semcomm serve exited {proc.returncode}: {out[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise AssertionError("semcomm serve did not come up")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", SEMCOMM_HOME=str(tmp_path / "home"))
    return e


def _chat_both_ways(url: str, key: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    models = [m.id for m in client.models.list()]
    # the embedded default serves the real catalog models, the small one first
    assert models[:2] == ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"], models
    msgs = [{"role": "user", "content": "Hello, what can you do?"}]
    raw = client.chat.completions.with_raw_response.create(model=models[0], messages=msgs,
                                                           max_tokens=5)
    assert raw.headers["x-semcomm-hits"] in ("none", "semantic") or \
        raw.headers["x-semcomm-hits"].startswith("kv:")
    answer = raw.parse().choices[0].message.content
    assert answer and any(c.isalpha() for c in answer), answer  # real text from the real model
    # model "auto": the shipped router picks one of the two real models
    auto = client.chat.completions.create(model="auto", messages=msgs, max_tokens=3)
    assert auto.model in models[:2], auto.model
    chunks = list(client.chat.completions.create(model=models[0], messages=msgs, max_tokens=5,
                                                 stream=True))
    assert chunks and chunks[0].object == "chat.completion.chunk"
    # with keys configured, /metrics needs the admin key (single-user: open to anyone)
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer adm-key"}).text
    families = [ln for ln in metrics.splitlines() if ln.startswith("# TYPE ")]
    assert families and all(ln.split()[2].startswith("semcomm_") for ln in families)


def test_serve_contract_with_and_without_config(env: dict[str, str], tmp_path: Path) -> None:
    cfg = tmp_path / "semcomm.toml"
    cfg.write_text('[server]\nadmin_key = "adm-key"\n[tenants.acme]\napi_key = "k1"\n')
    env2 = dict(env, SEMCOMM_HOME=str(tmp_path / "home2"))
    with serve([], env) as plain, serve(["--config", str(cfg)], env2) as tenanted:
        _chat_both_ways(plain, "any-key")
        _chat_both_ways(tenanted, "k1")
        r = httpx.post(f"{tenanted}/v1/chat/completions",
                       json={"model": "smollm2-135m-instruct", "messages": [{"role": "user",
                                                                   "content": "x"}]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{tenanted}/v1/chat/completions", headers={"Authorization": "Bearer zz"},
                       json={"model": "smollm2-135m-instruct", "messages": []})
        assert r.status_code in (400, 401)


def test_serve_rejects_a_bad_config_with_the_key_named(env: dict[str, str], tmp_path: Path
                                                      ) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[server]\nport = "eighty"\n[tenants.acme]\napi_kee = "k1"\n')
    out = subprocess.run([sys.executable, "-c", "from semcomm.cli import main; main()", "serve",
                          "--config", str(cfg)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "server.port" in out.stderr and "tenants.acme" in out.stderr


@pytest.mark.parametrize(("toml", "needle"), [
    ("[kv]\ntiers = ['redis']\n", "redis_url"),
    ("[models.m]\nkind = 'upstream'\n", "base_url"),
    ("[pipelines.p]\nstages = [{model = 'nope'}]\n", "pipelines.p.stages.0.model"),
    ("[tenants.a]\napi_key = 'x'\n[tenants.b]\napi_key = 'x'\n", "same key"),
    ("[routing]\ndefault_model = 'ghost'\n", "routing.default_model"),
    ("[server\n", "not valid TOML"),
])
def test_config_errors_name_the_key(tmp_path: Path, toml: str, needle: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(toml)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(p, environ={})


def test_env_overrides_and_defaults(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[tenants.acme]\napi_key = "k1"\n')
    cfg = load_config(p, environ={"SEMCOMM__SERVER__PORT": "9123",
                                  "SEMCOMM__TENANTS__BETA__API_KEY": "k2",
                                  "SEMCOMM__SEMANTIC__ENABLED": "false",
                                  "SEMCOMM__KV__TIERS": '["memory"]'})
    assert cfg.server.port == 9123 and cfg.semantic.enabled is False
    assert cfg.kv.tiers == ["memory"]
    assert {t: c.api_key for t, c in cfg.tenants.items()} == {"acme": "k1", "beta": "k2"}
    assert "smollm2-135m-instruct" in cfg.models and "semcomm-chain" in cfg.pipelines  # defaults kept
    assert not cfg.anonymous_allowed
    with pytest.raises(ConfigError, match="server.port"):
        load_config(None, environ={"SEMCOMM__SERVER__PORT": "not-a-port"})


def test_a_file_with_its_own_models_drops_the_embedded_router_and_pipelines(tmp_path: Path) -> None:
    """The embedded default's model router routes only its own two models: a file that brings
    its own models gets neither it nor the embedded pipelines (and still loads)."""
    p = tmp_path / "own.toml"
    p.write_text('[models.mine]\npath = "tiny"\n')
    cfg = load_config(p, environ={})
    assert list(cfg.models) == ["mine"] and not cfg.pipelines
    assert cfg.routing.model_router is None
    p.write_text('[models.mine]\npath = "tiny"\n[routing]\nmodel_router = "r.json"\n')
    assert load_config(p, environ={}).routing.model_router == "r.json"  # an own router is kept
    default = load_config(None, environ={})
    assert default.routing.model_router == "smollm2-qwen2.5-coder"
    assert default.pipelines["semcomm-chain"].handoff == "text"  # its router step writes text
