"""Writing a PEFT LoRA adapter: ``adapter_config.json`` + ``adapter_model.safetensors``.

Through the project's one output discipline (:mod:`dghard_cli.io.output`): everything goes into
the staging directory beside OUT and is renamed into place at the end, every safetensors file is
streamed by :class:`~dghard_cli.io.output.ShardWriter`, and each finished piece is journaled so an
interrupted run resumes. An adapter's tensor shapes (the kept ranks) are known only once every
module has been computed, so each module's tensors are first *spooled* into their own small
journaled file in the staging directory; :meth:`AdapterStage.finish` then streams them into
``adapter_model.safetensors`` under PEFT's names and removes the spool.

What PEFT 0.21 loads, and so what is written (``M`` is a module name of the base model):

- a low-rank module: ``base_model.model.M.lora_A.weight`` (``k x in``) and ``.lora_B.weight``
  (``out x k``); an embedding: ``M.lora_embedding_A`` (``k x vocab``) and ``M.lora_embedding_B``
  (``dim x k``). Scaling is 1 everywhere: ``lora_alpha = r`` and, for modules of another rank,
  ``rank_pattern``/``alpha_pattern`` entries with equal values, keyed by a regex that matches that
  module alone under PEFT's rule ``re.match(rf"(.*\\.)?({key})$", M)``;
- a changed bias of a low-rank module: ``base_model.model.M.base_layer.bias`` (``bias:
  "lora_only"``, as PEFT saves trained biases);
- any other changed tensor ``M.p`` (norms, small matrices, an update that is not low-rank):
  ``base_model.model.M.p`` with ``M`` in ``modules_to_save`` — and then every parameter of ``M``
  (PEFT's loader expects the module's whole state);
- tied embeddings whose update is low-rank: the embedding's LoRA and the output layer's (the same
  ΔW, transposed factors) with ``ensure_weight_tying``, as PEFT itself saves them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from dghard_cli.errors import InputError, RuntimeFailure
from dghard_cli.io.checkpoint import TensorInfo
from dghard_cli.io.output import OutputStage, ShardRecord, file_sha256
from dghard_cli.io.safetensors_format import DTYPES
from dghard_cli.lora.adapter import ADAPTER_WEIGHTS, PEFT_PREFIX, AdapterWeights
from dghard_cli.lora.config import ADAPTER_CONFIG

SPOOL_PREFIX = "dghard-spool-"
_CHUNK = 64 * 1024 * 1024

#: Tokenizer and chat-template files an adapter directory may carry (never a model config).
TOKENIZER_FILE = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|chat_template.*|vocab.*|merges.*|.*\.model|.*\.tiktoken)$"
)

#: The files an adapter output holds besides the model card and the report.
ADAPTER_FILES = (ADAPTER_WEIGHTS, ADAPTER_CONFIG)


def tokenizer_files(directory: Path) -> set[str]:
    """The names in ``directory`` an adapter output copies: its tokenizer files."""
    return {p.name for p in Path(directory).iterdir() if TOKENIZER_FILE.match(p.name)}


def st_dtype(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    return next(k for k, v in DTYPES.items() if v[1] == name and k not in ("U16", "U32", "U64"))


def module_names(tensor_names) -> set[str]:
    """Every module name (each dotted prefix of a parameter name) of a model."""
    out: set[str] = set()
    for name in tensor_names:
        parts = name.split(".")
        for i in range(1, len(parts)):
            out.add(".".join(parts[:i]))
    return out


def _peft_matches(key: str, module: str) -> bool:
    return re.match(rf"(.*\.)?({key})$", module) is not None


def pattern_key(module: str, modules: set[str]) -> str:
    """A ``rank_pattern``/``alpha_pattern`` key that PEFT matches to ``module`` alone.

    The module name without its first component (``layers\\.0\\.self_attn\\.q_proj``: also what
    PEFT releases before 0.14, which required a dot before the key, match), or, when that is
    ambiguous in this model, the whole name anchored (``^model\\.layers…``).
    """
    parts = module.split(".")
    if len(parts) > 1:
        key = re.escape(".".join(parts[1:]))
        if [m for m in modules | {module} if _peft_matches(key, m)] == [module]:
            return key
    return "^" + re.escape(module)


def target_modules(lora_modules: list[str], modules: set[str]) -> list[str] | str:
    """PEFT's ``target_modules``: the module names (a list matches a name or a ``.``-suffix), or a
    full-match regex of them when some other module's name ends with one of them."""
    names = sorted(lora_modules)
    chosen = set(names)
    clash = any(m not in chosen and any(m.endswith("." + t) for t in names) for m in modules)
    if not clash:
        return names
    return "^(" + "|".join(re.escape(n) for n in names) + ")$"


def adapter_config(
    *,
    ranks: dict[str, int],
    modules: set[str],
    modules_to_save: list[str],
    bias: str,
    fan_in_fan_out: bool,
    base_model: str | None,
    revision: str | None,
    task_type: str | None,
    tie_embeddings: bool,
    use_dora: bool = False,
) -> dict:
    """``adapter_config.json`` for factors with scaling 1 (``lora_alpha = r`` per module); with
    ``use_dora`` every LoRA module has its ``lora_magnitude_vector``."""
    if ranks:
        counts = Counter(ranks.values())
        r = max(counts, key=lambda k: (counts[k], k))
    else:
        r = 1
    pattern = {pattern_key(m, modules): k for m, k in ranks.items() if k != r}
    cfg = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model,
        "revision": revision,
        "inference_mode": True,
        "r": r,
        "lora_alpha": r,
        "lora_dropout": 0.0,
        "use_rslora": False,
        "use_dora": use_dora,
        "lora_bias": False,
        "bias": bias,
        "fan_in_fan_out": fan_in_fan_out,
        "init_lora_weights": True,
        "target_modules": target_modules(list(ranks), modules) if ranks else None,
        "exclude_modules": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": pattern,
        "alpha_pattern": dict(pattern),
        "modules_to_save": sorted(modules_to_save) or None,
    }
    if tie_embeddings:
        cfg["ensure_weight_tying"] = True
    return cfg


def lora_keys(module: str, embedding: bool) -> tuple[str, str]:
    """PEFT's saved names of a module's A and B factors."""
    if embedding:
        return f"{PEFT_PREFIX}{module}.lora_embedding_A", f"{PEFT_PREFIX}{module}.lora_embedding_B"
    return f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def check_finite_output(key: str, t: torch.Tensor, record: dict) -> None:
    """The adapter route's finiteness rule, at the one place its tensors are written: a factor
    or full tensor holding NaN/Inf (an input's, or finite values that overflowed the scaling or
    the output dtype) is never spooled; InputError naming the module and the causes."""
    if not t.is_floating_point() or not t.numel() or bool(torch.isfinite(t).all()):
        return
    module = record.get("name") or record.get("module") or "?"
    raise InputError(
        f"tensor {module!r} ({key}): the adapter output would hold NaN/Inf; the adapter's factors or "
        "modules_to_save tensors hold non-finite values, or lora_alpha/r (the scaling) or a strength "
        "overflows the output dtype; fix the adapter, or lower the strengths (--lambda, --alpha) or "
        "write a wider output (--dtype fp32)"
    )


class AdapterStage:
    """The staging directory of an adapter output: spooled units, then the adapter's files."""

    def __init__(self, out: Path, fingerprint: str, *, resume: bool | None, overwrite: bool):
        """OUT was checked by the writer (:class:`~dghard_cli.engine.writer.OutputTarget`)."""
        self.out = Path(out)
        self.overwrite = overwrite
        self.stage = OutputStage(Path(out), fingerprint, resume=resume)
        self._open: list[AdapterWeights] = []

    @property
    def dir(self) -> Path:
        return self.stage.dir

    @staticmethod
    def spool_name(index: int) -> str:
        return f"{SPOOL_PREFIX}{index:06d}.safetensors"

    def resumed(self, index: int) -> dict | None:
        """The record of unit ``index`` if an interrupted run spooled it already."""
        rec = self.stage.done.get(self.spool_name(index))
        return rec.tensors[0] if rec is not None and rec.tensors else None

    def put(self, index: int, tensors: dict[str, torch.Tensor], record: dict) -> None:
        """Spool one unit's tensors (streamed, hashed, journaled); ``record`` is its report record."""
        name = self.spool_name(index)
        for k, t in tensors.items():
            check_finite_output(k, t, record)
        entries = [(k, st_dtype(t), tuple(t.shape)) for k, t in tensors.items()]
        writer = self.stage.shard_writer(name, entries, {"format": "pt"})
        try:
            for k, t in tensors.items():
                writer.write(k, _bytes(t))
            size, digest = writer.finish()
        except BaseException:
            writer.abort()
            raise
        self.stage.record(ShardRecord(name=name, size=size, sha256=digest, tensors=[record]))

    def spooled(self, index: int) -> dict[str, TensorInfo]:
        """The tensors of a spooled unit, read back through the validated reader."""
        w = AdapterWeights(self.dir / self.spool_name(index), source="spool", revision=None)
        self._open.append(w)
        return w.tensors

    def finish(
        self,
        items: list[tuple[str, TensorInfo]],
        *,
        config: dict,
        tokenizer_dirs: list[Path],
        documents: Callable[[dict], dict[str, str]],
    ) -> dict:
        """Stream ``items`` (PEFT key, source tensor) into ``adapter_model.safetensors``, write the
        config and tokenizer files, then ``documents(output)`` (file name -> text: the model card
        and the report, given what was written), drop the spool and rename into place."""
        entries = [(key, info.dtype, tuple(info.shape)) for key, info in items]
        seen = Counter(k for k, _, _ in entries)
        dup = [k for k, c in seen.items() if c > 1]
        if dup:
            raise RuntimeFailure(f"internal error: adapter tensor {dup[0]!r} written twice")
        writer = self.stage.shard_writer(ADAPTER_WEIGHTS, entries, {"format": "pt"})
        try:
            for key, info in items:
                rows = None if len(info.shape) < 2 else info.shape[0]
                step = max(1, _CHUNK // max(1, info.row_bytes)) if rows else None
                if rows is None or info.nbytes <= _CHUNK:
                    writer.write(key, _bytes(info.read_raw()))
                else:
                    for r0 in range(0, rows, step):
                        writer.write(key, _bytes(info.read_raw((r0, min(rows, r0 + step)))))
            size, digest = writer.finish()
        except BaseException:
            writer.abort()
            raise
        finally:
            for w in self._open:
                w.close()
            self._open = []
        self.stage.write_json(ADAPTER_CONFIG, config)
        config_file = self.dir / ADAPTER_CONFIG
        copied: list[str] = []
        for d in tokenizer_dirs:
            keep = tokenizer_files(d)
            names = {p.name for p in Path(d).iterdir() if p.name not in keep}  # everything else is skipped
            copied += self.stage.copy_side_files(Path(d), names)
        # the written adapter must read back as what was meant
        check = AdapterWeights(self.dir / ADAPTER_WEIGHTS, source=str(self.out), revision=None)
        try:
            got = {n: (t.dtype, tuple(t.shape)) for n, t in check.tensors.items()}
        finally:
            check.close()
        if got != {k: (d, s) for k, d, s in entries}:
            raise RuntimeFailure(
                f"internal error: {self.dir / ADAPTER_WEIGHTS} does not read back as written"
            )
        for p in self.dir.glob(f"{SPOOL_PREFIX}*"):
            p.unlink()
        output = {
            "files": [
                {"name": ADAPTER_WEIGHTS, "size": size, "sha256": digest},
                {
                    "name": ADAPTER_CONFIG,
                    "size": config_file.stat().st_size,
                    "sha256": file_sha256(config_file),
                },
            ],
            "copied_files": sorted(set(copied)),
            "bytes": size,
        }
        for name, text in documents(output).items():
            self.stage.write_text(name, text)
        try:
            self.stage.finalize(overwrite=self.overwrite)
        except OSError as exc:
            raise RuntimeFailure(f"could not move {self.dir} to {self.out}: {exc.strerror or exc}") from None
        return output

    def discard(self) -> None:
        self.stage.discard()


def check_modules_to_save(modules_to_save: list[str], modules: set[str]) -> None:
    """PEFT wraps every module whose name *ends with* an entry: each entry must pick one; and it
    saves and loads a wrapped module with every module inside it: an entry must hold none."""
    for entry in modules_to_save:
        inner = sorted(m for m in modules if m.startswith(entry + "."))
        if inner:
            raise InputError(
                f"--format peft: module {entry!r} would be written whole (modules_to_save) for its own "
                f"tensors, but PEFT would then save and load everything inside it, {inner[0]!r} too; "
                "write a full checkpoint"
            )
        others = [m for m in modules if m != entry and m.endswith(entry)]
        if others:
            raise InputError(
                f"--format peft: module {entry!r} would be written whole (modules_to_save), but PEFT "
                f"would also wrap {others[0]!r} (its name ends the same way); write a full checkpoint"
            )
