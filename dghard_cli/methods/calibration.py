"""RECALL's calibration stage: run the models on typical samples, compare, weigh each layer.

Needs ``transformers`` (``pip install 'dghard[recall]'``). One model is in memory at a time:
each is loaded, run on the samples, reduced to its per-layer representations (CPU, float32)
and released before the next is loaded.

Calibration text: ``--calib FILE`` — a ``.jsonl`` file (one JSON string or ``{"text": ...}``
per line) or plain text (samples separated by blank lines); by default a short mixed-domain
text shipped in the package (``dghard_cli/data/calibration.txt``). Tokens: the checkpoint's
tokenizer (BASE's, else a fine-tune's); when no checkpoint ships a loadable tokenizer, the
UTF-8 bytes of the text modulo the vocabulary size (documented fallback, so generated test
models work).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from dghard_cli.errors import InputError
from dghard_cli.io import files
from dghard_cli.io.checkpoint import Checkpoint
from dghard_cli.io.output import list_side_files
from dghard_cli.methods import recall as R

MAX_CALIB_BYTES = 64 * 1024 * 1024
MAX_POOL = 256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclass(frozen=True)
class RecallOptions:
    """RECALL's choices (see :mod:`dghard_cli.methods.recall`)."""

    kernel: str = "linear-cka"
    pooling: str = "token"
    temperature: float = 0.05
    samples: int = 8
    select: str = "kmeans"
    max_tokens: int = 64

    def __post_init__(self) -> None:
        if self.kernel not in R.KERNELS:
            raise InputError(f"--recall-kernel {self.kernel!r} is not one of {', '.join(R.KERNELS)}")
        if self.pooling not in R.POOLINGS:
            raise InputError(f"--recall-pooling {self.pooling!r} is not one of {', '.join(R.POOLINGS)}")
        if self.select not in R.SELECTIONS:
            raise InputError(f"--recall-select {self.select!r} is not one of {', '.join(R.SELECTIONS)}")
        if not (isinstance(self.temperature, (int, float)) and 0 < self.temperature < float("inf")):
            raise InputError(f"--recall-temperature must be a number > 0, got {self.temperature}")
        if self.samples < 1:
            raise InputError(f"--recall-samples must be >= 1, got {self.samples}")
        if self.max_tokens < 2:
            raise InputError(f"--recall-max-tokens must be >= 2, got {self.max_tokens}")

    def describe(self) -> dict:
        return {
            "kernel": self.kernel,
            "pooling": self.pooling,
            "temperature": self.temperature,
            "samples": self.samples,
            "select": self.select,
            "max_tokens": self.max_tokens,
        }


@dataclass
class RecallWeights:
    """Per-layer merge weights over (BASE, FT_1 … FT_N), and how they were obtained."""

    num_layers: int
    groups: list[str]
    weights: dict[str, list[float]]  # group -> [α_base, α_ft1, …]
    similarity: dict[str, list[list[float]]]  # group -> M x M
    info: dict = field(default_factory=dict)

    def for_tensor(self, name: str) -> tuple[str, list[float]]:
        g = R.tensor_group(name, self.num_layers)
        return g, self.weights[g]

    def report(self) -> dict:
        return {
            **self.info,
            "layers": [
                {"group": g, "weights": self.weights[g], "similarity": self.similarity[g]}
                for g in self.groups
            ],
        }


# -- calibration text ---------------------------------------------------------------------


def default_calibration() -> tuple[str, str]:
    """(text, label) of the calibration text shipped in the package."""
    text = resources.files("dghard_cli").joinpath("data/calibration.txt").read_text(encoding="utf-8")
    return text, "built-in (dghard_cli/data/calibration.txt)"


def load_pool(calib: Path | None) -> tuple[list[str], dict]:
    """Candidate samples from ``--calib`` (or the default text) and a description of the source."""
    if calib is None:
        text, label = default_calibration()
        samples = _paragraphs(text)
        source = {"source": label}
    else:
        path = Path(calib).expanduser()
        if not os.path.lexists(path):
            raise InputError(f"--calib {calib}: no such file")
        with files.open_input(path, what="--calib file") as fh:  # a regular file, not a FIFO
            if fh.size > MAX_CALIB_BYTES:
                raise InputError(
                    f"--calib {calib}: larger than {MAX_CALIB_BYTES // 2**20} MiB; pass a few samples"
                )
            try:
                text = fh.read(MAX_CALIB_BYTES + 1).decode("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise InputError(f"--calib {calib}: cannot read as UTF-8 text ({exc})") from None
        samples = _jsonl(text, path) if path.suffix.lower() == ".jsonl" else _paragraphs(text)
        source = {"source": str(path), "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
    samples = [s for s in samples if s.strip()]
    if not samples:
        raise InputError(f"--calib {calib}: no non-empty samples")
    source["pool"] = min(len(samples), MAX_POOL)
    return samples[:MAX_POOL], source


def _paragraphs(text: str) -> list[str]:
    out, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line.strip())
        elif cur:
            out.append(" ".join(cur))
            cur = []
    if cur:
        out.append(" ".join(cur))
    return out


def _jsonl(text: str, path: Path) -> list[str]:
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"--calib {path}: line {no} is not JSON ({exc.msg})") from None
        if isinstance(doc, str):
            out.append(doc)
        elif isinstance(doc, dict) and isinstance(doc.get("text"), str):
            out.append(doc["text"])
        else:
            raise InputError(
                f"--calib {path}: line {no} is neither a JSON string nor an object with a 'text' string"
            )
    return out


# -- tokens -------------------------------------------------------------------------------


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise InputError(
            "--method recall runs the models and needs the transformers package; "
            "install it with: pip install 'dghard[recall]'"
        ) from None
    return transformers


class Tokens:
    """Text -> token ids: the checkpoint's tokenizer, or UTF-8 bytes modulo the vocabulary."""

    def __init__(self, dirs: list[Path], vocab_size: int, max_tokens: int) -> None:
        self.vocab = vocab_size
        self.max_tokens = max_tokens
        self.tokenizer = None
        self.describe = f"utf-8 bytes modulo the vocabulary size ({vocab_size}); no tokenizer found"
        transformers = _import_transformers()
        for d in dirs:
            if not any((d / f).exists() for f in TOKENIZER_FILES):
                continue
            try:
                tok = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
            except Exception as exc:  # a broken or unsupported tokenizer: use the next one
                self.describe = (
                    f"utf-8 bytes modulo the vocabulary size ({vocab_size}); the tokenizer in {d} "
                    f"did not load ({type(exc).__name__})"
                )
                continue
            self.tokenizer = tok
            self.describe = f"tokenizer of {d}"
            break

    def __call__(self, text: str) -> torch.Tensor:
        if self.tokenizer is not None:
            ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
            ids = [i for i in ids if 0 <= i < self.vocab]
        else:
            ids = [b % self.vocab for b in text.encode("utf-8")]
        ids = ids[: self.max_tokens]
        if len(ids) < 2:
            ids = (ids + [0, 0])[:2]
        return torch.tensor([ids], dtype=torch.long)


# -- running the models -------------------------------------------------------------------


def _load_model(path: Path, device: torch.device):
    transformers = _import_transformers()
    transformers.logging.set_verbosity_error()
    with contextlib.suppress(AttributeError):  # older transformers
        transformers.utils.logging.disable_progress_bar()
    major = int(transformers.__version__.split(".")[0])
    dtype_kw = "dtype" if major >= 5 else "torch_dtype"
    dtype = torch.float32 if device.type == "cpu" else "auto"
    if not (path / "config.json").exists():
        raise InputError(f"{path}: RECALL runs the model and needs its config.json next to the weights")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), local_files_only=True, **{dtype_kw: dtype}
        )
    except InputError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"{path}: transformers could not load this checkpoint as a causal LM for RECALL "
            f"({type(exc).__name__}: {first})"
        ) from None
    model.to(device)
    model.eval()
    return model


def _release(model, device: torch.device) -> None:
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _hidden(model, ids: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=ids.to(device), output_hidden_states=True, use_cache=False)
    return [h[0].float().cpu() for h in out.hidden_states]  # each: tokens x hidden


def _features(model, samples: list[torch.Tensor], device: torch.device, pooling: str) -> list[np.ndarray]:
    """Per group (embedding output, then each layer's output): rows x hidden, float32."""
    per_group: list[list[torch.Tensor]] | None = None
    for ids in samples:
        hs = _hidden(model, ids, device)
        if per_group is None:
            per_group = [[] for _ in hs]
        if len(hs) != len(per_group):
            raise InputError("models return different numbers of hidden states")
        for g, h in enumerate(hs):
            per_group[g].append(h.mean(dim=0, keepdim=True) if pooling == "mean" else h)
    assert per_group is not None
    return [torch.cat(rows, dim=0).numpy() for rows in per_group]


def recall_weights(
    base: Checkpoint,
    fts: list[Checkpoint],
    opts: RecallOptions,
    calib: Path | None,
    device: torch.device,
) -> RecallWeights:
    """Run BASE and the fine-tunes (one at a time) and compute the per-layer weights."""
    _import_transformers()
    for ck in (base, *fts):  # transformers reads these itself: check them as every input is
        list_side_files(ck.path, set(ck.shards), ck.roots)
    pool, source = load_pool(calib)
    vocab = _vocab_size([base, *fts])
    tokens = Tokens([base.path, *[f.path for f in fts]], vocab, opts.max_tokens)
    encoded = [tokens(s) for s in pool]

    # the newest (last listed) fine-tune first: it selects the typical samples; BASE last
    order = [len(fts), *range(1, len(fts)), 0]
    paths = [base.path, *[f.path for f in fts]]
    features: dict[int, list[np.ndarray]] = {}
    selected: list[int] = []
    for m in order:
        model = _load_model(paths[m], device)
        try:
            if not selected:
                if opts.select == "kmeans" and len(encoded) > opts.samples:
                    pooled = np.stack(
                        [_hidden(model, ids, device)[-1].mean(dim=0).numpy() for ids in encoded]
                    )
                    selected = R.select_typical(pooled, opts.samples)
                else:
                    selected = list(range(min(opts.samples, len(encoded))))
            features[m] = _features(model, [encoded[i] for i in selected], device, opts.pooling)
        finally:
            _release(model, device)

    n_groups = len(features[0])
    if any(len(f) != n_groups for f in features.values()):
        raise InputError("BASE and the fine-tunes have different numbers of layers")
    num_layers = n_groups - 1
    groups = ["embed", *[f"layer.{i}" for i in range(num_layers)]]
    refs = list(range(1, len(fts) + 1))
    weights: dict[str, list[float]] = {}
    sims: dict[str, list[list[float]]] = {}
    for g, name in enumerate(groups):
        sim = R.similarity_matrix(opts.kernel, [features[m][g] for m in range(len(paths))])
        alpha = R.model_weights(sim, opts.temperature, refs)
        weights[name] = [float(a) for a in alpha]
        sims[name] = [[float(v) for v in row] for row in sim]
    info = {
        **opts.describe(),
        "calibration": source,
        "selected_samples": selected,
        "rows_per_model": int(features[0][0].shape[0]),
        "tokens": tokens.describe,
        "models": ["base", *[f"ft{i}" for i in range(1, len(fts) + 1)]],
        "selection_model": f"ft{len(fts)}",
    }
    return RecallWeights(num_layers=num_layers, groups=groups, weights=weights, similarity=sims, info=info)


def _vocab_size(cks: list[Checkpoint]) -> int:
    sizes = []
    for ck in cks:
        cfg = ck.config() or {}
        v = cfg.get("vocab_size")
        if v is None and isinstance(cfg.get("text_config"), dict):
            v = cfg["text_config"].get("vocab_size")
        if isinstance(v, int) and v > 0:
            sizes.append(v)
    if not sizes:
        raise InputError(f"{cks[0].path}: config.json has no vocab_size; RECALL cannot run the model")
    return min(sizes)
