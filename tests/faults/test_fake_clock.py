"""The fake clock's own parts: a node started under it gets the sleep shim, and a node
starting while another node's clock is made never reads the shim half-written (three nodes
share its directory; one read empty left a node with the real time.sleep, which fails with
EINVAL under libfaketime, and it exited at boot)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from fault_support import SLEEP_SHIM, FakeClock, replace_atomically

REWRITES = 2000


def test_a_reader_sees_the_shim_whole_while_it_is_written_again(tmp_path: Path) -> None:
    path = tmp_path / "sitecustomize.py"
    replace_atomically(path, SLEEP_SHIM)
    seen: list[str] = []
    done = threading.Event()

    def read_until_done() -> None:
        while not done.is_set():
            seen.append(path.read_text())

    reader = threading.Thread(target=read_until_done)
    reader.start()
    try:
        for _ in range(REWRITES):
            replace_atomically(path, SLEEP_SHIM)
    finally:
        done.set()
        reader.join()
    assert seen, "the reader never ran"
    assert set(seen) == {SLEEP_SHIM}


def test_a_process_under_the_clock_sleeps_through_the_shim(tmp_path: Path) -> None:
    clock = FakeClock(tmp_path, 3600.0)
    env = {**os.environ, **clock.env(), "PYTHONPATH": str(clock.site)}
    done = subprocess.run(
        [sys.executable, "-c", "import time; time.sleep(0.01); print(time.sleep.__name__)"],
        env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "_sleep"
