"""One model copy out of a storage checkpoint, as an ordinary module (`engine.unsharded.UnshardedDLRM`),
and its evaluation on files in one process.

A storage checkpoint holds one whole model copy, its tables sharded over the writing group's
workers (`train.checkpoint`). `from_checkpoint` builds the job's model unsharded on the CPU and
reads the checkpoint's model entries into it with `torch.distributed.checkpoint` in this one
process (DCP reads each table whole from the shards that overlap it; no process group), through
the checkpoint module's data-only reader. What it needs: the job's config (dataset spec,
architecture, compression settings) and, for a QR-compressed model, the head ids the checkpoint
records (`Trainer.state_dict()["compression"]`). The whole model is in this process's memory
once (its tables at their data type, fp32 for fp32 tables): a model larger than the memory
of the machine that exports it does not fit; nothing is gathered on the workers.

`evaluate_files` runs it over data files (every row, in order) and gives NE, AUC and the rows,
as the job's evaluation computes them (`train.metrics`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from recgrid.config import JobConfig
    from recgrid.engine.unsharded import UnshardedDLRM

EVAL_BATCH_ROWS = 8192  # rows per forward of `evaluate_files`


def checkpoint_compression(path: str, config: "JobConfig") -> Any:
    """The job's QR compression with the head ids the checkpoint at `path` recorded (None: the job
    has none). A compressed job's checkpoint without a record is refused, naming it."""
    from recgrid.data.specs import SPARSE_NAMES
    from recgrid.train.checkpoint import compression_record

    compression = config.compression()
    if compression is None:
        return None
    recorded = compression_record(path)
    if recorded is None:
        raise ValueError(f"{path}: the job compresses its tables (model.compression) but this checkpoint records no "
                         f"compression: it was written by another job")
    record = json.loads(recorded)
    if (record["threshold_rows"], record["collisions"], record["operation"]) != (
            compression.threshold_rows, compression.collisions, compression.operation):
        raise ValueError(f"{path}: written with QR compression {record['threshold_rows']}/{record['collisions']}/"
                         f"{record['operation']}, not this config's {compression.threshold_rows}/"
                         f"{compression.collisions}/{compression.operation}")
    if compression.wants_head:
        heads = {SPARSE_NAMES.index(name): ids for name, ids in record["head_ids"].items()}
        compression = compression.with_heads(heads)
    return compression


def build_unsharded(config: "JobConfig", compression: Any, info: dict[str, Any]) -> "UnshardedDLRM":
    """The job's model, unsharded on the CPU with its tables allocated (weights as built: load
    a checkpoint into it), as an `UnshardedDLRM`."""
    import torch

    from recgrid.data.specs import HEAD, NUM_DENSE, QUOTIENT, REMAINDER, SPARSE_NAMES
    from recgrid.engine.model import build_model
    from recgrid.engine.unsharded import QRIds, UnshardedDLRM, UnshardedSparseArch
    from recgrid.train.trainer import EngineConfig

    engine = EngineConfig.from_job(config).with_compression(compression)
    spec, model = engine.spec, engine.model
    train = build_model(spec, model, seed=config.train.seed, tables_device=torch.device("cpu"))
    net = train.model
    ebc = net.sparse_arch.embedding_bag_collection
    dim = model.resolved_dim(spec)
    ids = None
    if compression is None:
        parts: list[tuple[str | None, ...]] = [(name,) for name in SPARSE_NAMES]
        operation = "add"
    else:
        parts, operation = list(net.sparse_arch.parts), compression.operation
        heads = {SPARSE_NAMES[f]: torch.from_numpy(h) for f, h in compression.heads().items()}
        compressed = {SPARSE_NAMES[f]: (SPARSE_NAMES[f] + HEAD if SPARSE_NAMES[f] in heads else None,
                                        SPARSE_NAMES[f] + QUOTIENT, SPARSE_NAMES[f] + REMAINDER)
                      for f in compression.features(spec)}
        ids = QRIds(SPARSE_NAMES, compressed, heads, compression.collisions)
    net.sparse_arch = UnshardedSparseArch(ebc, parts, operation, dim, ids)
    record = compression.record() if compression is not None else None
    return UnshardedDLRM(net, SPARSE_NAMES, NUM_DENSE, {
        "spec": dataclasses.asdict(spec), "arch": model.arch, "embedding_dim": dim, "compression": record, **info})


def model_spec(model: Any) -> Any:
    """The dataset spec `model` (an `UnshardedDLRM`) was trained on (its ids are rows of these tables)."""
    from recgrid.data.specs import DatasetSpec

    d = dict(model.info["spec"])
    return DatasetSpec(**{**d, "rows": tuple(d["rows"]),
                          "multi_hot_sizes": tuple(d["multi_hot_sizes"]) if d.get("multi_hot_sizes") else None})


def from_checkpoint(path: str, config: "JobConfig", info: dict[str, Any] | None = None,
                    say: Callable[[str], None] | None = None) -> "UnshardedDLRM":
    """The model copy of the storage checkpoint at `path`, written by a job of `config` (any T, M,
    L: the tables are read whole), as an `UnshardedDLRM` in this process."""
    from recgrid.train.checkpoint import checkpoint_step, is_complete, read_checkpoint

    if not is_complete(path):
        raise FileNotFoundError(f"{path}: not a complete recgrid checkpoint (no .metadata)")
    t0 = time.perf_counter()
    compression = checkpoint_compression(path, config)
    model = build_unsharded(config, compression, {"checkpoint": path, "step": checkpoint_step(path), **(info or {})})
    # the training module's names: DLRMTrain's "model." prefix, the id mapping's buffers left out (not trained)
    state = {f"model.{k}": v for k, v in model.model.state_dict().items() if ".ids." not in f".{k}"}
    read_checkpoint(path, {"model": state})
    if say is not None:
        n = sum(v.numel() * v.element_size() for v in state.values())
        say(f"unsharded the checkpoint {path}: {n / 2**20:,.1f} MiB of weights in {time.perf_counter() - t0:.1f} s")
    return model


def evaluate_files(model: Any, patterns: str | Sequence[str], spec: Any, batch_rows: int = EVAL_BATCH_ROWS) -> dict[str, float]:
    """NE, AUC and rows of `model` (an `UnshardedDLRM`) over every row of the files `patterns` name,
    read with dataset spec `spec`: `{"ne", "auc", "rows"}`."""
    import torch

    from recgrid.data.stream import memory_batches
    from recgrid.train.metrics import EvalMetrics, reduce_metrics

    evaluation = EvalMetrics()
    model.eval()
    with torch.no_grad():
        for batch in memory_batches(patterns, batch_rows, spec, drop_last=False):
            evaluation.update(torch.sigmoid(model(batch.dense_features, batch.sparse_features).float()), batch.labels)
    out = reduce_metrics(None, evaluation=evaluation)
    return {"ne": out["eval/ne"], "auc": out.get("eval/auc", float("nan")), "rows": int(out["eval/examples"])}
