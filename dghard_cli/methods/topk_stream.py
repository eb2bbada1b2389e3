"""The exact top-k of a tensor's magnitudes, found in a few passes over its row blocks.

:func:`dghard_cli.methods.ties.select_topk` needs the whole magnitude tensor at once (and a few
temporaries of its size). :class:`StreamingTopK` finds the *same* selection while seeing the
tensor only block by block, holding O(2^16) counters and O(block) temporaries, never a
tensor-sized buffer:

1. **Radix passes on the rounded magnitude.** The bit pattern of a non-negative IEEE number
   orders like its value, so the k-th largest magnitude ``T`` (in the work dtype) is found 16
   bits at a time: pass 1 counts the top 16 bits of every entry (``bincount``), which fixes
   the top 16 bits of ``T`` and how many entries lie above that bucket. When that bucket holds
   at most ``cap / 2`` entries (and is not the one of zero), pass 2 gathers their keys and exact
   magnitudes, and ``T`` and its ties are settled from them (2 passes in all, the common case);
   otherwise pass 2 counts the
   next 16 bits of the entries in the bucket, and so on (2 passes for float32, 4 for float64).
   Then ``above`` (entries > T) and ``equal`` (entries == T) are known exactly, and
   ``r = k − above`` of the equal ones must be kept.
2. **Ties at T** (only when ``r < equal``). The order is the one :func:`select_topk` uses:
   larger exact magnitude first (``|W_i − W_base|`` in float64, given per block by a callback),
   then row-major position. The bucket's gathered exact magnitudes give the r-th largest
   ``T64`` of the equal entries at once; after the radix passes, one more pass gathers the
   exact magnitudes of the equal entries when there are at most ``cap`` of them; otherwise the
   same radix passes run on the float64 bit patterns of those entries (4 more passes). Either
   way ``above64`` (equal entries exactly above T64) is known, and the first
   ``r − above64`` entries equal to T with exact magnitude T64, in row-major order, complete
   the k.
3. **The mask** of each block in the final pass (blocks in row-major order): ``m > T``, plus
   the equal entries whose exact magnitude is above T64, plus the first remaining ones at T64.

**Ties at zero** need no exact magnitude: the work-dtype magnitude ``|a − b|`` is 0 only when
``a = b`` (IEEE gradual underflow, torch's default on CPU and CUDA), so every entry at T = 0 has
exact magnitude 0 and the first r of them in row-major order complete the k. This is the common
case of a tensor a fine-tune left unchanged (a frozen embedding, a module no LoRA adapter
touches), where every entry ties: no float64 pass runs over them.

The selection is exactly :func:`select_topk`'s: the same k entries, the same threshold.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dghard_cli.engine.scratch import Scratch
from dghard_cli.methods.ties import bucket_mask, flat_nonzero, in_bucket

#: ``exact(positions) -> float64 magnitudes`` at flat positions *of the current block*.
BlockExact = Callable[["torch.Tensor"], "torch.Tensor"]

_LEVEL_BITS = 16
_INT_VIEW = {"float32": ("int32", 32), "float64": ("int64", 64)}  # by name: no torch at import


class _Radix:
    """Finds the k-th largest of non-negative keys (bit patterns of floats) 16 bits per pass."""

    def __init__(self, bits: int, k: int) -> None:
        self.bits = bits
        self.need = k  # how many of the entries matching ``prefix`` are still to be taken
        self.above = 0  # entries known to be above the current prefix
        self.level = 0
        self.prefix = 0  # the top ``16·level`` bits of the k-th largest key
        self.counts: torch.Tensor | None = None
        self.equal = 0

    @property
    def done(self) -> bool:
        return self.level * _LEVEL_BITS >= self.bits

    def observe(self, keys: torch.Tensor, *, owned: bool = False) -> None:
        """Count one block's keys (int32/int64, any shape) at the current level.

        ``owned``: the keys' buffer is a temporary the caller gives up (shifted in place)."""
        keys = keys.reshape(-1)
        high = self.bits - _LEVEL_BITS * self.level
        shift = high - _LEVEL_BITS
        if self.level == 0:  # non-negative keys: the top 16 bits need no mask
            digit = keys.bitwise_right_shift_(shift) if owned else keys >> shift
        else:
            cand = keys[bucket_mask(keys, high, self.prefix)]
            digit = (cand >> shift) & ((1 << _LEVEL_BITS) - 1)
        c = torch.bincount(digit, minlength=1 << _LEVEL_BITS).cpu()
        self.counts = c if self.counts is None else self.counts + c

    def end_pass(self) -> None:
        counts = self.counts if self.counts is not None else torch.zeros(1 << _LEVEL_BITS, dtype=torch.int64)
        at_least = torch.flip(torch.cumsum(torch.flip(counts, [0]), 0), [0])  # entries in digits >= d
        hits = torch.nonzero(at_least >= self.need).reshape(-1)
        d = int(hits[-1]) if hits.numel() else 0  # (no hit only with non-finite input; refused later)
        above_d = int(at_least[d + 1]) if d + 1 < at_least.numel() else 0
        self.above += above_d
        self.need -= above_d
        self.prefix = (self.prefix << _LEVEL_BITS) | d
        self.equal = int(counts[d])
        self.level += 1
        self.counts = None


class StreamingTopK:
    """The exact top-``k`` (larger magnitude first, then exact magnitude, then row-major
    position) of a tensor of ``numel`` magnitudes in ``dtype``, seen in row blocks.

    Protocol: while :attr:`pending`, call :meth:`observe` on every block in row-major order,
    then :meth:`end_pass`; then call :meth:`mask` on every block in row-major order.
    """

    def __init__(self, numel: int, k: int, dtype: torch.dtype, cap: int = 1 << 22) -> None:
        view = _INT_VIEW.get(str(dtype).removeprefix("torch."))
        if view is None:
            raise ValueError(f"StreamingTopK works on float32/float64 magnitudes, not {dtype}")
        self.numel = numel
        self.k = max(0, min(k, numel))
        self.int_dtype, bits = getattr(torch, view[0]), view[1]
        self.dtype = dtype
        self.cap = cap
        self._value = _Radix(bits, self.k)
        self._exact: _Radix | None = None  # radix on the exact magnitudes of the entries at T
        self._gather: list[torch.Tensor] | None = None
        #: the k-th largest's top-16-bit bucket: its entries' keys and exact magnitudes
        self._bucket: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.stage = "value" if 0 < self.k < numel else "done"
        self.threshold_key = 0
        self.above = numel if self.k == numel else 0
        self.equal = 0
        self._r = 0  # equal entries still to keep
        self._t64: float | None = None  # exact magnitude of the last kept entries (ties)
        self._left = 0  # entries at (T, T64) still to keep, in row-major order
        self._zero_ties = False  # T = 0: the entries at T are exactly 0 (no exact magnitudes needed)
        self.kept = 0
        self._counted = False  # trim_ has added the entries above T to ``kept``
        self._min = float("inf")  # k = numel: the smallest magnitude (the threshold), seen by mask()

    # -- the statistics passes ---------------------------------------------------------------

    @property
    def pending(self) -> bool:
        return self.stage != "done"

    def _keys(self, mag: torch.Tensor) -> torch.Tensor:
        return mag.reshape(-1).view(self.int_dtype)

    def observe(
        self, mag: torch.Tensor, exact: BlockExact, *, owned: bool = False, work: Scratch | None = None
    ) -> None:
        """One block of the current pass (``mag``: |Δ| in the work dtype, contiguous; ``owned``:
        a temporary this call may overwrite; ``work``: buffers for the masks)."""
        keys = self._keys(mag)
        if self.stage == "value":
            self._value.observe(keys, owned=owned)
            return
        if self.stage == "bucket":
            v = self._value
            pos = in_bucket(keys, v.bits - _LEVEL_BITS, v.prefix, work)
            if pos.numel():
                assert self._bucket is not None
                self._bucket[0].append(keys[pos].cpu())
                self._bucket[1].append(exact(pos).to(torch.float64).cpu())
            return
        at_t = torch.nonzero(keys == self.threshold_key).reshape(-1)
        if at_t.numel() == 0:
            return
        ex = exact(at_t).to(torch.float64)
        if self.stage == "gather":
            assert self._gather is not None
            self._gather.append(ex.cpu())
        else:  # "exact": radix on the float64 bit patterns of the exact magnitudes
            assert self._exact is not None
            self._exact.observe(ex.view(torch.int64), owned=True)

    def end_pass(self) -> None:
        if self.stage == "value":
            v = self._value
            v.end_pass()
            if v.level == 1 and not v.done and v.prefix != 0 and v.equal <= self.cap // 2:
                # the k-th largest's bucket is small: gather it whole (keys and exact magnitudes,
                # at most cap·8 bytes as the ties' gather); not the bucket of zero, whose ties
                # need no exact magnitude (an unchanged tensor's entries all sit there)
                self._bucket = ([], [])
                self.stage = "bucket"
                return
            if not v.done:
                return
            self._settle(v.prefix, v.above, v.equal, v.need, None)
            return
        if self.stage == "bucket":
            assert self._bucket is not None
            v = self._value
            keys = torch.cat(self._bucket[0]) if self._bucket[0] else torch.zeros(0, dtype=self.int_dtype)
            ex = torch.cat(self._bucket[1]) if self._bucket[1] else torch.zeros(0, dtype=torch.float64)
            self._bucket = None
            if keys.numel() == 0:  # only with non-finite input (refused later)
                self._settle(v.prefix << (v.bits - _LEVEL_BITS), v.above, 0, v.need, ex)
                return
            need = min(max(v.need, 1), keys.numel())
            t = torch.kthvalue(keys, keys.numel() - need + 1).values
            above = int(torch.count_nonzero(keys > t))
            at_t = keys == t
            self._settle(int(t), v.above + above, int(torch.count_nonzero(at_t)), v.need - above, ex[at_t])
            return
        if self.stage == "gather":
            assert self._gather is not None
            ex = torch.cat(self._gather) if self._gather else torch.zeros(0, dtype=torch.float64)
            self._gather = None
            self._break_ties(ex)
            return
        if self.stage == "exact":
            e = self._exact
            assert e is not None
            e.end_pass()
            if e.done:
                self._t64 = float(torch.tensor(e.prefix, dtype=torch.int64).view(torch.float64))
                self._left = e.need
                self.stage = "done"

    def _settle(self, key: int, above: int, equal: int, r: int, tied: torch.Tensor | None) -> None:
        """``T`` (its key), the entries above and at it and how many of those to keep; ``tied``:
        the exact magnitudes of every entry at T when they are known (the bucket's)."""
        self.threshold_key = key
        self.above, self.equal, self._r = above, equal, r
        if self._r >= self.equal:  # every entry at T is kept: no tie to break
            self._t64 = None
            self.stage = "done"
        elif self.threshold_key == 0:  # ties at zero: all exactly 0, row-major order decides
            self._t64, self._left, self._zero_ties = 0.0, self._r, True
            self.stage = "done"
        elif tied is not None:
            self._break_ties(tied)
        elif self.equal <= self.cap:
            self._gather = []
            self.stage = "gather"
        else:
            self._exact = _Radix(64, self._r)
            self.stage = "exact"

    def _break_ties(self, ex: torch.Tensor) -> None:
        """``T64``, the r-th largest exact magnitude of the entries at T (``ex``), and how many
        entries at (T, T64) are still to keep in row-major order."""
        r = min(max(self._r, 1), max(ex.numel(), 1))
        if ex.numel() == 0:  # only with non-finite input (refused later)
            self._t64, self._left = float("inf"), 0
        else:
            t64 = torch.kthvalue(ex, ex.numel() - r + 1).values
            self._t64 = float(t64)
            self._left = r - int(torch.count_nonzero(ex > t64))
        self.stage = "done"

    # -- the selection -------------------------------------------------------------------

    @property
    def threshold(self) -> float:
        """The k-th largest magnitude (in the work dtype); inf when k = 0."""
        if self.k == 0:
            return float("inf")
        if self.k == self.numel:
            return self._min
        return float(torch.tensor(self.threshold_key, dtype=self.int_dtype).view(self.dtype))

    def trim_(self, delta: torch.Tensor, exact: BlockExact, work: Scratch | None = None) -> torch.Tensor:
        """Zero, in place, the entries of the next block of Δ (row-major order) that the
        selection drops, and return it: ``delta.masked_fill_(~mask(|delta|, exact), 0)`` with no
        mask (hard shrinkage at the threshold, then the kept entries at it put back; a mask and
        ``masked_fill_`` cost 5× as much). ``work``: the magnitudes' buffers."""
        assert not self.pending, "the statistics passes are not finished"
        flat = delta.view(-1)
        n = flat.numel()
        if self.k == 0:
            return delta.zero_()
        mag = (
            flat.abs()
            if work is None
            else torch.abs(flat, out=work.take("ties.1", flat.shape, flat.dtype, flat.device))
        )
        if self.k == self.numel:
            if n:
                self._min = min(self._min, float(mag.min()))
            self.kept += n
            return delta
        keys = self._keys(mag)
        t = self.threshold  # a value of the work dtype: the shrinkage's compare is exact
        if self._t64 is None:  # every entry at T is kept: |Δ| ≥ T, i.e. |Δ| > the number below T
            zero = torch.zeros((), dtype=self.dtype)
            below = float(torch.nextafter(torch.tensor(t, dtype=self.dtype), zero)) if t > 0 else -1.0
            torch.ops.aten.hardshrink.out(flat, below, out=flat)
            self._count_once(self.above + self.equal)
            return delta
        eq = (
            torch.eq(keys, self.threshold_key)
            if work is None
            else torch.eq(
                keys, self.threshold_key, out=work.take("ties.3", keys.shape, torch.bool, keys.device)
            )
        )
        keep = self._kept_at_threshold(flat_nonzero(eq), exact)
        kept_values = flat[keep]
        torch.ops.aten.hardshrink.out(flat, t, out=flat)  # zeroes |Δ| ≤ T
        flat[keep] = kept_values
        self._count_once(self.above)
        self.kept += int(keep.numel())
        return delta

    def _kept_at_threshold(self, at_t: torch.Tensor, exact: BlockExact) -> torch.Tensor:
        """Which of the next block's entries at T (``at_t``: flat positions, ascending) the
        selection keeps: with ties at zero the first ones still to keep, in row-major order;
        else those whose exact magnitude is above T64, then the first ones still to keep at it."""
        if self._zero_ties:
            keep = at_t[: max(self._left, 0)]
            self._left -= int(keep.numel())
            return keep
        if not at_t.numel():
            return at_t
        ex = exact(at_t).to(torch.float64).to(at_t.device)
        chosen = ex > self._t64
        if self._left > 0:
            take = torch.nonzero(ex == self._t64).reshape(-1)[: self._left]
            self._left -= int(take.numel())
            chosen[take] = True
        return at_t[chosen]

    def _count_once(self, n: int) -> None:
        """``kept`` of :meth:`trim_`: the entries above T (and at it, when all are kept) as the
        radix passes counted them, added once, plus the entries at T each block keeps."""
        if not self._counted:
            self.kept += n
            self._counted = True

    def mask(self, mag: torch.Tensor, exact: BlockExact) -> torch.Tensor:
        """The kept entries of the next block (row-major order), as a bool tensor of its shape."""
        assert not self.pending, "the statistics passes are not finished"
        n = mag.numel()
        if self.k == 0:
            return torch.zeros_like(mag, dtype=torch.bool)
        if self.k == self.numel:
            if n:
                self._min = min(self._min, float(mag.min()))
            self.kept += n
            return torch.ones_like(mag, dtype=torch.bool)
        keys = self._keys(mag)
        t = torch.tensor(self.threshold_key, dtype=self.int_dtype, device=keys.device)
        if self._t64 is None:
            m = keys >= t
        else:
            m = keys > t
            m[self._kept_at_threshold(flat_nonzero(keys == t), exact)] = True
        self.kept += int(torch.count_nonzero(m))
        return m.reshape(mag.shape)
