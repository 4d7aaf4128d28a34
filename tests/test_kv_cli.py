"""``semcomm kv`` commands on a real disk directory and a real Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


# --- seals, and directories that are not stores -------------------------------------------------

SECRET = "kv-cli-test-secret-0123456789abcdef"


def _sealed_store(root: Path, n: int = 4) -> list[tuple[Any, bytes]]:
    from semcomm.security import ChunkSealer, TenantKeyring

    store = DiskStore(root, sealer=ChunkSealer(TenantKeyring(SECRET)))
    c = chain(n)
    for k, v in c:
        store.put(k, v)
    store.close()
    return c


def _forge(root: Path, key: Any) -> None:
    """Flip one payload byte of a sealed chunk and recompute its checksum: the checksum passes,
    only the seal can tell."""
    import xxhash

    f = root / key.hex()[:2] / f"{key.hex()}.sckv"
    data = bytearray(f.read_bytes())
    data[-40] ^= 1
    data[-16:] = xxhash.xxh3_128_digest(bytes(data[:-16]))
    f.write_bytes(bytes(data))


def test_verify_checks_seals_with_the_servers_key(cli: typer.Typer, tmp_path: Path) -> None:
    c = _sealed_store(tmp_path / "kv")
    _forge(tmp_path / "kv", c[2][0])
    home = tmp_path / "home"
    home.mkdir()
    without = CliRunner(env={"COLUMNS": "200", "SEMCOMM_HOME": str(home), "SEMCOMM_SECRET": None})
    out = without.invoke(cli, ["kv", "verify", str(tmp_path / "kv")])
    assert out.exit_code == 0 and "4 of 4 chunks valid" in out.output
    assert "seals NOT checked" in out.output and "4 sealed chunks" in out.output
    assert sorted(p.name for p in home.iterdir()) == []  # no secret file was made
    wrong = CliRunner(env={"COLUMNS": "200", "SEMCOMM_SECRET": "another-secret-0123456789ab"})
    out = wrong.invoke(cli, ["kv", "verify", str(tmp_path / "kv")])
    assert out.exit_code == 1 and "wrong secret" in out.output and "Nothing removed" in out.output
    assert len(list(DiskStore(tmp_path / "kv").scan())) == 4
    right = CliRunner(env={"COLUMNS": "200", "SEMCOMM_SECRET": SECRET})
    out = right.invoke(cli, ["kv", "verify", str(tmp_path / "kv")])
    assert out.exit_code == 1, out.output
    assert "3 of 4 chunks valid" in out.output and "1 failed their seal" in out.output
    out = right.invoke(cli, ["kv", "verify", str(tmp_path / "kv")])
    assert out.exit_code == 0 and "3 of 3 chunks valid" in out.output
    assert "seals of 3 sealed chunks checked" in out.output


def test_verify_takes_the_key_from_a_server_config(cli: typer.Typer, tmp_path: Path) -> None:
    c = _sealed_store(tmp_path / "kv")
    _forge(tmp_path / "kv", c[0][0])
    toml = tmp_path / "s.toml"
    toml.write_text(f'[server]\nsecret = "{SECRET}"\n')
    runner = CliRunner(env={"COLUMNS": "200", "SEMCOMM_SECRET": None,
                            "SEMCOMM_HOME": str(tmp_path / "home")})
    out = runner.invoke(cli, ["kv", "verify", str(tmp_path / "kv"), "--config", str(toml)])
    assert out.exit_code == 1 and "1 failed their seal" in out.output, out.output


@pytest.mark.parametrize("cmd", [["stats"], ["verify"], ["clear", "--yes"]])
def test_commands_never_touch_a_directory_that_is_not_a_store(cli: typer.Typer, tmp_path: Path,
                                                               cmd: list[str]) -> None:
    from semcomm.errors import ConfigError

    plain = tmp_path / "photos"
    plain.mkdir()
    (plain / "cat.jpg").write_bytes(b"meow")
    out = CliRunner().invoke(cli, ["kv", cmd[0], str(plain), *cmd[1:]])
    assert out.exit_code != 0 and isinstance(out.exception, ConfigError)
    assert "not a semcomm KV store" in str(out.exception)
    assert sorted(p.name for p in plain.iterdir()) == ["cat.jpg"]
