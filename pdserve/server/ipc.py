"""ZMQ endpoints of one server instance and the one serializer all messages use.

Every instance gets its own temporary directory for IPC sockets, so two
instances on one host never collide and nothing has a fixed name.
"""

from __future__ import annotations

import pickle
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import zmq


@dataclass(frozen=True)
class IpcPaths:
    root: str
    scheduler: str    # rank 0 PULLs commands here
    detokenizer: str  # detokenizer PULLs token updates here
    http: str         # HTTP process PULLs text updates and scheduler replies here

    @classmethod
    def create(cls) -> "IpcPaths":
        root = tempfile.mkdtemp(prefix="pdserve-ipc-")
        return cls(root, f"ipc://{root}/scheduler", f"ipc://{root}/detokenizer", f"ipc://{root}/http")

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    else:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock
