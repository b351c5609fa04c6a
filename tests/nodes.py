"""One server instance spanning two "nodes" on loopback (--nnodes 2): node 1's launch
(`NodeProcess`, no HTTP) and node 0's (`tests.server.conftest.ServerProcess`), started
with the same command but --node-rank, and stopped as an operator would: node 0 first,
after which node 1 must exit on its own, leaving no process behind."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from tests import process_logs
from tests.server.conftest import REPO_ROOT, ServerProcess, descendants, free_port, kill_tree, pid_alive
from tests.waiting import wait_until

READY_LINE = "ready; this node serves no HTTP"


class NodeProcess:
    """`python -m pdserve.launch_server ... --node-rank R` for R > 0: its TP ranks only."""

    def __init__(self, model_dir: Path, *flags: str) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="pdserve-node-", suffix=".log", delete=False)
        self.argv = [sys.executable, "-m", "pdserve.launch_server", "--model-path", str(model_dir), *flags]
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        process_logs.register(self.log.name, f"node ({' '.join(flags)})")
        self.known_pids: set[int] = set()

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        wait_until(lambda: READY_LINE in self.output(), timeout, step=0.1,
                   what=lambda: f"node ready ({self.output()[-3000:]})")
        self.known_pids |= descendants(self.proc.pid)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Its exit status, once it and every process it started are gone."""
        code = self.proc.wait(timeout)
        wait_until(lambda: not any(pid_alive(p) for p in self.known_pids), 10.0, step=0.1,
                   what=lambda: f"node's children gone: {sorted(p for p in self.known_pids if pid_alive(p))}")
        return code

    def kill_all(self) -> None:
        kill_tree(self.proc, self.known_pids)
        self.log.close()
        process_logs.unregister(self.log.name)
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


def node_flags(tp_size: int, node_rank: int, dist_port: int, *extra: str) -> tuple[str, ...]:
    return ("--tp-size", str(tp_size), "--nnodes", "2", "--node-rank", str(node_rank),
            "--dist-init-addr", f"127.0.0.1:{dist_port}", "--dist-timeout", "60", *extra)


@contextlib.contextmanager
def started_nodes(model_dir: Path, tp_size: int, *extra: str, node1_host: str = "127.0.0.1"
                  ) -> Iterator[tuple[ServerProcess, NodeProcess]]:
    """A TP `tp_size` instance over two nodes (node 1 started first: it waits for node 0),
    node 1 on its own `--host` (another loopback address stands for another machine).
    Whatever the test did to them, both are closed on exit and nothing of theirs survives."""
    dist_port = free_port()
    node1 = NodeProcess(model_dir, *node_flags(tp_size, 1, dist_port, *extra), "--host", node1_host)
    try:
        node0 = ServerProcess(model_dir, *node_flags(tp_size, 0, dist_port, *extra))
        try:
            node1.wait_ready()  # node 0 is healthy only once the whole group is: at once
            yield node0, node1
        finally:
            node0.close()
    finally:
        node1.kill_all()


@contextlib.contextmanager
def two_nodes(model_dir: Path, tp_size: int, *extra: str, node1_host: str = "127.0.0.1"
              ) -> Iterator[tuple[ServerProcess, NodeProcess]]:
    """``started_nodes``, stopped as an operator would: node 0 (SIGTERM) first; node 1
    must then exit 0 with its ranks, and no process of either node may survive."""
    with started_nodes(model_dir, tp_size, *extra, node1_host=node1_host) as (node0, node1):
        try:
            yield node0, node1
        finally:
            graceful, alive = node0.terminate()
        assert graceful and not alive, (graceful, alive)
        assert node1.wait_exit() == 0, node1.output()[-3000:]
        assert "node 0 shut the TP group down" in node1.output()
