"""Fixtures of the distributed tests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def run_ranks():
    """`run(script, world, *args, timeout=...)`: the script beside the tests as `world` processes, each given
    `RANK WORLD PORT *args` (PORT: a free one for their process group); every process must exit 0 and
    print a JSON line last. Returns the parsed lines, by rank."""

    def run(script: str, world: int, *args: object, timeout: float = 180) -> list[dict]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        path = Path(__file__).with_name(script)
        procs = [subprocess.Popen([sys.executable, str(path), str(r), str(world), str(port), *map(str, args)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=timeout)
                assert p.returncode == 0, err[-4000:]
                outs.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in procs:
                p.kill()
        return outs

    return run
