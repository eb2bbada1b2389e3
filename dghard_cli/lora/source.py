"""A PEFT LoRA adapter read as the fine-tuned checkpoint: ``BASE + ΔW``, one tensor at a time.

Wherever a command takes FT, :func:`open_ft` accepts a PEFT LoRA adapter directory (or Hub id)
too. It returns an :class:`AdapterCheckpoint`: a :class:`~dghard_cli.io.checkpoint.Checkpoint`
whose tensors are BASE's names, and whose values are what PEFT's ``merge_and_unload()`` would
give, computed lazily per tensor (or per row block) when the engine reads it. Every method then
works unchanged, and nothing dense is ever held beyond the tensor (or block) in flight.

Per adapted module ``M`` (base weight ``M.weight``), as PEFT 0.21 computes it:

- ``scaling = α/r`` (``α/√r`` with ``use_rslora``), r and α per module after ``rank_pattern``/
  ``alpha_pattern`` (PEFT's key matching: the first key ``k`` with
  ``re.match(rf"(.*\\.)?({k})$", M)``);
- Linear: ``ΔW = scaling·B·A`` (``out x in``); Conv1D layers (``fan_in_fan_out``: GPT-2-style
  weights stored ``in x out``) and embeddings (``lora_embedding_A`` is ``r x vocab``,
  ``lora_embedding_B`` ``dim x r``, the base weight ``vocab x dim``): ``ΔW = scaling·(B·A)ᵀ``;
- DoRA (``use_dora``, Linear layers): ``W = (m / ‖W_base + ΔW‖_row) ⊙ (W_base + ΔW)`` with the
  magnitude vector ``m`` (one entry per output row: rows are complete in every row block);
- ``lora_bias``: the bias becomes ``b_base + scaling·lora_B.bias``;
- full tensors in the adapter (``modules_to_save`` copies, trained biases, the embedding's
  ``base_layer.weight`` PEFT saves with embedding adapters) replace BASE's value (and, for a
  ``base_layer`` weight, are what ``ΔW`` is added to).

The adapted values are float32 (``W_base + ΔW`` formed in float64 and rounded once), so
``Δ = W_ft − W_base`` is recovered to float32 rounding; the dtype a written checkpoint gets by
default is BASE's (``output_dtype``), as PEFT's merge leaves it.

Anything whose update is not this (VeLoRA, aLoRA, BD-LoRA, KaSA, Arrow, QA-LoRA, trainable
tokens, LoRA on parameters, layer replication, PiSSA/OLoRA/CorDA/LoftQ adapters that still need
their converted base, Conv LoRA, DoRA on embeddings or Conv1D) is refused with a one-line reason.

The code is in three modules: :mod:`dghard_cli.lora.view` (the computed tensors),
:mod:`dghard_cli.lora.reading` (the adapter's config and factors read and checked against
BASE) and this one (:class:`AdapterCheckpoint`, :func:`open_ft`).
"""

from __future__ import annotations

from pathlib import Path

from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint, TensorInfo, path_exists
from dghard_cli.io.hub import resolve_dir
from dghard_cli.lora.adapter import PEFT_PREFIX, Adapter, open_adapter
from dghard_cli.lora.config import ADAPTER_CONFIG, LoraConfig
from dghard_cli.lora.reading import CONV1D_MODEL_TYPES, AdapterReading
from dghard_cli.lora.view import ComputedTensorInfo, ModuleDelta

__all__ = [
    "CONV1D_MODEL_TYPES",
    "AdapterCheckpoint",
    "ComputedTensorInfo",
    "check_base",
    "is_adapter",
    "looks_like_adapter_tensors",
    "open_ft",
]


def looks_like_adapter_tensors(ck: Checkpoint) -> str | None:
    """The first tensor name with PEFT's LoRA layout (``base_model.model.…lora_A…``), if any."""
    for name in ck.tensors:
        if name.startswith(PEFT_PREFIX) and ".lora_" in name:
            return name
    return None


class AdapterCheckpoint(AdapterReading):
    """BASE + a PEFT LoRA adapter, presented as the fine-tuned checkpoint.

    ``path`` is the adapter directory; ``shards`` are the adapter's two files (what the run's
    identity and resume fingerprint are made of); the output layout (shard names, index,
    shard metadata) mirrors BASE's. ``modules`` holds each adapted module's factors,
    ``full`` the adapter's full tensors by BASE name.
    """

    def __init__(self, adapter: Adapter, base: Checkpoint, *, label: str = "FT") -> None:
        self.adapter = adapter
        self.base = base
        self.modules: dict[str, ModuleDelta] = {}
        self.full: dict[str, TensorInfo] = {}
        self.cfg: LoraConfig = LoraConfig()
        super().__init__(adapter.path, label=label, source=adapter.source, revision=adapter.revision)

    # -- what the rest of the tool asks of a checkpoint -------------------------------------------
    @property
    def total_bytes(self) -> int:
        return self.adapter.weights.total_bytes

    def config(self) -> dict | None:
        return self.base.config()

    def describe(self) -> dict:
        ranks = sorted({d.rank for d in self.modules.values()})
        return {
            "source": self.source,
            "path": str(self.path),
            "revision": self.revision,
            "kind": "peft-lora",
            "modules": len(self.modules),
            "ranks": ranks,
            "dora": self.cfg.use_dora,
            "full_tensors": sorted(self.full),
            "tensors": len(self.adapter.weights.tensors),
            "bytes": self.adapter.weights.total_bytes,
        }

    def side_file_sources(self) -> list[tuple[Path, set[str]]]:
        """Where a full checkpoint written from this view takes its side files: BASE's config,
        generation config and tokenizer, then the adapter's own tokenizer or chat template files
        (a fine-tune's, which win), never the adapter's config."""
        from dghard_cli.lora.writer import TOKENIZER_FILE

        base_skip = set(self.base.shards) | ({self.base.index_file} if self.base.index_file else set())
        adapter_skip = {p.name for p in Path(self.adapter.path).iterdir() if not TOKENIZER_FILE.match(p.name)}
        return [(self.base.path, base_skip), (self.adapter.path, adapter_skip)]

    def close(self) -> None:
        self.adapter.weights.close()

    @property
    def linear(self) -> bool:
        """Is the update linear in B (strengths scale it exactly)? Not with DoRA."""
        return not self.cfg.use_dora


def is_adapter(ck: Checkpoint) -> bool:
    return isinstance(ck, AdapterCheckpoint)


def check_base(base: Checkpoint) -> None:
    """BASE must be a model, not an adapter."""
    name = looks_like_adapter_tensors(base)
    if name is not None or path_exists(Path(base.path) / ADAPTER_CONFIG):
        raise InputError(
            f"BASE {base.source} is a PEFT LoRA adapter (tensor {name!r}); give the model the adapter "
            "was trained on as BASE and the adapter as FT"
        )


def open_ft(spec: str, *, base: Checkpoint, revision: str | None = None, label: str = "FT") -> Checkpoint:
    """Open FT: a checkpoint directory or Hub id, or a PEFT LoRA adapter (read against ``base``)."""
    check_base(base)
    path = resolve_dir(spec, revision=revision, label=label)
    if path.is_dir() and path_exists(path / ADAPTER_CONFIG):
        adapter = open_adapter(str(path))
        adapter.source, adapter.revision = spec, revision
        try:
            return AdapterCheckpoint(adapter, base, label=label)
        except BaseException:
            adapter.weights.close()
            raise
    ck = Checkpoint(path, label=label, source=spec, revision=revision)
    name = looks_like_adapter_tensors(ck)
    if name is not None:
        ck.close()
        raise InputError(
            f"{label} {spec}: holds PEFT LoRA tensors (e.g. {name!r}) but no {ADAPTER_CONFIG}; put the "
            "adapter's config next to its weights (PEFT's save_pretrained writes both)"
        )
    return ck
