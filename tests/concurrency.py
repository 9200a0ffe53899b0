"""Workers on threads at once, for the tests that race them (not a test module: the tests import it)."""
from __future__ import annotations

import threading
from typing import Callable


def run_threads(worker: Callable[[int], object], n: int) -> None:
    """worker(i) for i in range(n), each on its own thread, all started before any is joined."""
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
