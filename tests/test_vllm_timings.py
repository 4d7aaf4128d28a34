"""The vLLM connector's timing log (SEMCOMM_VLLM_TIMINGS) and the load's read/copy split.

Both are what ``benchmarks.vllm.check`` reads to say where a warm request's time went; they
run without vLLM (``semcomm.integrations._vllm_core``).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from semcomm.integrations._vllm_core import (
    LoadSpec,
    Timings,
    load_into,
    load_slot_bytes,
    page_faults,
)
from semcomm.kv import DiskStore, get_codec, staging_buffer

from ._vllm_chunks import save_random_chunks

L, H, BS, D, CS = 2, 2, 4, 8, 8  # layers, kv heads, block size, head size, chunk tokens


def test_timings_append_one_json_line_per_record(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    t = Timings(str(log))
    t.record("lookup", 12.5, 0.0003, req="r1", matched=64)
    t.record("load", 12.6, 0.0185, chunks=16)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x["event"], x["at"], x["ms"]) for x in lines] == [("lookup", 12.5, 0.3),
                                                             ("load", 12.6, 18.5)]
    assert lines[0]["req"] == "r1" and lines[1]["chunks"] == 16 and "pid" in lines[0]
    # the process's page faults so far, at each record: counters that never go down
    assert all(isinstance(x["minflt"], int) and isinstance(x["majflt"], int) for x in lines)
    assert lines[1]["minflt"] >= lines[0]["minflt"] > 0


def test_page_faults_count_the_first_touch_of_fresh_memory() -> None:
    import mmap

    size = 64 << 20
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    before = page_faults()
    for off in range(0, size, mmap.PAGESIZE):  # one write per page: one fault each at least
        m[off] = 1                              # (fewer with huge pages, never none)
    minor, major = page_faults()
    m.close()
    assert minor - before[0] >= size // (2 << 20) and major >= before[1]


def test_timings_from_several_threads_never_interleave(tmp_path: Path) -> None:
    log = tmp_path / "t.jsonl"
    t = Timings(str(log))

    def burst(i: int) -> None:
        for j in range(200):
            t.record("forward_end", float(j), 0.0, thread=i, pad="x" * 300)

    threads = [threading.Thread(target=burst, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    lines = log.read_text().splitlines()
    assert len(lines) == 800 and all(json.loads(x)["event"] == "forward_end" for x in lines)


def test_timings_off_writes_nothing_and_a_bad_path_turns_them_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    Timings(None).record("load", 1.0, 0.1)  # unset: a no-op
    Timings("").record("load", 1.0, 0.1)
    assert list(tmp_path.iterdir()) == []
    bad = Timings(str(tmp_path / "missing" / "t.jsonl"))
    bad.record("load", 1.0, 0.1)  # never raises
    assert bad.path is None and "cannot write" in caplog.text


def test_load_into_reports_its_read_and_copy_time(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, refresh_s=None)
    ns, keys = save_random_chunks(store, 3, layers=L, heads=H, chunk=CS, head_size=D, seed=3)
    caches = [torch.zeros(12, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    per = CS // BS
    spec = LoadSpec(req_id="r", namespace=ns, keys=tuple(keys[:3]), first_chunk=0,
                    block_ids=tuple(tuple(range(1 + c * per, 1 + (c + 1) * per))
                                    for c in range(3)), skip_blocks=0)
    slot = load_slot_bytes(caches, CS, BS)
    times: dict[str, float] = {}
    n = load_into(store, spec, caches, chunk_size=CS, block_size=BS, dtype="bfloat16",
                  codec=get_codec("lossless"), buffer=staging_buffer(2 * slot),
                  slot_bytes=slot, times=times)
    assert n == 3
    assert set(times) == {"read_s", "write_s", "read_minflt", "write_minflt"}
    assert times["read_s"] > 0 and times["write_s"] > 0
    assert all(isinstance(times[k], int) and times[k] >= 0 for k in ("read_minflt",
                                                                       "write_minflt"))
    assert any(bool(c[1:].any()) for c in caches)  # the chunks were written into the blocks
