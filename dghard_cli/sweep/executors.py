"""TEMPORARY local executor (replaced by the executors module being written on another branch)."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable


class LocalExecutor:
    remote = False

    def __init__(self, fn: Callable, slots: int, on_error: Callable) -> None:
        self.fn, self.slots, self.on_error = fn, slots, on_error
        self.pool = cf.ThreadPoolExecutor(max_workers=slots, thread_name_prefix="dghard-eval")
        self.jobs: dict = {}

    def submit(self, job, assignment):
        fut = self.pool.submit(self.fn, job, assignment)
        self.jobs[fut] = job
        return fut

    def wait(self, handles, timeout):
        done, _ = cf.wait(handles, timeout=timeout, return_when=cf.FIRST_COMPLETED)
        out = []
        for f in handles:
            if f in done:
                job = self.jobs.pop(f)
                exc = f.exception()
                out.append((f, self.on_error(job, exc) if exc else f.result()))
        return out

    def cancel(self, handles):
        for f in handles:
            f.cancel()

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


class RayExecutor:  # placeholder until merged
    remote = True

    def __init__(self, *a, **k):
        raise NotImplementedError


def parse_resources(text: str) -> dict:
    return {}
