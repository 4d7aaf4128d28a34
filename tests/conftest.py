"""Shared fixtures: a real redis-server, an isolated SEMCOMM_HOME."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ._redis import RedisServer, running_redis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Real catalog models are pulled once into the user's models home and shared by every test
# (the per-test SEMCOMM_HOME below would otherwise pull and convert them again each time).
if "SEMCOMM_MODELS" not in os.environ:
    from semcomm.models import models_home

    os.environ["SEMCOMM_MODELS"] = str(models_home())


@pytest.fixture(autouse=True)
def _semcomm_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test session gets its own secret file; nothing touches the user's ~/.cache."""
    home = tmp_path_factory.getbasetemp() / "semcomm-home"
    monkeypatch.setenv("SEMCOMM_HOME", str(home))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of the suite's own on a free loopback port (session-wide)."""
    with running_redis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the suite's redis-server, flushed before each test."""
    if redis_server.proc is None:
        redis_server.start()
    redis_server.flush()
    yield redis_server.url


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server for one test alone (outage tests stop and restart it)."""
    with running_redis() as server:
        yield server


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch at one thread for the test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
