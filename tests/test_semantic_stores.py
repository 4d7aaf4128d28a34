"""Entry stores: SQLite persistence, corruption, two processes; Redis sharing and outages."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import warnings

import pytest

from semcomm import SemanticCache
from semcomm.errors import BackendDownWarning
from semcomm.semantic import CallableEmbedder, SQLiteEntryStore

from ._semantic_helpers import bow_embed


@pytest.fixture
def toy() -> CallableEmbedder:
    return CallableEmbedder(bow_embed, name="bow64")


_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from _semantic_helpers import bow_embed
    from semcomm import SemanticCache
    from semcomm.semantic import CallableEmbedder
    c = SemanticCache(embedder=CallableEmbedder(bow_embed, name="bow64"), {where})
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "store":
            c.store(arg, "from child: " + arg)
            print("ok", flush=True)
        elif cmd == "lookup":
            h = c.lookup(arg)
            print("hit " + h.answer if h else "miss", flush=True)
        elif cmd == "invalidate":
            print("n", c.invalidate(scope="default"), flush=True)
""")


class Child:
    """A second process holding its own SemanticCache on the same store."""

    def __init__(self, where: str) -> None:
        import pathlib

        tests = str(pathlib.Path(__file__).parent)
        self.p = subprocess.Popen([sys.executable, "-c", _CHILD.format(tests=tests, where=where)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, line: str) -> str:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        self.p.wait(timeout=30)


@pytest.fixture
def sqlite_child(tmp_path):
    child = Child(f"path={str(tmp_path / 'shared.sqlite')!r}")
    yield child
    child.close()


def test_sqlite_persists_across_reopen(toy, tmp_path) -> None:
    path = tmp_path / "c.sqlite"
    with SemanticCache(embedder=toy, path=path) as c:
        c.store("how do i bake bread", "flour water salt yeast", tags=["kitchen"], ttl=3600)
    with SemanticCache(embedder=toy, path=path) as c:
        hit = c.lookup("how do i bake bread", tags=["kitchen"])
        assert hit is not None and hit.answer == "flour water salt yeast"
        assert c.lookup("how do i bake bread") is None  # tags survive the round trip
        assert c.stats().store == "sqlite"


@pytest.mark.parametrize("column,value", [
    ("answer", "tampered answer"),
    ("checksum", "0" * 32),
    ("header", "{not json"),
    ("vector", b"\x00\x01"),
    ("version", 99),
])
def test_sqlite_corrupt_rows_are_rejected(toy, tmp_path, column, value) -> None:
    path = tmp_path / "c.sqlite"
    with SemanticCache(embedder=toy, path=path) as c:
        bad = c.store("corrupt me please", "original")
        c.store("leave me alone", "fine")
    db = sqlite3.connect(path)
    db.execute(f"UPDATE entries SET {column} = ? WHERE id = ?", (value, bad))
    db.commit()
    db.close()
    with SemanticCache(embedder=toy, path=path) as c:
        assert c.lookup("corrupt me please") is None  # never served
        assert c.lookup("leave me alone").answer == "fine"
        assert c.stats().corrupt == 1 and len(c) == 1
    (n,) = sqlite3.connect(path).execute("SELECT COUNT(*) FROM entries").fetchone()
    assert n == 1  # the corrupt row was deleted


def test_sqlite_corruption_after_index_load_is_caught_on_read(toy, tmp_path) -> None:
    path = tmp_path / "c.sqlite"
    c = SemanticCache(embedder=toy, path=path)
    bad = c.store("corrupt me later", "original")
    db = sqlite3.connect(path)
    db.execute("UPDATE entries SET answer = 'evil' WHERE id = ?", (bad,))
    db.commit()
    db.close()
    assert c.lookup("corrupt me later") is None
    assert c.stats().corrupt == 1


def test_sqlite_two_processes_share_entries_and_deletes(toy, tmp_path, sqlite_child) -> None:
    c = SemanticCache(embedder=toy, path=tmp_path / "shared.sqlite")
    assert sqlite_child.ask("store where is the train station") == "ok"
    hit = c.lookup("where is the train station")
    assert hit is not None and hit.answer == "from child: where is the train station"
    c.store("what is the wifi password", "hunter2")
    assert sqlite_child.ask("lookup what is the wifi password") == "hit hunter2"
    assert c.invalidate(scope="default") == 2
    assert sqlite_child.ask("lookup what is the wifi password") == "miss"  # delete propagated
    assert sqlite_child.ask("store open hours on sunday") == "ok"
    c.clear()
    assert sqlite_child.ask("lookup open hours on sunday") == "miss"  # clear propagated
    assert c.stats().extra["index_vectors"] == 0


def test_sqlite_change_log_gap_triggers_full_resync(toy, tmp_path) -> None:
    path = tmp_path / "c.sqlite"
    a = SemanticCache(embedder=toy, path=path)
    b = SemanticCache(embedder=toy, path=path)
    a.lookup("warm up")
    b.lookup("warm up")
    a.store("first stored question", "1")
    db = sqlite3.connect(path)
    db.execute("DELETE FROM changes")  # b can no longer replay the log
    db.execute("INSERT INTO changes(op, id, origin) VALUES ('put', 'x', 'y')")
    db.commit()
    db.close()
    assert b.lookup("first stored question").answer == "1"


# -- Redis ----------------------------------------------------------------------------------

@pytest.mark.redis
def test_redis_two_processes_share_entries(toy, redis_url) -> None:
    child = Child(f"store={redis_url!r}")
    try:
        c = SemanticCache(embedder=toy, store=redis_url)
        assert child.ask("store where is the train station") == "ok"
        hit = c.lookup("where is the train station")
        assert hit is not None and hit.answer == "from child: where is the train station"
        c.store("what is the wifi password", "hunter2")
        assert child.ask("lookup what is the wifi password") == "hit hunter2"
        assert child.ask("invalidate") == "n 2"
        assert c.lookup("what is the wifi password") is None  # child's delete reached us
        assert c.stats().extra["index_vectors"] == 0
    finally:
        child.close()


@pytest.mark.redis
def test_redis_ttl_and_corrupt_entry(toy, redis_url) -> None:
    import redis

    c = SemanticCache(embedder=toy, store=redis_url)
    eid = c.store("short lived entry", "x", ttl=60)
    r = redis.Redis.from_url(redis_url)
    assert 0 < r.pttl(f"semcomm:sem:e:{eid}") <= 60_000  # Redis expires it too
    r.hset(f"semcomm:sem:e:{eid}", "answer", "evil")
    assert c.lookup("short lived entry") is None
    assert c.stats().corrupt == 1


@pytest.mark.redis
def test_redis_outage_gives_misses_then_recovers_and_resyncs(toy, own_redis) -> None:
    url = own_redis.url
    a = SemanticCache(embedder=toy, store=url)
    b = SemanticCache(embedder=toy, store=url)
    a.store("kept across the outage", "yes")
    assert b.lookup("kept across the outage").answer == "yes"
    own_redis.stop()
    with pytest.warns(BackendDownWarning):
        assert b.lookup("kept across the outage") is None  # a miss, not an error
    b.store("written while down", "lost")  # dropped, not raised
    assert b.stats().errors >= 1
    own_redis.start()  # fresh, empty server on the same port: everything is gone
    b.backend.retry_s = 0.0
    a.backend.retry_s = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendDownWarning)
        assert b.lookup("kept across the outage") is None  # resynced: the entry is gone
        assert b.stats().extra["index_vectors"] == 0
        a.store("after recovery", "works")
        assert b.lookup("after recovery").answer == "works"


def test_sqlite_store_poll_skips_own_changes(toy, tmp_path) -> None:
    s = SQLiteEntryStore(tmp_path / "x.sqlite")
    c = SemanticCache(embedder=toy, store=s)
    c.store("one two three", "a")
    sync = s.poll()
    assert not sync.reset and not sync.upserts and not sync.deletes
