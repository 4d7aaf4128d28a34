"""Child process for the multi-process store tests: ``python -m tests._kv_worker MODE ...``.

Modes:
    disk PATH SEED N CAPACITY GO write chain(N, seed=SEED) into DiskStore(PATH, CAPACITY) once
                                 the file GO exists (prints "ready" first: a start barrier)
    big PATH [DURABILITY]        write 32 MiB chunks into DiskStore(PATH) until killed
    behind PATH SEED N           put chain(N, seed=SEED) into a write-behind DiskStore(PATH) and
                                 exit without close() or flush() (the atexit hook writes them)
    redis URL SEED N             write chain(N, seed=SEED) into RedisStore(URL)
    redis-read URL SEED N        print how many of chain(N, seed=SEED) it reads back intact
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from semcomm.kv import DiskStore, Namespace, RedisStore, chunk_keys, encode_chunk

from ._kvchunks import chain


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "disk":
        path, seed, n, cap = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        store = DiskStore(path, capacity_bytes=cap)
        items = chain(n, seed=seed, payload=256)
        print("ready", flush=True)
        while not os.path.exists(argv[5]):
            time.sleep(0.001)
        for key, value in items:
            store.put(key, value)
        return 0
    if mode == "behind":
        store = DiskStore(argv[1], durability="write-behind")
        for key, value in chain(int(argv[3]), seed=int(argv[2]), payload=4096):
            store.put(key, value)
        print("queued", flush=True)
        return 0  # no close(): what is still queued is written at interpreter exit
    if mode == "big":
        store = DiskStore(argv[1], durability=argv[2] if len(argv) > 2 else "flush")
        ns = Namespace(model="big", tokenizer="", dtype="float32", codec="none", tenant="t")
        keys = chunk_keys(ns.digest, list(range(10_000)), 1)
        rng = np.random.default_rng(0)
        arr = rng.standard_normal(8 << 20, dtype=np.float32)  # 32 MiB per chunk
        for i, key in enumerate(keys):
            value = encode_chunk(namespace=ns.digest, key=key, parent=None, num_tokens=1,
                                 start=i, dtype="float32", codec="none", codec_params={},
                                 arrays={"k.0": arr})
            store.put(key, value)
            print(f"wrote {i}", flush=True)
        return 0
    if mode == "redis":
        rstore = RedisStore(argv[1])
        for key, value in chain(int(argv[3]), seed=int(argv[2])):
            rstore.put(key, value)
        return 0
    if mode == "redis-read":
        rstore = RedisStore(argv[1])
        items = chain(int(argv[3]), seed=int(argv[2]))
        print(sum(rstore.get(k) == v for k, v in items))
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
