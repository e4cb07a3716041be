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

`model_record` is what the model was built from (dataset spec, architecture, compression with its
head ids: plain JSON values, the model's `info`), and `from_record` builds the model again from it
alone, without the job's config: how `recgrid eval` and `recgrid export` read a logged model's
weights (`launch.model`). `evaluate_files` runs a model over data files (every row, in order) and
gives NE, AUC and the rows, as the job's evaluation computes them (`train.metrics`), and each
row's click probability when asked.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Sequence

from recgrid.config import JobConfig
from recgrid.data.specs import (HEAD, NUM_DENSE, QUOTIENT, REMAINDER, SPARSE_NAMES, Compression, DatasetSpec,
                                table_layout)
from recgrid.data.stream import memory_batches
from recgrid.engine.model import ModelSpec, build_model
from recgrid.engine.unsharded import QRIds, UnshardedDLRM, UnshardedSparseArch
from recgrid.train.checkpoint import checkpoint_step, compression_record, is_complete, read_checkpoint
from recgrid.train.metrics import EvalMetrics, reduce_metrics
from recgrid.trainer_config import EngineConfig

EVAL_BATCH_ROWS = 8192  # rows per forward of `evaluate_files`
RECORD_FORMAT = 1  # the layout of `model_record`; a record of another is refused


def checkpoint_compression(path: str, config: "JobConfig") -> Any:
    """The job's QR compression with the head ids the checkpoint at `path` recorded (None: the job
    has none). A compressed job's checkpoint without a record is refused, naming it."""
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
    engine = EngineConfig.from_job(config).with_compression(compression)
    return unsharded_model(engine.spec, engine.model, info, seed=config.train.seed)


def unsharded_model(spec: "DatasetSpec", model: "ModelSpec", info: dict[str, Any], seed: int = 0) -> "UnshardedDLRM":
    """The model of dataset spec `spec` and architecture `model` (its compression with the head ids
    included), unsharded on the CPU with its tables allocated; its `info` is `model_record` plus `info`."""
    import torch

    compression = model.compression
    train = build_model(spec, model, seed=seed, tables_device=torch.device("cpu"))
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
    return UnshardedDLRM(net, SPARSE_NAMES, NUM_DENSE, {**model_record(spec, model), **info})


def model_record(spec: "DatasetSpec", model: "ModelSpec") -> dict[str, Any]:
    """What the model of `spec` and `model` is built from, as JSON values: the dataset spec, the
    architecture (sizes resolved), the compression record (`Compression.record`, head ids included)."""
    record = model.compression.record() if model.compression is not None else None
    return {"format": RECORD_FORMAT, "spec": dataclasses.asdict(spec), "arch": model.arch,
            "embedding_dim": model.resolved_dim(spec), "compression": record,
            "model": {"arch": model.arch, "embedding_dim": model.resolved_dim(spec),
                      "dense_arch": list(model.resolved_dense_arch(spec)), "over_arch": list(model.over_arch),
                      "dcn_num_layers": model.dcn_num_layers, "dcn_low_rank_dim": model.dcn_low_rank_dim,
                      "embedding_dtype": model.embedding_dtype}}


def record_architecture(record: dict[str, Any]) -> tuple["DatasetSpec", "ModelSpec"]:
    """The dataset spec and architecture (compression included) a `model_record` names; ValueError
    (or TypeError) for a record that is not one."""
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise ValueError(f"not a recgrid model record of format {RECORD_FORMAT}")
    spec = model_spec(record)
    m = dict(record["model"])
    compression, c = None, record.get("compression")
    if c is not None:
        heads = {SPARSE_NAMES.index(name): ids for name, ids in dict(c["head_ids"]).items()}
        compression = Compression(int(c["threshold_rows"]), int(c["collisions"]), str(c["operation"]),
                                  head_rows=max((len(ids) for ids in heads.values()), default=0))
        if heads:
            compression = compression.with_heads(heads)
    model = ModelSpec(**{**m, "dense_arch": tuple(m["dense_arch"]), "over_arch": tuple(m["over_arch"]),
                         "compression": compression})
    model.resolved_dense_arch(spec)  # refuses sizes DLRM cannot take
    return spec, model


def table_shapes(record: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The shape of every embedding table of the model a record names, by table name, computed without
    building the model (`data.specs.table_layout`)."""
    spec, model = record_architecture(record)
    c = model.compression
    layout = table_layout(spec, model.resolved_dim(spec), c, c.head_sizes() if c is not None else None)
    return {table: (rows, dim) for table, _, rows, dim in layout}


def from_record(record: dict[str, Any]) -> "UnshardedDLRM":
    """The model a `model_record` names, rebuilt (tables allocated; load its weights into it)."""
    spec, model = record_architecture(record)
    return unsharded_model(spec, model, {k: v for k, v in record.items() if k not in model_record(spec, model)})


def model_spec(model: Any) -> Any:
    """The dataset spec `model` (an `UnshardedDLRM`, or its record) was trained on (its ids are rows of
    these tables)."""
    d = dict((model if isinstance(model, dict) else model.info)["spec"])
    return DatasetSpec(**{**d, "rows": tuple(d["rows"]),
                          "multi_hot_sizes": tuple(d["multi_hot_sizes"]) if d.get("multi_hot_sizes") else None})


def from_checkpoint(path: str, config: "JobConfig", info: dict[str, Any] | None = None,
                    say: Callable[[str], None] | None = None) -> "UnshardedDLRM":
    """The model copy of the storage checkpoint at `path`, written by a job of `config` (any T, M,
    L: the tables are read whole), as an `UnshardedDLRM` in this process."""
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


def evaluate_files(model: Any, patterns: str | Sequence[str], spec: Any, batch_rows: int = EVAL_BATCH_ROWS,
                   probabilities: list | None = None) -> dict[str, float]:
    """NE, AUC and rows of `model` (an `UnshardedDLRM`) over every row of the files `patterns` name,
    read with dataset spec `spec`: `{"ne", "auc", "rows"}`. With `probabilities` (a list), each
    batch's click probabilities are appended to it (float32 arrays, the files' rows in order)."""
    import torch

    evaluation = EvalMetrics()
    model.eval()
    with torch.no_grad():
        for batch in memory_batches(patterns, batch_rows, spec, drop_last=False):
            p = torch.sigmoid(model(batch.dense_features, batch.sparse_features).float())
            evaluation.update(p, batch.labels)
            if probabilities is not None:
                probabilities.append(p.numpy())
    out = reduce_metrics(None, evaluation=evaluation)
    return {"ne": out["eval/ne"], "auc": out.get("eval/auc", float("nan")), "rows": int(out["eval/examples"])}
