"""semcomm._native: the once-per-process holder and opening what a build made."""

from __future__ import annotations

import threading
from pathlib import Path

from semcomm._native import OncePerProcess, open_built


def test_once_per_process_makes_once_even_when_unavailable() -> None:
    calls: list[int] = []

    def make() -> object | None:
        calls.append(1)
        return None  # cannot run here

    held = OncePerProcess(make)
    assert held.get() is None and held.get() is None
    assert len(calls) == 1  # an unavailable kernel is not tried (compiled) again


def test_once_per_process_gives_every_thread_the_same_value() -> None:
    calls: list[int] = []

    def make() -> object:
        calls.append(1)
        return object()

    held = OncePerProcess(make)
    got: list[object | None] = []
    threads = [threading.Thread(target=lambda: got.append(held.get())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(v) for v in got}) == 1


def test_open_built_turns_a_missing_build_or_a_failed_open_into_none(tmp_path: Path) -> None:
    assert open_built(lambda p: p, None, "k") is None
    lib = tmp_path / "k.so"
    assert open_built(lambda p: p.name, lib, "k") == "k.so"

    def broken(p: Path) -> str:
        raise OSError(f"cannot load {p}")

    assert open_built(broken, lib, "k") is None

    def wrong(p: Path) -> str:
        raise ValueError("not an expected failure")

    try:
        open_built(wrong, lib, "k")
    except ValueError:
        pass
    else:
        raise AssertionError("an error outside `errors` must not be swallowed")
