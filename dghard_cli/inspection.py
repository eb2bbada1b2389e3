"""``dghard inspect``: the spectrum of every weight delta, without writing a model.

Streams BASE and FT through the same plan and the same spectral pass as ``repair``
(:func:`dghard_cli.engine.plan.build_plan`, :func:`dghard_cli.methods.dg_hard.delta_spectrum`,
:func:`dghard_cli.spectral.decide.decide`) and records, per matrix, what the cut would do:
the Marchenko–Pastur fit (noise level from the median), τ, spikes, rank and energy kept, the
bulk diagnostic and the low-rank (merged-LoRA) flag. The decisions (``unchanged``, ``low-rank``)
and the summary verdict are the ones ``repair`` makes and prints, so both say the same thing
about the same pair. The document has the report schema (``build_report``); ``dghard report``
renders it too.

Full singular-value lists are kept only for the selected matrices (``matrices``: a regex, or
N = the N matrices with the largest ‖Δ‖), which are the ones plotted.
"""

from __future__ import annotations

import heapq
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dghard_cli.engine.device import resolve_device
from dghard_cli.engine.ops import JobInputs, base_record
from dghard_cli.engine.plan import PolicyOptions, build_plan
from dghard_cli.engine.progress import Progress
from dghard_cli.engine.working_memory import check_jobs
from dghard_cli.engine.writer import inputs_doc
from dghard_cli.errors import InputError
from dghard_cli.io.hub import open_checkpoint
from dghard_cli.io.paths import Output, check_outputs
from dghard_cli.lora.source import open_ft
from dghard_cli.methods.dg_hard import delta_spectrum
from dghard_cli.report import build as report_mod
from dghard_cli.report import plots
from dghard_cli.spectral.decide import LOW_RANK, UNCHANGED, decide
from dghard_cli.spectral.spectrum import ROUTE, ShrinkSpec

#: Matrices whose spectra are plotted when plots are asked for and ``matrices`` is not given.
DEFAULT_PLOTTED = 4
#: The files ``--plot`` writes (prefix, suffix): no other output may take these names.
PLOT_NAMES = (("heatmap_", ".png"), ("spectrum_", ".png"))


@dataclass
class InspectOptions:
    spec: ShrinkSpec = field(default_factory=ShrinkSpec)
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    device: str = "auto"
    matrices: str | int | None = None  # regex, or N largest ‖Δ‖; None: DEFAULT_PLOTTED if plotting
    plot_dir: Path | None = None
    html: Path | None = None
    base_revision: str | None = None
    ft_revision: str | None = None
    block_bytes: int = 64 * 1024 * 1024
    quiet: bool = True
    argv: list[str] | None = None


class Selection:
    """Which matrices keep their full spectrum: a regex, or the N largest ‖Δ‖ seen so far."""

    def __init__(self, value: str | int | None) -> None:
        self.regex: re.Pattern | None = None
        self.top: int | None = None
        if value is None:
            self.top = 0
        elif isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
            self.top = int(value)
        else:
            try:
                self.regex = re.compile(value)
            except re.error as exc:
                raise InputError(
                    f"--matrices {value!r} is neither a count nor a valid regex ({exc})"
                ) from None
        self.kept: dict[str, np.ndarray] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._n = 0

    def offer(self, name: str, delta_norm: float, sigma: np.ndarray) -> None:
        if self.regex is not None:
            if self.regex.search(name):
                self.kept[name] = sigma.copy()
            return
        if not self.top:
            return
        self._n += 1
        item = (delta_norm, -self._n, name)  # ties: the earlier tensor wins
        if len(self._heap) < self.top:
            heapq.heappush(self._heap, item)
            self.kept[name] = sigma.copy()
        elif item > self._heap[0]:
            dropped = heapq.heapreplace(self._heap, item)
            del self.kept[dropped[2]]
            self.kept[name] = sigma.copy()

    def ordered(self, names_in_order: list[str]) -> dict[str, np.ndarray]:
        return {n: self.kept[n] for n in names_in_order if n in self.kept}


def parse_matrices(value: str | None) -> str | int | None:
    if value is None:
        return None
    v = value.strip()
    return int(v) if v.isdigit() else v


def inspect_pair(base: str | Path, ft: str | Path, options: InspectOptions | None = None) -> dict:
    """Per-matrix spectra of FT − BASE; returns the document (report schema, command ``inspect``).

    With ``plot_dir`` the PNGs are written there; with ``html`` one self-contained page.
    """
    opts = options or InspectOptions()
    plotting = opts.plot_dir is not None or opts.html is not None
    if plotting:
        plots.require_matplotlib("--plot and --html")
    html_parent = Path(opts.html).expanduser().resolve().parent if opts.html is not None else None
    plot_dir = Path(opts.plot_dir).expanduser().resolve() if opts.plot_dir is not None else None
    # the page may go into the plot directory, which is made on the way
    if html_parent is not None and html_parent != plot_dir and not html_parent.exists():
        raise InputError(
            f"--html {opts.html}: directory {Path(opts.html).expanduser().parent} does not exist"
        )
    selection = Selection(
        opts.matrices if opts.matrices is not None else (DEFAULT_PLOTTED if plotting else None)
    )
    t_start = time.perf_counter()
    device = resolve_device(opts.device)
    base_ck = open_checkpoint(str(base), revision=opts.base_revision, label="BASE")
    try:
        ft_ck = open_ft(str(ft), base=base_ck, revision=opts.ft_revision, label="FT")
    except BaseException:
        base_ck.close()
        raise
    try:
        outputs = []
        if opts.html is not None:
            outputs.append(Output("--html", Path(opts.html)))
        if opts.plot_dir is not None:
            outputs.append(Output("--plot", Path(opts.plot_dir), is_dir=True, patterns=PLOT_NAMES))
        check_outputs([("BASE", base_ck.path), ("FT", ft_ck.path)], outputs)
        plan = build_plan(base_ck, [ft_ck], opts.policy)
        check_jobs(plan.jobs, method="dg-hard", spectral=True, device=device)
        timings = {"plan": time.perf_counter() - t_start}
        method_jobs = [j for j in plan.jobs if j.runs_method]
        progress = Progress(
            sum(j.in_nbytes for j in method_jobs),
            len(method_jobs),
            label="inspect",
            quiet=opts.quiet,
            what="to read",
        )
        t0 = time.perf_counter()
        records: list[dict] = []
        by_name: dict[str, dict] = {}
        try:
            for job in plan.jobs:
                rec = base_record(job)
                if job.runs_method:
                    t1 = time.perf_counter()
                    _inspect_job(job, rec, opts.spec, device, opts.block_bytes, selection)
                    rec["seconds"] = round(time.perf_counter() - t1, 6)
                    progress.advance(job.in_nbytes)
                elif job.action == "tied" and job.tied_to in by_name:
                    rec["delta_norm"] = by_name[job.tied_to].get("delta_norm")
                records.append(rec)
                by_name[job.name] = rec
        finally:
            progress.close()
        timings["spectra"] = time.perf_counter() - t0
        inputs = inputs_doc(base_ck, [ft_ck])
    finally:
        base_ck.close()
        ft_ck.close()

    spectra = selection.ordered([r["name"] for r in records])
    parameters = opts.spec.describe()
    parameters.update(
        {
            "min_numel": opts.policy.min_numel,
            "include": list(opts.policy.include),
            "exclude": list(opts.policy.exclude),
            "matrices": opts.matrices,
            "route": ROUTE,
        }
    )
    method = "dg-hard" if opts.spec.shrink == "hard" else f"spectral-{opts.spec.shrink}"
    timings["total"] = time.perf_counter() - t_start
    doc = report_mod.build_report(
        command="inspect",
        argv=opts.argv,
        inputs=inputs,
        output=None,
        method=method,
        parameters=parameters,
        device=report_mod.device_info(device, opts.device),
        timings=timings,
        memory=report_mod.peak_memory(device),
        records=records,
        notes=plan.notes,
        extra={
            "spectra": {
                name: {"shape": list(_spectral_shape(by_name[name])), "singular_values": sig.tolist()}
                for name, sig in spectra.items()
            }
        },
    )
    if opts.plot_dir is not None:
        doc["plots"] = {"dir": str(opts.plot_dir), "files": write_plots(doc, spectra, Path(opts.plot_dir))}
    if opts.html is not None:
        from dghard_cli.report.html import write_html

        doc["html"] = str(write_html(doc, opts.html, spectra))
    return doc


def _spectral_shape(rec: dict) -> tuple[int, int]:
    rows = rec.get("shared_rows") or rec["shape"][0]
    return rows, rec["shape"][1]


def _inspect_job(job, rec: dict, spec: ShrinkSpec, device, block_bytes: int, selection: Selection) -> None:
    """What the spectral filter would do to this job, recorded as ``repair`` records it."""
    ds = delta_spectrum(job, JobInputs(job, None), device, block_bytes)
    rec["delta_norm"] = math.sqrt(max(ds.fro2, 0.0))
    if ds.spectrum is None:
        rec["action"], rec["reason"] = "kept-ft", UNCHANGED
        return
    dec = decide(ds.spectrum, spec, ft_dtype=job.fts[0].dtype, rms_ft=ds.rms_ft)
    rec.update(dec.stats)
    rec["route"] = ROUTE
    if dec.kind == LOW_RANK:
        rec["action"], rec["reason"] = "kept-ft", "low-rank"
    rec["bulk"] = report_mod.has_bulk(rec)
    selection.offer(job.name, rec["delta_norm"], ds.spectrum.sigma)


def write_plots(doc: dict, spectra: dict[str, np.ndarray], directory: Path) -> list[str]:
    """Heat maps and the selected spectra as PNG files in ``directory`` (created)."""
    directory = Path(directory).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--plot {directory}: cannot create the directory ({exc.strerror})") from None
    written: list[str] = []
    records = doc["tensors"]
    for key in plots.HEAT_KEYS:
        png = plots.heatmap_png(records, key)
        if png is not None:
            p = directory / f"heatmap_{key}.png"
            p.write_bytes(png)
            written.append(str(p))
    by_name = {r["name"]: r for r in records}
    for name, sig in spectra.items():
        p = directory / f"spectrum_{plots.safe_filename(name)}.png"
        p.write_bytes(plots.spectrum_png(name, sig, by_name[name]))
        written.append(str(p))
    return written
