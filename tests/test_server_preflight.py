"""A bad path or a missing file named by the config: one line naming the key, before any model
loads, from ``semcomm serve`` and ``semcomm serve --check`` alike (which creates nothing)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from semcomm.errors import ConfigError
from semcomm.server import load_config, preflight


def _cfg(tmp: Path, **over: object) -> object:
    base: dict[str, object] = {"server": {"state_dir": str(tmp / "state")},
                               "models": {"tiny": {"path": "tiny"}},
                               "kv": {"tiers": ["memory", "disk"]},
                               "semantic": {"backend": "sqlite"}}
    for k, v in over.items():
        section, key = k.split("__")
        base.setdefault(section, {})[key] = v  # type: ignore[index]
    return load_config(None, overrides=base, defaults=False, environ={})


def _file(tmp: Path) -> Path:
    f = tmp / "a-file"
    f.write_text("x")
    return f


def _readonly(tmp: Path) -> Path:
    d = tmp / "ro"
    d.mkdir()
    d.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return d


CASES: list[tuple[str, Callable[[Path], dict[str, object]], str]] = [
    ("state dir is a file", lambda t: {"server__state_dir": str(_file(t))}, "server.state_dir"),
    ("kv dir under a file", lambda t: {"kv__disk_path": str(_file(t) / "kv")}, "kv.disk_path"),
    ("kv dir is a file", lambda t: {"kv__disk_path": str(_file(t))}, "kv.disk_path"),
    ("sqlite path is a directory", lambda t: {"semantic__path": str(t)}, "semantic.path"),
    ("missing model router", lambda t: {"routing__model_router": str(t / "router.json")},
     "routing.model_router"),
    ("model router not JSON", lambda t: {"routing__model_router": str(_file(t))},
     "routing.model_router"),
]


@pytest.mark.parametrize(("make", "key"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_preflight_names_the_key_and_creates_nothing(tmp_path: Path, make: Callable[
        [Path], dict[str, object]], key: str) -> None:
    cfg = _cfg(tmp_path, **make(tmp_path))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        preflight(cfg, create=False)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_preflight_refuses_a_read_only_directory(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, server__state_dir=str(_readonly(tmp_path) / "state"))
    with pytest.raises(ConfigError, match="not writable"):
        preflight(cfg, create=False)  # type: ignore[arg-type]


def test_preflight_of_a_good_config_creates_only_with_create(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    preflight(cfg, create=False)  # type: ignore[arg-type]
    assert not (tmp_path / "state").exists()
    preflight(cfg)  # type: ignore[arg-type]
    assert (tmp_path / "state" / "kv").is_dir()


@pytest.mark.parametrize("check", [False, True], ids=["serve", "serve --check"])
def test_serve_says_one_line_for_a_bad_path(tmp_path: Path, check: bool) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(f'[server]\nstate_dir = "{_file(tmp_path)}"\n[models.tiny]\npath = "tiny"\n'
                    '[routing]\nmodel_router = "none-such.json"\n')
    env = dict(os.environ, SEMCOMM_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", "from semcomm.cli import main; main()", "serve",
                          "--config", str(toml), *(["--check"] if check else [])],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "server.state_dir" in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 3  # one message (wrapped by the console)


def test_home_is_a_file_gives_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, SEMCOMM_HOME=str(_file(tmp_path)))
    env.pop("SEMCOMM_SECRET", None)
    out = subprocess.run([sys.executable, "-c", "from semcomm.cli import main; main()",
                          "security", "salt-digest", "acme"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "SEMCOMM_HOME" in out.stderr
