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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dghard_cli.architecture import OUTPUT_HEAD, VOCAB_EMBEDDING
from dghard_cli.errors import InputError
from dghard_cli.io.checkpoint import Checkpoint, TensorInfo, path_exists
from dghard_cli.io.hub import resolve_dir
from dghard_cli.io.lora_adapter import (
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    Adapter,
    classify_tensors,
    open_adapter,
)
from dghard_cli.io.lora_config import ADAPTER_CONFIG, LoraConfig, parse_config
from dghard_cli.io.safetensors_format import FLOAT_DTYPES

#: dtype of the adapted (computed) tensors: W_base + ΔW rounded once to float32.
VIEW_DTYPE = "F32"
#: float64 rows computed at a time when an adapted tensor is read.
COMPUTE_BLOCK_BYTES = 32 * 1024 * 1024

#: transformers model types whose attention/MLP layers are Conv1D (weights stored ``in x out``).
CONV1D_MODEL_TYPES = frozenset({"gpt2", "openai-gpt", "imagegpt", "decision_transformer", "clvp"})

#: Config keys whose truthy value makes PEFT's update something other than scaling·B·A.
UNSUPPORTED_KEYS = {
    "velora_config": "VeLoRA changes the forward pass",
    "alora_invocation_tokens": "an activated LoRA (aLoRA) applies only after its invocation tokens",
    "monteclora_config": "MonteCLoRA samples its update",
    "use_bdlora": "BD-LoRA's factors are block-diagonal and sharded",
    "arrow_config": "Arrow routes between several adapters per token",
    "kasa_config": "KaSA's update is not scaling·B·A",
    "use_qalora": "QA-LoRA pools the input before lora_A",
    "layer_replication": "layer replication adds layers the base does not have",
    "target_parameters": "LoRA on nn.Parameter targets (MoE experts) is not read here",
    "trainable_token_indices": "trainable tokens replace embedding rows outside LoRA",
}

#: ``init_lora_weights`` values whose saved update is relative to a modified base.
UNSUPPORTED_INIT = ("pissa", "olora", "corda", "loftq")

#: CONFIG_INVALID findings on these keys change what the weights mean: refused.
WEIGHT_KEYS = {"peft_type", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "lora_bias"}
WEIGHT_KEYS |= {"rank_pattern", "alpha_pattern"}


@dataclass(frozen=True)
class ModuleDelta:
    """One adapted module: its factors, PEFT's scaling, and how ΔW lies on the base weight."""

    module: str
    a: TensorInfo
    b: TensorInfo
    scaling: float
    rank: int
    transposed: bool  # ΔW = scaling·(B·A)ᵀ (embeddings, Conv1D) instead of scaling·B·A
    embedding: bool
    base: TensorInfo  # the weight ΔW is added to: BASE's, or the adapter's ``base_layer.weight``
    magnitude: TensorInfo | None = None  # DoRA
    b_bias: TensorInfo | None = None  # lora_bias

    @property
    def weight_name(self) -> str:
        return f"{self.module}.weight"

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, A)`` as stored (float64)."""
        return self.b.read().to(torch.float64), self.a.read().to(torch.float64)

    def delta_rows(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``ΔW`` (or its rows ``[r0, r1)``) in the base weight's layout, float64."""
        a = self.a.read().to(torch.float64)
        if self.transposed:
            b = self.b.read().to(torch.float64)
            at = a.T if rows is None else a[:, rows[0] : rows[1]].T
            return (at @ b.T).mul_(self.scaling)
        b = self.b.read(rows).to(torch.float64)
        return (b @ a).mul_(self.scaling)

    def adapted_rows(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``W_ft`` rows as PEFT's merge gives them, float64."""
        w = self.base.read(rows).to(torch.float64).add_(self.delta_rows(rows))
        if self.magnitude is not None:
            m = self.magnitude.read().to(torch.float64).reshape(-1)
            if rows is not None:
                m = m[rows[0] : rows[1]]
            norm = torch.linalg.vector_norm(w, dim=1)
            w.mul_((m / norm).unsqueeze(1))
        return w

    def adapted_bias(self, base_bias: TensorInfo) -> Callable[[tuple[int, int] | None], torch.Tensor]:
        assert self.b_bias is not None
        lb = self.b_bias

        def compute(rows: tuple[int, int] | None) -> torch.Tensor:
            return base_bias.read(rows).to(torch.float64) + self.scaling * lb.read(rows).to(torch.float64)

        return compute


@dataclass(frozen=True)
class ComputedTensorInfo(TensorInfo):
    """A tensor whose bytes are computed on read (float32), not stored anywhere."""

    compute: Callable[[tuple[int, int] | None], torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )
    #: dtype a written checkpoint gives it by default (BASE's), not the computed float32
    output_dtype: str | None = None

    def read_raw(self, rows: tuple[int, int] | None = None, *, pin: bool = False) -> torch.Tensor:
        """float32 bytes of the tensor (or rows ``[r0, r1)``), computed in row blocks so the float64
        intermediate stays within ``COMPUTE_BLOCK_BYTES`` whatever the tensor's size."""
        assert self.compute is not None
        r0, r1 = rows if rows is not None else (0, self.shape[0] if self.shape else 1)
        shape = (r1 - r0, *self.shape[1:]) if self.shape else ()
        out = torch.empty(shape, dtype=torch.float32, pin_memory=pin)
        if len(self.shape) < 2:
            out.copy_(self.compute(rows).reshape(shape))
        else:
            step = max(1, COMPUTE_BLOCK_BYTES // max(1, 8 * math.prod(self.shape[1:])))
            for a in range(r0, r1, step):
                b = min(r1, a + step)
                out[a - r0 : b - r0] = self.compute((a, b))
        return out.reshape(-1).view(torch.uint8)


def _computed(like: TensorInfo, name: str, shard: str, file: Path, compute, output_dtype: str) -> TensorInfo:
    numel = math.prod(like.shape)
    return ComputedTensorInfo(
        name=name,
        dtype=VIEW_DTYPE,
        shape=like.shape,
        shard=shard,
        file=file,
        offset=0,
        nbytes=numel * 4,
        reader=like.reader,
        compute=compute,
        output_dtype=output_dtype,
    )


def looks_like_adapter_tensors(ck: Checkpoint) -> str | None:
    """The first tensor name with PEFT's LoRA layout (``base_model.model.…lora_A…``), if any."""
    for name in ck.tensors:
        if name.startswith(PEFT_PREFIX) and ".lora_" in name:
            return name
    return None


class AdapterCheckpoint(Checkpoint):
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

    # -- building the view ------------------------------------------------------------------------
    def _where(self) -> str:
        return f"{self.label} {self.adapter.source} (a PEFT LoRA adapter)"

    def _discover(self) -> None:
        where = self._where()
        base = self.base
        cfg, findings = parse_config(self.adapter.config_raw, str(self.adapter.path / ADAPTER_CONFIG))
        for f in findings:
            if f.code == "CONFIG_INVALID" and f.details.get("key") in WEIGHT_KEYS:
                raise InputError(f"{where}: {f.message}", hint="`dghard audit-lora` lists every problem")
        self.cfg = cfg
        raw = self.adapter.config_raw
        for key, why in UNSUPPORTED_KEYS.items():
            if raw.get(key):
                raise InputError(
                    f"{where}: {key} is set; {why}, so its update is not the plain LoRA ΔW = scaling·B·A "
                    "that dghard reads (plain LoRA and DoRA adapters are)"
                )
        init = raw.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(UNSUPPORTED_INIT):
            raise InputError(
                f"{where}: init_lora_weights={init!r}: the saved update is relative to the base that "
                "initialisation modified, not to BASE; convert it first with PEFT "
                "(save_pretrained(..., path_initial_model_for_weight_conversion=...))"
            )
        lay = classify_tensors(list(self.adapter.weights.tensors.values()))
        for names, why in (
            (lay.unprefixed, f"lacks PEFT's {PEFT_PREFIX!r} prefix, so PEFT would not load it"),
            (
                lay.adapter_named,
                "still carries an adapter name (lora_A.default.weight), which PEFT does not load",
            ),
            (lay.unrecognized, "is not a LoRA tensor PEFT recognises"),
            (lay.duplicates, "is stored twice"),
            ([t.name for t in lay.tokens], "is a trainable-tokens delta, which dghard does not read"),
        ):
            if names:
                raise InputError(
                    f"{where}: tensor {names[0]!r} {why}", hint="`dghard audit-lora` lists every problem"
                )
        if not lay.modules and not lay.full:
            raise InputError(f"{where}: the adapter holds no LoRA tensors")
        self._drop_tied_alias(lay, where)
        model_type = (base.config() or {}).get("model_type")

        for info, base_name in lay.full:
            if base_name not in base.tensors:
                raise InputError(
                    f"{where}: full tensor {info.name!r} has no counterpart {base_name!r} in BASE "
                    f"({base.source}); is this adapter for another base model?"
                )
            self.full[base_name] = info

        for module, lm in lay.modules.items():
            self.modules[module] = self._module(module, lm, cfg, model_type, where)

        tensors: dict[str, TensorInfo] = {}
        adapter_file = self.adapter.path / ADAPTER_WEIGHTS
        biased = {d.module + ".bias": d for d in self.modules.values() if d.b_bias is not None}
        for name, binfo in base.tensors.items():
            d = self.modules.get(name[: -len(".weight")]) if name.endswith(".weight") else None
            out_dtype = binfo.dtype
            if d is not None:
                tensors[name] = _computed(
                    d.base, name, binfo.shard, adapter_file, d.adapted_rows, d.base.dtype
                )
            elif name in biased:
                full = self.full.get(name, binfo)
                tensors[name] = _computed(
                    binfo, name, binfo.shard, adapter_file, biased[name].adapted_bias(full), out_dtype
                )
            elif name in self.full:
                tensors[name] = dataclasses.replace(self.full[name], name=name, shard=binfo.shard)
            else:
                tensors[name] = binfo
        self.tensors = tensors
        self.index_file = base.index_file
        self.shard_metadata = dict(base.shard_metadata)
        self.shards = [ADAPTER_WEIGHTS, ADAPTER_CONFIG]

    def _drop_tied_alias(self, lay, where: str) -> None:
        """PEFT's ``ensure_weight_tying`` saves the tied output layer's LoRA (the embedding's factors,
        transposed) and its ``base_layer.weight``; a tied BASE does not store that layer, whose
        weight *is* the embedding's. Such an alias is dropped once checked to be the exact tie."""
        base = self.base
        cfg = base.config() or {}
        if not cfg.get("tie_word_embeddings", False) and not (cfg.get("text_config") or {}).get(
            "tie_word_embeddings", False
        ):
            return
        emb = [m for m, lm in lay.modules.items() if lm.embedding and VOCAB_EMBEDDING.search(f"{m}.weight")]
        for m in list(lay.modules):
            if f"{m}.weight" in base.tensors or not OUTPUT_HEAD.search(f"{m}.weight") or len(emb) != 1:
                continue
            out_lm, in_lm = lay.modules[m], lay.modules[emb[0]]
            same = (
                out_lm.a is not None
                and out_lm.b is not None
                and in_lm.a is not None
                and in_lm.b is not None
                and torch.equal(out_lm.a.read(), in_lm.b.read().T)
                and torch.equal(out_lm.b.read(), in_lm.a.read().T)
                and self.cfg.scaling_for(m) == self.cfg.scaling_for(emb[0])
            )
            if not same:
                raise InputError(
                    f"{where}: module {m!r} has its own LoRA update, but BASE ties it to {emb[0]!r} and does "
                    "not store it; a tied checkpoint cannot hold two different updates of one weight"
                )
            del lay.modules[m]
            lay.full = [(t, n) for t, n in lay.full if n != f"{m}.weight"]

    def _module(self, module: str, lm, cfg: LoraConfig, model_type: str | None, where: str) -> ModuleDelta:
        base = self.base
        at = f"{where}: module {module!r}"
        if lm.a is None or lm.b is None:
            missing = "lora_A" if lm.a is None else "lora_B"
            raise InputError(f"{at} has no {missing} tensor; the adapter is incomplete")
        a, b = lm.a, lm.b
        for t in (a, b):
            if t.dtype not in FLOAT_DTYPES:
                raise InputError(f"{at}: tensor {t.name!r} is stored as {t.dtype}, not a float")
            if len(t.shape) != 2:
                raise InputError(
                    f"{at}: tensor {t.name!r} has shape {list(t.shape)}; only Linear, Conv1D and "
                    "Embedding LoRA (2-D factors) are read"
                )
        weight = f"{module}.weight"
        full = self.full.get(weight)
        w = full if full is not None else base.tensors.get(weight)
        if w is None:
            raise InputError(
                f"{at}: BASE ({base.source}) has no tensor {weight!r}; is this adapter for another base model?"
            )
        r = a.shape[0]
        if b.shape[1] != r:
            raise InputError(
                f"{at}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}; their ranks disagree"
            )
        declared = cfg.rank_for(module)
        if declared != r:
            raise InputError(
                f"{at}: the factors have rank {r} but the config gives this module r = {declared} "
                "(r/rank_pattern); PEFT cannot load it"
            )
        scaling = cfg.scaling_for(module)
        if scaling is None:  # pragma: no cover - parse_config refuses an invalid alpha first
            raise InputError(f"{at}: lora_alpha is invalid, so PEFT's scaling is undefined")
        if len(w.shape) != 2:
            raise InputError(f"{at}: the base weight {weight!r} is {list(w.shape)}, not a matrix")
        if lm.embedding:
            transposed = True
            if tuple(w.shape) != (a.shape[1], b.shape[0]):
                raise InputError(
                    f"{at}: embedding factors give ΔW of shape {[a.shape[1], b.shape[0]]} but the base "
                    f"weight is {list(w.shape)}"
                )
        else:
            normal = tuple(w.shape) == (b.shape[0], a.shape[1])
            flipped = tuple(w.shape) == (a.shape[1], b.shape[0])
            if not (normal or flipped):
                raise InputError(
                    f"{at}: lora_B·lora_A is {[b.shape[0], a.shape[1]]} but the base weight {weight!r} "
                    f"is {list(w.shape)}; is this adapter for another base model?"
                )
            # PEFT decides by the layer's type: Conv1D (GPT-2 style, stored in x out) is transposed,
            # nn.Linear is not, whatever fan_in_fan_out says; a square weight needs the model type
            transposed = flipped and (not normal or model_type in CONV1D_MODEL_TYPES)
        magnitude = lm.magnitude
        if cfg.use_dora:
            if magnitude is None:
                raise InputError(f"{at}: use_dora is set but the module has no lora_magnitude_vector")
            if lm.embedding or transposed:
                raise InputError(
                    f"{at}: DoRA on {'an embedding' if lm.embedding else 'a Conv1D layer'} is not read "
                    "(its magnitude normalises columns); only DoRA on Linear layers is"
                )
            if magnitude.numel != w.shape[0] or magnitude.dtype not in FLOAT_DTYPES:
                raise InputError(
                    f"{at}: lora_magnitude_vector is {magnitude.dtype}{list(magnitude.shape)}, expected "
                    f"{w.shape[0]} floats (one per output row)"
                )
        elif magnitude is not None:
            raise InputError(
                f"{at} has a lora_magnitude_vector but use_dora is false; PEFT would drop it — "
                "fix the config (use_dora) or remove the tensor"
            )
        b_bias = lm.b_bias
        if b_bias is not None:
            if not cfg.lora_bias:
                raise InputError(
                    f"{at} has lora_B.bias but lora_bias is false; PEFT would drop it — fix the config "
                    "or remove the tensor"
                )
            if f"{module}.bias" not in base.tensors:
                raise InputError(
                    f"{at}: lora_bias needs a bias in the base layer, and BASE has no {module}.bias "
                    "(PEFT refuses to merge it too)"
                )
            if b_bias.numel != (w.shape[1] if transposed else w.shape[0]):
                raise InputError(f"{at}: lora_B.bias has {b_bias.numel} entries, not the layer's output size")
        return ModuleDelta(
            module=module,
            a=a,
            b=b,
            scaling=float(scaling),
            rank=r,
            transposed=transposed,
            embedding=lm.embedding,
            base=w,
            magnitude=magnitude,
            b_bias=b_bias,
        )

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
        from dghard_cli.io.peft_writer import TOKENIZER_FILE

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
