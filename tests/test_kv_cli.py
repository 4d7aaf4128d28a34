"""``semcomm kv`` commands on a real disk directory and a real Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from semcomm.cli._kv import register
from semcomm.kv import DiskStore, RedisStore

from ._kvchunks import chain


@pytest.fixture
def cli() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:  # a root callback keeps "kv" as a sub-command
        """test root"""

    return app


def test_help_on_every_command(cli: typer.Typer) -> None:
    runner = CliRunner(env={"COLUMNS": "200"})
    for cmd in ("stats", "verify", "clear"):
        out = runner.invoke(cli, ["kv", cmd, "--help"])
        assert out.exit_code == 0 and "redis:// URL" in out.output


def test_verify_finds_and_removes_corrupt_files(cli: typer.Typer, tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "kv")
    c = chain(3)
    for k, v in c:
        store.put(k, v)
    bad = tmp_path / "kv" / c[1][0].hex()[:2] / f"{c[1][0].hex()}.sckv"
    data = bytearray(bad.read_bytes())
    data[-30] ^= 1
    bad.write_bytes(bytes(data))
    runner = CliRunner(env={"COLUMNS": "200"})
    out = runner.invoke(cli, ["kv", "verify", str(tmp_path / "kv")])
    assert out.exit_code == 1 and "2 of 3 chunks valid; 1 corrupt" in out.output
    out = runner.invoke(cli, ["kv", "stats", str(tmp_path / "kv")])
    assert out.exit_code == 0 and "entries" in out.output
    assert runner.invoke(cli, ["kv", "verify", str(tmp_path / "kv")]).exit_code == 0
    out = runner.invoke(cli, ["kv", "clear", str(tmp_path / "kv"), "--yes"])
    assert out.exit_code == 0 and list(DiskStore(tmp_path / "kv").scan()) == []


def test_stats_never_evicts_and_refuses_missing_dirs(cli: typer.Typer, tmp_path: Path) -> None:
    c = chain(3)
    store = DiskStore(tmp_path / "kv")
    for k, v in c:
        store.put(k, v)
    runner = CliRunner(env={"COLUMNS": "200"})
    assert runner.invoke(cli, ["kv", "stats", str(tmp_path / "kv")]).exit_code == 0
    assert len(list(DiskStore(tmp_path / "kv").scan())) == 3
    out = runner.invoke(cli, ["kv", "stats", str(tmp_path / "nope")])
    assert out.exit_code != 0 and not (tmp_path / "nope").exists()


def test_redis_location(cli: typer.Typer, redis_url: str) -> None:
    store = RedisStore(redis_url)
    for k, v in chain(2):
        store.put(k, v)
    runner = CliRunner(env={"COLUMNS": "200"})
    out = runner.invoke(cli, ["kv", "verify", redis_url])
    assert out.exit_code == 0 and "2 of 2 chunks valid" in out.output
    assert runner.invoke(cli, ["kv", "clear", redis_url, "--yes"]).exit_code == 0
    assert list(store.scan()) == []
