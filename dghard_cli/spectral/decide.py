"""What DG-Hard (or another shrinker) does to one delta matrix: one decision, used by ``repair``,
``merge --method dg-hard`` and ``inspect``, so the three cannot disagree.

:func:`decide` takes the delta's spectrum (None when Δ = 0) and the shrinker and says:

- ``unchanged``: Δ = 0, the fine-tune's value is the base's;
- ``low-rank``: the median singular value is storage rounding noise (a merged LoRA), so the
  unknown-noise threshold means nothing: the delta is kept whole (``repair`` and ``inspect``
  keep the fine-tune's value, ``merge`` adds the whole delta);
- ``filtered``: the shrinker's weights apply; :meth:`Decision.projector` is the operator
  ``Δ ↦ Δ*`` (it may turn out to be the identity, every component kept, or zero, rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dghard_cli.spectral.shrinkers import filter_spectrum
from dghard_cli.spectral.spectrum import Filtered, Projector, ShrinkSpec, Spectrum

UNCHANGED = "unchanged"
LOW_RANK = "low-rank"
FILTERED = "filtered"


@dataclass(frozen=True)
class Decision:
    """The shrinker's verdict on one delta; ``filtered`` is None only when it is ``unchanged``."""

    kind: str
    filtered: Filtered | None = None

    @property
    def stats(self) -> dict:
        return self.filtered.stats if self.filtered is not None else {}

    def projector(self, spectrum: Spectrum, device: torch.device) -> Projector | None:
        """``Δ ↦ Δ*`` on the tall form: None when unchanged, the identity when low-rank."""
        if self.kind == UNCHANGED:
            return None
        if self.kind == LOW_RANK:
            return identity_projector(spectrum.small, device)
        assert self.filtered is not None
        return Projector.from_weights(spectrum, self.filtered.weights)


def identity_projector(m: int, device: torch.device) -> Projector:
    return Projector(
        c=1.0,
        vs=torch.zeros((m, 0), dtype=torch.float64, device=device),
        d=torch.zeros(0, dtype=torch.float64, device=device),
    )


def decide(spectrum: Spectrum | None, spec: ShrinkSpec, *, ft_dtype: str, rms_ft: float) -> Decision:
    """The decision for a delta with this spectrum (None: Δ = 0) under ``spec``.

    ``ft_dtype`` and ``rms_ft`` (the fine-tune's storage dtype and RMS value) give the storage
    rounding noise the low-rank test compares the median singular value with.
    """
    if spectrum is None:
        return Decision(UNCHANGED)
    filt = filter_spectrum(spectrum, spec, ft_dtype=ft_dtype, rms_ft=rms_ft)
    if spec.noise == "median" and filt.stats.get("low_rank"):
        return Decision(LOW_RANK, filt)
    return Decision(FILTERED, filt)
