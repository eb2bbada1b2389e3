"""DG-Hard in ``merge``: each Δ_i of an eligible matrix is filtered as in ``repair`` (the same
spectra, the same :func:`~dghard_cli.spectral.decide.decide`, the same second pass), then the
filtered deltas are combined by task arithmetic; other tensors get plain task arithmetic."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

from dghard_cli.engine.ops import JobInputs, OutputRangeError, strength_advice
from dghard_cli.engine.plan import TensorJob
from dghard_cli.methods.dg_hard import delta_spectrum, filtered_pass
from dghard_cli.methods.merge_ops import BLOCK_BYTES, ElementwiseMergeOp, TaskArithmeticKernel, squared_norm
from dghard_cli.spectral.decide import LOW_RANK, UNCHANGED, decide
from dghard_cli.spectral.spectrum import ROUTE, Projector, ShrinkSpec


class SpectralMergeOp:
    """DG-Hard in merge: ``W_base + λ·Σ_i w_i·Δ_i*`` on eligible matrices, task arithmetic elsewhere."""

    def __init__(
        self,
        spec: ShrinkSpec,
        weights: Sequence[float],
        lam: float,
        device: torch.device,
        is_matrix: Callable[[TensorJob], bool],
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        self.spec = spec
        self.weights, self.lam = list(weights), lam
        self.device = device
        self.is_matrix = is_matrix
        self.block_bytes = block_bytes
        self.fallback = ElementwiseMergeOp(
            lambda job: TaskArithmeticKernel(self.weights, self.lam), device, block_bytes
        )

    def __call__(self, job: TensorJob, src: JobInputs, rec: dict) -> Iterator[torch.Tensor]:
        if not self.is_matrix(job):
            rec["merge_rule"] = "task-arithmetic"
            yield from self.fallback(job, src, rec)
            return
        rec["merge_rule"] = "dg-hard"
        dev = self.device
        projectors: list[Projector | None] = []
        per_ft: list[dict] = []
        norms: list[float] = []
        dots: list[float] = []
        for i, info in enumerate(job.fts):
            ds = delta_spectrum(job, src, dev, self.block_bytes, ft=i)
            norms.append(math.sqrt(max(ds.fro2, 0.0)))
            dots.append(ds.dot_base)
            dec = decide(ds.spectrum, self.spec, ft_dtype=info.dtype, rms_ft=ds.rms_ft)
            shape = ds.shape
            if dec.kind == UNCHANGED:
                projectors.append(None)
                per_ft.append({"decision": "unchanged", "rank_kept": 0})
                continue
            st = dec.stats
            entry = {
                "rank_kept": st["rank_kept"],
                "tau": float(f"{st['tau']:.10g}"),
                "median_sv": float(f"{st['median_sv']:.10g}"),
                "energy_kept": float(f"{st['energy_kept']:.10g}"),
                "decision": "filtered",
            }
            if dec.kind == LOW_RANK:
                entry["decision"] = "low-rank (kept whole)"
                entry["rank_kept"] = int(st["low_rank"])
                entry["energy_kept"] = 1.0
            projectors.append(dec.projector(ds.spectrum, dev))
            per_ft.append(entry)
        rec["delta_norms"] = norms
        rec["delta_norm"] = norms[0]
        rec["delta_dot_bases"] = dots
        rec["delta_dot_base"] = dots[0]
        rec["ranks"] = [e["rank_kept"] for e in per_ft]
        rec["spectral"] = per_ft
        rec["route"] = ROUTE

        def finite(out: torch.Tensor) -> torch.Tensor:
            if not math.isfinite(squared_norm(out)):
                # every delta is finite here (its Gram matrix was checked): the strengths overflow
                # (--weights 1,1e300 reported "the merge produced NaN/Inf", exit 3)
                raise OutputRangeError(
                    f"tensor {job.name!r}: the merge's weighted deltas overflow {out.dtype} from finite inputs",
                    advice=strength_advice(out.dtype),
                )
            return out

        yield from filtered_pass(
            job,
            src,
            shape,
            dev,
            self.block_bytes,
            projectors,
            check=finite,
            weights=self.weights,
            lam=self.lam,
        )
