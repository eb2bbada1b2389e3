"""Where and how many of a sweep's evaluations run at once: ``--jobs``, ``--devices``,
``--executor local|ray`` checked before anything runs, and the executor made from them.

- ``--jobs N`` (default 1, or one per ``--devices`` entry): at most N candidates are written or
  evaluated at a time.
- ``--devices 0,1,2,3``: each running evaluation gets one of these GPUs to itself:
  ``CUDA_VISIBLE_DEVICES`` is set to it for the command (mapped through this process's own
  ``CUDA_VISIBLE_DEVICES``, so ``--devices 0`` under ``CUDA_VISIBLE_DEVICES=2,3`` is GPU 2) and
  ``{device}`` in the template becomes it. N may not exceed the number of devices. Devices are
  indices of the GPUs this process sees, or GPU/MIG UUIDs (``GPU-…``, ``MIG-…``), which are
  passed through as they are.
- ``--executor ray``: each candidate's write-and-evaluate is a Ray task (``--ray-address``,
  ``--eval-resources gpu=1``); Ray gives a task its GPUs, so ``--devices`` is refused there.
"""

from __future__ import annotations

import os
import re

from dghard_cli import numbers
from dghard_cli.errors import InputError
from dghard_cli.sweeping.command import Template

#: The most evaluations at a time (``--jobs``): a bound on what the sweep sizes from the option.
MAX_JOBS = 4096
#: Executors ``--executor`` accepts.
EXECUTORS = ("local", "ray")
_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z./-]+$")


def visible_gpu_count() -> int:
    """How many CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_devices(values: list[str] | None) -> list[str]:
    """``["0,1", "2"]`` → ``["0", "1", "2"]``; InputError for an empty, malformed or repeated
    entry (``1,01`` is GPU 1 twice)."""
    out: list[str] = []
    for v in values or []:
        for d in str(v).split(","):
            d = d.strip()
            if not d:
                raise InputError(f"--devices {v!r}: an empty entry; give device indices like 0,1,2,3")
            if not _UUID.match(d) and not (d.isascii() and d.isdigit()):
                raise InputError(
                    f"--devices: {d!r} is not a device index (0, 1, ...) or a GPU/MIG UUID (GPU-…, MIG-…)"
                )
            d = d if _UUID.match(d) else str(numbers.index(d, "--devices"))
            if d in out:
                raise InputError(f"--devices {v!r}: device {d} is given twice")
            out.append(d)
    return out


def check_devices(devices: list[str]) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each device (InputError for a device that does not exist)."""
    if not devices:
        return []
    parent = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    indices = [d for d in devices if not _UUID.match(d)]
    for d in devices:
        if _UUID.match(d) and parent and any(_UUID.match(p) for p in parent) and d not in parent:
            raise InputError(
                f"--devices: {d} is not among this process's CUDA_VISIBLE_DEVICES "
                f"({os.environ['CUDA_VISIBLE_DEVICES']}): an evaluation may not escape it"
            )
    count = visible_gpu_count() if indices else 0
    for d in indices:
        if int(d) >= count:
            seen = f"{count} CUDA device(s) (indices 0–{count - 1})" if count else "no CUDA device"
            raise InputError(
                f"--devices: device {d} does not exist: this machine shows {seen}"
                + (f" under CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}" if parent else "")
            )
    return [d if _UUID.match(d) or not parent else parent[int(d)] for d in devices]


def plan_execution(opts) -> tuple[int, list[str]]:  # noqa: ANN001 - SweepOptions (no import cycle)
    """(slots, the device of each slot) from the options; InputError (exit 2) before anything runs."""
    if opts.executor not in EXECUTORS:
        raise InputError(f"--executor {opts.executor!r} is not one of: {', '.join(EXECUTORS)}")
    devices = parse_devices(opts.devices)
    jobs = opts.jobs
    if jobs is not None and (
        isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= MAX_JOBS
    ):
        shown = (
            jobs
            if not isinstance(jobs, int) or abs(jobs) < 10**15
            else f"a {len(str(abs(jobs)))}-digit number"
        )
        raise InputError(
            f"--jobs must be a whole number from 1 to {MAX_JOBS} (evaluations at a time), got {shown}"
        )
    if opts.executor == "ray":
        if devices:
            raise InputError(
                "--devices is for the local executor; on Ray give each evaluation its GPUs with "
                "--eval-resources gpu=1 (Ray sets CUDA_VISIBLE_DEVICES for it)"
            )
        from dghard_cli.sweeping.executors import check_address_form, parse_resources, worker_start_timeout

        parse_resources(opts.eval_resources or "")
        if opts.ray_address is not None:
            check_address_form(opts.ray_address)
        worker_start_timeout()  # DGHARD_RAY_START_TIMEOUT_S: refused here, not after Ray has started
    else:
        if opts.ray_address is not None:
            raise InputError("--ray-address needs --executor ray")
        if opts.eval_resources is not None:
            raise InputError("--eval-resources needs --executor ray (locally, use --devices)")
    slots = jobs if jobs is not None else max(1, len(devices))
    if devices and slots > len(devices):
        raise InputError(
            f"--jobs {slots} with {len(devices)} device(s) in --devices: each running evaluation needs "
            f"a device of its own (give --jobs {len(devices)} or more devices)"
        )
    if Template.parse(opts.eval_template).uses("device") and not devices:
        if opts.executor == "local":
            raise InputError(
                "--eval uses {device} but no --devices were given: name the GPUs the evaluations may use, "
                "e.g. --devices 0,1"
            )
        if not ray_gpus(opts.eval_resources):
            raise InputError(
                "--eval uses {device} but the Ray tasks get no GPU: give --eval-resources gpu=1 "
                "(Ray then sets the task's CUDA_VISIBLE_DEVICES, which {device} becomes)"
            )
    mapped = check_devices(devices)
    return slots, mapped[:slots]


def ray_gpus(eval_resources: str | None) -> float:
    """The GPUs each Ray task asks for in ``--eval-resources`` (0 when none)."""
    from dghard_cli.sweeping.executors import parse_resources

    return float(parse_resources(eval_resources or "").get("GPU", 0.0))


def make_executor(opts, slots: int):  # noqa: ANN001, ANN201 - SweepOptions, executors.Executor
    """The executor of the sweep's jobs (:mod:`dghard_cli.sweeping.executors`)."""
    from dghard_cli.sweeping.executors import LocalExecutor, RayExecutor, parse_resources
    from dghard_cli.sweeping.jobs import failed_result, run_job

    def on_error(job, exc: BaseException):  # noqa: ANN001, ANN202
        return failed_result(job, f"the evaluation could not run: {exc}", cacheable=False)

    if opts.executor == "ray":
        return RayExecutor(
            run_job,
            slots,
            on_error,
            address=opts.ray_address,
            resources=parse_resources(opts.eval_resources or ""),
        )
    return LocalExecutor(run_job, slots, on_error)
