"""The process that compiles a scheduler's large grammars, so that a compile nobody
waits for any more can be stopped: a thread inside xgrammar's compile cannot be, a
process can be killed (``GrammarBackend`` kills it when every request waiting for the
compile ended or passed --grammar-compile-timeout, and starts another).

The scheduler (``CompileProcess``) starts it with ``python -m`` (no ``multiprocessing``:
an offline Engine's script is never re-imported) and talks over two pipes, one message
at a time: first the tokenizer's vocabulary as xgrammar serializes it (the scan is done
once, by the scheduler), then per job ``[kind, text]`` in, ``K`` + the compiled grammar
serialized (or ``E`` + the compiler's message) out. It exits when its scheduler does
(the pipe closes, or, mid-compile, a watch on its parent).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

POLL_S = 0.05        # how often a waiting scheduler looks whether the compile is still wanted
START_TIMEOUT_S = 120.0
PARENT_CHECK_S = 0.5


class CompileProcess:
    """The scheduler's end: one worker process, one compile at a time."""

    def __init__(self, tokenizer_info_json: str) -> None:
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        import pdserve

        # The child imports pdserve from wherever this process did.
        root = str(Path(pdserve.__file__).resolve().parent.parent)
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.scheduler.grammar_worker", str(child_reads), str(child_writes)],
                pass_fds=(child_reads, child_writes), stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            os.close(parent_writes)
            os.close(parent_reads)
            raise
        finally:
            os.close(child_reads)
            os.close(child_writes)
        self.pid = self.proc.pid
        self.tx = Connection(parent_writes, readable=False)
        self.rx = Connection(parent_reads, writable=False)
        try:
            self.tx.send_bytes(tokenizer_info_json.encode())
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self.rx.poll(POLL_S):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the grammar worker process did not start (exit code {self.proc.poll()})")
            if self.rx.recv_bytes() != b"ready":
                raise RuntimeError("the grammar worker process answered its start with something else")
        except BaseException:
            self.kill()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def compile(self, kind: str, text: str, stop: Callable[[], bool]) -> tuple[bool, str] | None:
        """(True, the compiled grammar serialized) or (False, the compiler's message); None
        when ``stop()`` turned true first (the process is killed then). RuntimeError if the
        process dies."""
        self.tx.send_bytes(json.dumps([kind, text]).encode())
        while not self.rx.poll(POLL_S):
            if stop():
                self.kill()
                return None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the grammar worker process exited (code {self.proc.returncode}) while compiling")
        data = self.rx.recv_bytes()
        return data[:1] == b"K", data[1:].decode(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for conn in (getattr(self, "tx", None), getattr(self, "rx", None)):
            if conn is not None:
                conn.close()


def _watch_parent(parent: int) -> None:
    """Exit once the scheduler is gone, even in the middle of a compile (xgrammar releases
    the GIL, so this thread runs)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def main(argv: list[str]) -> None:
    inbox = Connection(int(argv[0]), writable=False)
    outbox = Connection(int(argv[1]), readable=False)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    import xgrammar as xgr

    from pdserve.scheduler.grammar import parse_grammar

    try:
        info = xgr.TokenizerInfo.deserialize_json(inbox.recv_bytes().decode())
    except EOFError:
        return
    # The scheduler keeps the compiled grammars (bounded by bytes); this process keeps nothing.
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    outbox.send_bytes(b"ready")
    while True:
        try:
            kind, text = json.loads(inbox.recv_bytes())
        except EOFError:
            return
        try:
            compiled = compiler.compile_grammar(parse_grammar(kind, text))
            reply = b"K" + compiled.serialize_json().encode()
            del compiled
        except Exception as exc:  # noqa: BLE001 - the request reports it
            reply = b"E" + str(exc).encode(errors="replace")
        outbox.send_bytes(reply)


if __name__ == "__main__":
    main(sys.argv[1:])
