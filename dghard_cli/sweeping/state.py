"""The state of one sweep, as data: every field it has, declared in one place and typed
(:class:`SweepState`), and the row each candidate gets (:class:`CandidateRow`). The steps
(:mod:`.setup`, :mod:`.steps`, :mod:`.report`) are functions of this state, and
:mod:`.run` holds the search loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.scoring.results import MetricRule, ResultFile, Score
from dghard_cli.sweeping.cache import Cache
from dghard_cli.sweeping.candidates import Candidate, FamilyEntry
from dghard_cli.sweeping.choose import DEFAULT_TIE_RULE
from dghard_cli.sweeping.defaults import DEFAULT_BUDGET
from dghard_cli.sweeping.executors import Executor

STAGING_SUFFIX = ".dghard-sweep"


@dataclass
class SweepOptions:
    """What to try, how to evaluate it and how to choose."""

    eval_template: str
    targets: list[str] = field(default_factory=list)
    budget: int = DEFAULT_BUDGET
    candidates: Path | None = None  # candidate file; None: the built-in default set
    families: list[dict] | None = None  # the candidate file's ``families`` list, inline
    base_results: Path | None = None
    ft_results: list[Path] = field(default_factory=list)  # FT's, then each extra fine-tune's
    extra_fts: list[str] = field(default_factory=list)  # more fine-tunes of BASE: merge families
    eval_timeout: float | None = None
    lm_eval: dict | None = None  # --lm-eval: tasks, backend, args (sweeping/lm_eval.py), for the report
    min_target_retention: float | None = None  # None: effective_bar's default
    fail_under: float | None = None
    margin: float | None = None
    metric: list[str] | None = None
    units: str = "auto"  # auto | fraction | points: how every results file's numbers are read
    tie_tolerance: float = 0.0
    #: candidates within this many standard errors of their paired difference from the best tie
    #: with it, and the declared prior picks among them (sweeping/choose.py); 0: off
    tie_rule: float = DEFAULT_TIE_RULE
    #: what the search maximises (sweeping/choose.OBJECTIVES): hm | retention | normalised-accuracy
    objective: str = "hm"
    device: str = "auto"
    #: output dtype of every candidate's floating tensors (``--dtype``, a safetensors name such as
    #: BF16); None: each command's default (the fine-tune's)
    dtype: str | None = None
    overwrite: bool = False
    argv: list[str] | None = None
    plot: bool = True
    refine: list[str] = field(default_factory=list)  # "groups": per-group refinement of lines
    on_event: Callable[[dict], None] | None = None  # progress (the CLI prints these)
    # execution (sweeping/executors.py): how many evaluations at once, where
    jobs: int | None = None  # None: one, or one per --devices entry
    devices: list[str] | None = None  # one per running evaluation (CUDA_VISIBLE_DEVICES, {device})
    executor: str = "local"  # "local" | "ray"
    ray_address: str | None = None  # None: a local Ray cluster; "auto", "HOST:PORT", "ray://HOST:PORT"
    eval_resources: str | None = None  # Ray resources per evaluation, e.g. "gpu=1,cpu=4"
    keep_candidates: bool = False  # keep every evaluated candidate in OUT/candidates/


def staging_path(out: Path) -> Path:
    out = Path(out).expanduser().absolute()
    return out.parent / f".{out.name}{STAGING_SUFFIX}"


class CandidateRow(TypedDict, total=False):
    """One candidate considered (:func:`.steps._add_row`), in the order ``sweep_report.json``
    lists its keys; ``key`` (the cache key), ``score`` and ``objective`` are the sweep's own, the
    score's fields are filled in by :func:`.steps.rescore`."""

    order: int
    name: str
    family: str
    entry: int
    command: str
    axis: str
    value: Any
    params: dict
    phase: str
    status: str  # ok | failed | unreadable | ...
    message: str | None
    log_tail: str | None
    cached: bool
    seconds: dict
    bytes: int | None
    distance: float
    reproduce: dict  # argv, command, out
    key: str
    device: str
    score: dict | None
    repair: float | None
    retention: float | None
    hm: float | None
    repair_stderr: float | None
    retention_stderr: float | None
    hm_stderr: float | None
    normalised_accuracy: float | None
    unchanged_mean_change: float | None
    target_retention: dict | None
    target_retention_mean: float | None
    feasible: bool
    objective: tuple | None
    vs_best: float | None  # the objective minus the best's (the incumbent's)
    vs_best_stderr: float | None  # its standard error (paired item by item where possible)
    vs_best_paired: bool
    prior: list  # [0] for the data-free default, else [1]: choose.PRIOR


@dataclass
class SweepState:
    """Everything a sweep knows, from its options to the rows of its candidates."""

    base_spec: str
    ft_specs: list[str]
    out_arg: str  # OUT as given (the printed commands name it so)
    out: Path
    opts: SweepOptions
    stage: Path  # the staging directory beside OUT (staging_path)
    rule: MetricRule
    # -- the candidate file (setup.validate)
    slots: int = 1
    devices: list[str] | None = None
    entries: list[FamilyEntry] = field(default_factory=list)
    candidates_source: str = ""
    # -- the inputs (setup.open_inputs)
    base_ck: Checkpoint | None = None
    ft_cks: list[Checkpoint] = field(default_factory=list)
    adapters: bool = False  # the fine-tunes are LoRA adapters
    bar: float | None = None  # the target bar in force (setup.effective_bar)
    active: list[FamilyEntry] = field(default_factory=list)  # the entries searched
    skipped: list[dict] = field(default_factory=list)  # the entries not searched, and why
    identity: dict = field(default_factory=dict)  # what the cache knows the inputs by
    n_ref_evals: int = 0
    cand_budget: int = 0  # evaluations left for candidates
    # -- running (run.run)
    t0: float = 0.0
    executor: Executor | None = None
    cache: Cache | None = None
    stage_identity: tuple[int, int] | None = None  # (device, inode) of the staging directory
    # -- the references (steps.references)
    base_rf: ResultFile | None = None
    ft_rfs: list[ResultFile] = field(default_factory=list)
    refs: dict[str, dict] = field(default_factory=dict)
    #: several fine-tunes: each benchmark's expert (scoring/experts.py)
    expert_ref: ResultFile | dict[str, Score] | None = None
    expert_choice: dict[str, dict] = field(default_factory=dict)
    # -- the candidates (steps.evaluate_round)
    rows: list[CandidateRow] = field(default_factory=list)  # every candidate considered, in order
    rf: dict[str, ResultFile] = field(default_factory=dict)  # candidate key -> results
    records: dict[str, dict] = field(default_factory=dict)  # candidate key -> cache record
    cands: dict[str, Candidate] = field(default_factory=dict)
    score_doc: dict | None = None  # the scoring of every row (steps.rescore)
    #: the smallest objective difference the evaluation resolves (compare.resolution), or None
    resolution: float | None = None
    #: refinement probes not taken because their step's gain lay inside the noise (entry, value)
    noise_skipped: set = field(default_factory=set)
    #: what compare_with_best scored (the fine-tune reference and the named results), for ties()
    compared: tuple | None = None
    #: held-out evaluations run by this invocation (``{split}``: sweeping/holdout.py)
    holdout_runs: int = 0
    ref_scores: dict[str, dict] = field(default_factory=dict)
    disk_peak: int = 0
    run_count: int = 0
    cached_count: int = 0
    t: dict[str, float] = field(default_factory=lambda: {"write": 0.0, "distance": 0.0, "eval": 0.0})
    warnings: list[str] = field(default_factory=list)
    running: dict[str, dict] = field(default_factory=dict)  # job key -> name, start time, slot, device
    queued: list[str] = field(default_factory=list)  # the names of the round being evaluated

    @classmethod
    def create(cls, base: str, ft: str, out: Path, opts: SweepOptions) -> SweepState:
        out_path = Path(out).expanduser().absolute()
        return cls(
            base_spec=str(base),
            ft_specs=[str(ft), *map(str, opts.extra_fts)],
            out_arg=str(out),
            out=out_path,
            opts=opts,
            stage=staging_path(out_path),
            rule=MetricRule.parse(opts.metric),
        )

    def emit(self, **ev: Any) -> None:
        """A progress event to the caller (the CLI prints these)."""
        if self.opts.on_event is not None:
            self.opts.on_event(ev)

    def job_dir(self, key: str) -> Path:
        return self.stage / "jobs" / key

    @property
    def remote(self) -> bool:
        """The evaluations run on a remote executor (Ray)."""
        return bool(getattr(self.executor, "remote", False))
