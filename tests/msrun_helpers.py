"""What the tests that start msrun jobs share: a free port, and the head of a TP=2 CPU worker script.

Importable from every test module (pytest puts ``tests/`` on ``sys.path`` for ``tests/conftest.py``).
A worker script is ``TP2_WORKER_HEAD + <its own imports> + TP2_WORKER_INIT + <its body>``; msrun runs
it with the repository root as its first argument.
"""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port nothing listens on right now (for msrun's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TP2_WORKER_HEAD = r'''
import json, sys
import numpy as np
import mindspore as ms
from mindspore.communication import create_group, get_rank, init

sys.path.insert(0, sys.argv[1])
'''
TP2_WORKER_INIT = r'''
ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
init()
create_group("tp", [0, 1])
'''
