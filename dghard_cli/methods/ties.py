"""TIES-merging (Yadav et al., 2023): trim, elect sign, disjoint mean.

Per tensor, with Δ_i = W_i − W_base and weights w_i ≥ 0:

1. **trim**: keep the ``k = max(1, ⌊density·n⌋)`` entries of Δ_i with the largest magnitude,
   zero the rest. The k-th largest magnitude is found by selection (``torch.kthvalue``,
   O(n)), never by sorting the tensor. Entries equal to the threshold are kept in row-major
   order until exactly k are kept, so the result is deterministic;
2. **elect**: the sign of ``Σ_i w_i·trim(Δ_i)`` per entry (zero counts as +);
3. **disjoint mean**: the w-weighted mean of the trimmed entries whose sign equals the elected
   one — zeros and zero-weight deltas never agree — or 0 where none agrees;
4. W = W_base + λ·(disjoint mean).

**Exact selection on rounded magnitudes.** The magnitudes may be rounded (Δ of two float32
numbers formed in float32). Rounding is monotone, so the k-th largest rounded magnitude is the
rounding ``t̃`` of the exact threshold, every entry rounded above ``t̃`` is exactly above every
entry rounded to ``t̃``, and every entry rounded below is exactly below. Only the (few) entries
whose rounded magnitude equals ``t̃`` are ambiguous: :func:`select_topk` ranks those by their
exact magnitude (a float64 callback) and then by row-major position. The selection is then
the exact top-k of the exact magnitudes, at the cost of one float32 selection.

Everything here is a pure function of tensors, except :class:`TopKMask`, which applies a
selection to the consecutive row blocks of a tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dghard_cli.engine.scratch import Scratch
from dghard_cli.methods.coefficients import effective_strengths

# Scratch slots (engine.scratch) of the routes given a ``work``, named so that buffers never live
# together share one: the selection uses ``ties.1`` (magnitudes), ``ties.2`` (bucket keys) and
# ``ties.3`` (the bucket's mask); the election ``ties.1`` (sign), ``ties.2`` (agreement, then the
# conflicts' mask), ``ties.3`` (running minimum) and ``ties.4`` (denominator).

#: ``exact(positions) -> float64 magnitudes`` at flat positions (ranks the ambiguous entries).
ExactMagnitudes = Callable[["torch.Tensor"], "torch.Tensor"]


def keep_count(numel: int, density: float) -> int:
    """How many entries a ``density`` keeps: ``max(1, ⌊density·n⌋)``; all for density ≥ 1."""
    if numel <= 0 or density <= 0:
        return 0
    if density >= 1:
        return numel
    return max(1, int(density * numel))


@dataclass(frozen=True)
class TopK:
    """An exact top-k selection: entries above ``threshold``, plus the listed ones equal to it."""

    k: int
    numel: int
    threshold: torch.Tensor  # 0-d: the k-th largest (rounded) magnitude
    keep_equal: torch.Tensor  # sorted flat positions of the kept entries equal to the threshold
    equal: int  # how many entries equal the threshold
    above: int  # how many entries are above it

    @property
    def kept(self) -> int:
        return self.above + int(self.keep_equal.numel())


_BITS = {"float32": ("int32", 16), "float64": ("int64", 48)}  # by name: no torch at import
#: Entries per chunk of the radix histogram (bounds its temporaries).
_RADIX_CHUNK = 1 << 24


def bucket_mask(keys: torch.Tensor, shift: int, bucket: int, work: Scratch | None = None) -> torch.Tensor:
    """Where the non-negative integer ``keys`` have ``keys >> shift == bucket``: the bit patterns
    in ``[bucket << shift, (bucket + 1) << shift)``, two compares and no shifted copy (the masks
    in ``work``'s ``ties.3`` and ``ties.4`` when given)."""
    lo, hi = bucket << shift, (bucket + 1) << shift
    if work is None:
        inside = keys >= lo
    else:
        inside = torch.ge(keys, lo, out=work.take("ties.3", keys.shape, torch.bool, keys.device))
    if hi <= torch.iinfo(keys.dtype).max:  # else the top bucket: no upper end
        if work is None:
            inside.logical_and_(keys < hi)
        else:
            inside.logical_and_(
                torch.lt(keys, hi, out=work.take("ties.4", keys.shape, torch.bool, keys.device))
            )
    return inside


def flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """The flat positions where a bool ``mask`` is set, ascending: ``torch.nonzero``, but 3-8×
    faster when few are set (the bucket of a top-k threshold, the entries tied at it): the
    mask's 8-byte words are scanned first, then the bytes of the words that hold a set one. A
    mask with more than one set word in 16 takes the plain scan."""
    flat = mask.reshape(-1)
    n = flat.numel()
    m8 = n - n % 8
    if m8 == 0 or flat.device.type != "cpu" or not flat.is_contiguous() or flat.storage_offset() % 8:
        return torch.nonzero(flat).reshape(-1)
    words = torch.nonzero(flat[:m8].view(torch.int64)).reshape(-1)
    if words.numel() * 16 > m8 // 8:
        return torch.nonzero(flat).reshape(-1)
    r, c = torch.nonzero(flat[:m8].view(-1, 8)[words], as_tuple=True)
    pos = words[r] * 8 + c
    if m8 < n:
        pos = torch.cat([pos, torch.nonzero(flat[m8:]).reshape(-1) + m8])
    return pos


def in_bucket(keys: torch.Tensor, shift: int, bucket: int, work: Scratch | None = None) -> torch.Tensor:
    """Flat positions of :func:`bucket_mask`."""
    return flat_nonzero(bucket_mask(keys, shift, bucket, work))


def _kth_largest_candidates(
    flat: torch.Tensor, k: int, work: Scratch | None = None
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(threshold, entries above it, flat positions equal to it) for the k-th largest of ``flat``.

    ``flat``: 1-D, non-negative. For float32/float64 a radix step narrows the search: the bit
    pattern of a non-negative IEEE number orders like its value, so a histogram of the top 15
    value bits (``bincount``) finds the bucket holding the k-th largest, and ``kthvalue`` runs on
    that bucket only. Other dtypes: ``kthvalue`` on the whole tensor. ``work``: the bucket keys
    go in its buffers (and are kept for the bucket's positions when ``flat`` is one chunk).
    """
    n = flat.numel()
    spec = _BITS.get(str(flat.dtype).removeprefix("torch."))
    if spec is None or not flat.is_contiguous():
        t = torch.kthvalue(flat, n - k + 1).values
        return t, int(torch.count_nonzero(flat > t)), torch.nonzero(flat == t).reshape(-1)
    int_name, shift = spec
    ints = flat.view(getattr(torch, int_name))
    # bucket = top 15 value bits, in [0, 2^15) for non-negative values; computed chunk by chunk so
    # the temporaries stay small however long the tensor (one 1×N matrix is one "row")
    spans = [(i, min(i + _RADIX_CHUNK, n)) for i in range(0, n, _RADIX_CHUNK)]
    counts = torch.zeros(1 << 15, dtype=torch.int64, device=flat.device)
    keys = None
    for i0, i1 in spans:
        chunk = ints[i0:i1]
        if work is None:
            keys = chunk >> shift
        else:
            keys = torch.bitwise_right_shift(
                chunk, shift, out=work.take("ties.2", chunk.shape, chunk.dtype, chunk.device)
            )
        counts += torch.bincount(keys, minlength=1 << 15)
    at_least = torch.flip(torch.cumsum(torch.flip(counts, [0]), 0), [0])  # entries in buckets >= b
    b = int(torch.nonzero(at_least >= k).reshape(-1)[-1])
    above_bucket = int(at_least[b + 1]) if b + 1 < at_least.numel() else 0
    if work is not None and len(spans) == 1:  # the one chunk's keys are still there
        assert keys is not None
        inside = torch.eq(keys, b, out=work.take("ties.3", keys.shape, torch.bool, keys.device))
        pos = flat_nonzero(inside)
    else:
        pos = torch.cat([in_bucket(ints[i0:i1], shift, b) + i0 for i0, i1 in spans])
    cand = flat[pos]
    t = torch.kthvalue(cand, cand.numel() - (k - above_bucket) + 1).values
    above = above_bucket + int(torch.count_nonzero(cand > t))
    return t, above, pos[cand == t]


def select_topk(
    magnitude: torch.Tensor, k: int, exact: ExactMagnitudes | None = None, *, work: Scratch | None = None
) -> TopK:
    """Exact top-``k`` of a magnitude tensor (any shape, row-major order), with no sort.

    ``exact`` gives the unrounded magnitudes at given flat positions; without it the
    magnitudes are taken as exact. ``work``: reusable buffers for the temporaries.
    """
    flat = magnitude.reshape(-1)
    n = flat.numel()
    empty = torch.zeros(0, dtype=torch.long)
    if k <= 0 or n == 0:
        return TopK(0, n, flat.new_tensor(float("inf")), empty, 0, 0)
    k = min(k, n)
    if k < n:
        threshold, above, equal_pos = _kth_largest_candidates(flat, k, work)
    else:
        threshold = flat.min()
        above = int(torch.count_nonzero(flat > threshold))
        equal_pos = torch.nonzero(flat == threshold).reshape(-1)
    equal_pos = equal_pos.cpu()  # ascending: row-major order
    r = k - above
    if r >= equal_pos.numel():
        keep = equal_pos
    elif float(threshold) == 0.0:  # ties at zero are exactly 0 (a − b = 0 only when a = b)
        keep = equal_pos[:r]
    else:
        values = exact(equal_pos) if exact is not None else flat[equal_pos.to(flat.device)]
        values = values.to(torch.float64).cpu()
        order = torch.argsort(-values, stable=True)  # larger first; equal: row-major first
        keep = torch.sort(equal_pos[order[:r]]).values
    return TopK(k, n, threshold, keep, int(equal_pos.numel()), above)


def selection_mask(magnitude: torch.Tensor, sel: TopK) -> torch.Tensor:
    """The kept entries of a whole tensor (``magnitude`` as given to :func:`select_topk`)."""
    return TopKMask(sel, count=False)(magnitude)


class TopKMask:
    """Applies a :class:`TopK` to consecutive row blocks (row-major order) of the same tensor."""

    def __init__(self, sel: TopK, *, count: bool = True) -> None:
        self.sel = sel
        self.pos = 0
        self.kept = 0
        self.count = count

    def __call__(self, magnitude: torch.Tensor) -> torch.Tensor:
        sel = self.sel
        n = magnitude.numel()
        if sel.k == 0:
            mask = torch.zeros_like(magnitude, dtype=torch.bool)
        else:
            mask = magnitude > sel.threshold.to(magnitude.device)
            keep = sel.keep_equal
            lo = int(torch.searchsorted(keep, self.pos))
            hi = int(torch.searchsorted(keep, self.pos + n))
            if hi > lo:
                mask.view(-1)[(keep[lo:hi] - self.pos).to(mask.device)] = True
        self.pos += n
        if self.count:
            self.kept += int(torch.count_nonzero(mask))
        return mask


def trim_(delta: torch.Tensor, sel: TopK) -> torch.Tensor:
    """Zero, in place, the entries of a whole ``delta`` that ``sel`` (the selection of
    ``|delta|``) does not keep, and return it: ``delta.masked_fill_(~selection_mask(|delta|,
    sel), 0)`` without a mask or a copy (15× faster on 4 M values). Hard shrinkage zeroes every
    entry with ``|x| ≤ threshold`` (the threshold is a value of ``delta``'s dtype, so the compare
    is exact), then the kept entries equal to the threshold are put back."""
    flat = delta.view(-1)
    if sel.k == 0:
        return delta.zero_()
    keep = sel.keep_equal.to(flat.device)
    kept_equal = flat[keep]
    torch.ops.aten.hardshrink.out(flat, float(sel.threshold), out=flat)
    flat[keep] = kept_equal
    return delta


def topk_mask(magnitude: torch.Tensor, k: int, exact: ExactMagnitudes | None = None) -> torch.Tensor:
    """Boolean mask of the exact top-``k`` magnitudes (ties: first in row-major order)."""
    return TopKMask(select_topk(magnitude, k, exact))(magnitude)


def trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Δ with all but its ``keep_count(n, density)`` largest-magnitude entries set to zero."""
    mask = topk_mask(delta.abs(), keep_count(delta.numel(), density))
    return torch.where(mask, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))


def elect_sign(
    trimmed: Sequence[torch.Tensor], weights: Sequence[float], *, work: Scratch | None = None
) -> torch.Tensor:
    """+1/−1 per entry: the sign of ``Σ_i w_i·trimmed_i``, zero counting as +1 (in ``work``'s
    buffer when given)."""
    t0 = trimmed[0]
    weights, _ = effective_strengths(weights, 1.0, t0.dtype, scale_free=True)  # a sign: scale-free
    if work is None:
        total = t0 * weights[0]
    else:
        total = torch.mul(t0, weights[0], out=work.take("ties.1", t0.shape, t0.dtype, t0.device))
    for t, w in zip(trimmed[1:], weights[1:], strict=True):
        total.add_(t, alpha=w)
    # copysign(1, x): +1 for x >= +0; −0 only arises when every term is zero (nothing agrees)
    one = torch.ones((), dtype=total.dtype, device=total.device).expand(total.shape)
    return torch.copysign(one, total, out=total)


def disjoint_mean(
    trimmed: Sequence[torch.Tensor],
    weights: Sequence[float],
    sign: torch.Tensor,
    stats: dict | None = None,
    *,
    normalize: bool = True,
    work: Scratch | None = None,
) -> torch.Tensor:
    """``Σ_i w_i·t_i·[agree_i] / Σ_i w_i·[agree_i]`` per entry, 0 where nothing agrees.

    ``agree_i``: ``t_i`` is non-zero with the elected sign (weights must be ≥ 0; a zero weight
    never agrees). With ``stats``, adds ``sign_conflicts``: entries where a non-zero entry of a
    weighted delta has the other sign. ``normalize=False``: the disjoint *sum*
    ``Σ_i w_i·t_i·[agree_i]`` (mergekit's ``normalize: false``). ``work``: ``trimmed`` (the
    caller's own) is overwritten and the temporaries come from ``work`` — the same numbers.
    """
    if any(w < 0 for w in weights):
        raise ValueError("disjoint_mean takes weights >= 0")
    if work is None:  # the inputs stay as given: the same route over copies and a scratch of its own
        trimmed, work = [t.clone() for t in trimmed], Scratch()
    return _disjoint_mean_over(trimmed, weights, sign, stats, normalize, work)


def _disjoint_mean_over(
    trimmed: Sequence[torch.Tensor],
    weights: Sequence[float],
    sign: torch.Tensor,
    stats: dict | None,
    normalize: bool,
    work: Scratch,
) -> torch.Tensor:
    """:func:`disjoint_mean` in float arithmetic over reused buffers, overwriting ``trimmed``.

    Boolean temporaries cost more than the arithmetic (a mixed bool/float ``add_`` is 10× a
    float one): ``[agree_i]`` is ``sign(max(p_i, 0))`` (1 or 0), a conflict is ``min_i p_i < 0``,
    and "nothing agrees" (a zero denominator, whose numerator is then ±0) is mapped to a
    harmless divisor by ``clamp(min=tiny)``, which moves no non-zero denominator: each is a sum
    of weights, at least the smallest one (when that is below ``tiny``, the mask is used).
    """
    shape, dtype, dev = sign.shape, sign.dtype, sign.device
    num: torch.Tensor | None = None
    den: torch.Tensor | None = None
    low: torch.Tensor | None = None  # min_i p_i: < 0 where some weighted delta disagrees
    agree = work.take("ties.2", shape, dtype, dev)
    used = [w for w in weights if w != 0]
    for t, w in zip(trimmed, weights, strict=True):
        if w == 0:
            continue
        p = t.mul_(sign)  # > 0: agrees (and equals |t|); < 0: disagrees
        if stats is not None:
            low = (
                work.take("ties.3", shape, dtype, dev).copy_(p)
                if low is None
                else torch.minimum(low, p, out=low)
            )
        p.clamp_(min=0)
        torch.sign(p, out=agree)  # 1 where p > 0, else 0
        if num is None:
            num = p.mul_(w) if w != 1 else p
            den = work.take("ties.4", shape, dtype, dev).copy_(agree).mul_(w)
        else:
            num.add_(p, alpha=w)
            assert den is not None
            den.add_(agree, alpha=w)
    if num is None or den is None:  # every weight is zero
        return torch.zeros_like(sign)
    if stats is not None and low is not None:
        below = torch.lt(low, 0, out=work.take("ties.2", shape, torch.bool, dev))
        stats["sign_conflicts"] = stats.get("sign_conflicts", 0) + int(torch.count_nonzero(below))
    if not normalize:
        return num.mul_(sign)
    tiny = torch.finfo(dtype).tiny
    if min(torch.tensor(used, dtype=dtype).tolist()) >= tiny:
        den.clamp_(min=tiny)
    else:  # a weight below the smallest normal number: keep the exact mask
        den.masked_fill_(den == 0, 1)
    return num.div_(den).mul_(sign)


def sign_conflicts(trimmed: Sequence[torch.Tensor]) -> int:
    """Entries where two trimmed deltas are non-zero with opposite signs."""
    pos = torch.zeros_like(trimmed[0], dtype=torch.bool)
    neg = torch.zeros_like(trimmed[0], dtype=torch.bool)
    for t in trimmed:
        pos |= t > 0
        neg |= t < 0
    return int(torch.count_nonzero(pos & neg))


def ties_delta(
    trimmed: Sequence[torch.Tensor],
    weights: Sequence[float],
    lam: float,
    stats: dict | None = None,
    *,
    normalize: bool = True,
    work: Scratch | None = None,
) -> torch.Tensor:
    """Sign election and disjoint mean (or sum) of already trimmed (or DARE-dropped) deltas, times
    λ. ``work``: ``trimmed`` (the caller's own) is overwritten, temporaries come from ``work``."""
    weights, lam = effective_strengths(weights, lam, trimmed[0].dtype, scale_free=normalize)
    sign = elect_sign(trimmed, weights, work=work)
    out = disjoint_mean(trimmed, weights, sign, stats, normalize=normalize, work=work)
    if lam != 1.0:
        out.mul_(lam)
    return out


def ties_merge(
    base: torch.Tensor,
    fts: Sequence[torch.Tensor],
    weights: Sequence[float],
    density: float,
    lam: float = 1.0,
) -> torch.Tensor:
    """TIES on whole tensors: ``W_base + λ·disjoint_mean(elect(trim(Δ_i)))``.

    Public in-memory API (the commands stream through ``TiesKernel`` instead).
    """
    trimmed = [trim(f - base, density) for f in fts]
    return base + ties_delta(trimmed, weights, lam)
