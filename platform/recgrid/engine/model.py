"""The model: DLRM (dot interaction) and DLRM-DCNv2 (low-rank cross net) from TorchRec's
modules, built from a dataset spec — one embedding table per categorical feature C1..C26, or,
with QR compression, a quotient, a remainder and a head table for each large one
(`engine.compression`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from recgrid.data.specs import NUM_DENSE, SPARSE_NAMES, Compression, DatasetSpec
from recgrid.engine.compression import qr_sparse_arch, qr_table_configs

if TYPE_CHECKING:  # torch and torchrec are heavy; config validation imports ARCHS from here
    import torch
    from torchrec import EmbeddingBagConfig
    from torchrec.models.dlrm import DLRMTrain

# The architectures a job can name (config.py's model.arch takes its choices from here).
ARCHS: tuple[str, ...] = ("dlrm", "dcn")
# The embedding tables' data types (config.py's model.embedding_dtype), as TorchRec's table
# `DataType` names them; the fused kernel stores the weights in it (its optimizer states stay
# float32, pooled outputs are float32). fp16 is for CUDA: CPU workers keep fp32 tables.
EMBEDDING_DTYPES: tuple[str, ...] = ("fp32", "fp16")
GPU_EMBEDDING_DTYPES: tuple[str, ...] = ("fp16",)

@dataclass(frozen=True)
class ModelSpec:
    """Architecture of the dense part. `dense_arch[-1]` must equal the embedding dimension."""

    arch: str = "dlrm"
    embedding_dim: int | None = None  # None: the dataset spec's default
    dense_arch: tuple[int, ...] | None = None  # None: default_dense_arch(the embedding dimension)
    over_arch: tuple[int, ...] = (64, 32, 1)
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 16
    embedding_dtype: str = "fp32"  # the tables' data type, one of EMBEDDING_DTYPES
    compression: Compression | None = None  # QR compression of the large tables (engine.compression); None: off

    def resolved_dim(self, spec: DatasetSpec) -> int:
        return self.embedding_dim or spec.embedding_dim

    def resolved_dense_arch(self, spec: DatasetSpec) -> tuple[int, ...]:
        """dense_arch, or the default for the embedding dimension; one that does not end in the
        embedding dimension (DLRM's interaction needs it) is refused, never rewritten."""
        dim = self.resolved_dim(spec)
        if self.dense_arch is None:
            return default_dense_arch(dim)
        if not self.dense_arch or self.dense_arch[-1] != dim:
            raise ValueError(f"dense_arch {list(self.dense_arch)} must end in the embedding dimension {dim}")
        return tuple(self.dense_arch)


def default_dense_arch(embedding_dim: int) -> tuple[int, ...]:
    """The bottom MLP when none is given: 64 units, then the embedding dimension."""
    return (64, embedding_dim)


def embedding_tables(spec: DatasetSpec, embedding_dim: int, dtype: str = "fp32") -> list["EmbeddingBagConfig"]:
    """One sum-pooled table per categorical feature, named t_<feature>, sized by the (capped) spec,
    its weights stored in `dtype` (one of EMBEDDING_DTYPES)."""
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.embedding_configs import DataType, PoolingType

    if dtype not in EMBEDDING_DTYPES:
        raise ValueError(f"embedding dtype must be one of {EMBEDDING_DTYPES}, got {dtype!r}")
    return [
        EmbeddingBagConfig(
            name=spec.table_name(feature),
            embedding_dim=embedding_dim,
            num_embeddings=rows,
            feature_names=[feature],
            pooling=PoolingType.SUM,
            data_type=DataType[dtype.upper()],
        )
        for feature, rows in zip(SPARSE_NAMES, spec.table_rows)
    ]


def build_model(spec: DatasetSpec, model: ModelSpec = ModelSpec(), seed: int = 0,
                dense_device: "torch.device | None" = None, tables_device: "torch.device | None" = None) -> "DLRMTrain":
    """An unsharded DLRMTrain whose tables live on the meta device (sharding materialises them), or
    on `tables_device`, allocated there (an unsharded model to load a checkpoint into: `launch.unshard`).

    The dense part is initialised from `seed`, so every worker starts with the same dense weights.
    With `model.compression` the large tables are QR-compressed (`engine.compression`): the sparse
    arch combines their parts and still hands the interaction one embedding per C1..C26.
    """
    import torch
    from torchrec import EmbeddingBagCollection
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain

    dense_device = dense_device or torch.device("cpu")
    tables_device = tables_device or torch.device("meta")
    if model.arch not in ARCHS:
        raise ValueError(f"model.arch must be one of {ARCHS}, got {model.arch!r}")
    dim = model.resolved_dim(spec)
    # a compressed model is built with the plain tables first, so its dense part starts as the
    # uncompressed model's; its sparse arch is then replaced (engine.compression)
    plain = tables_device if model.compression is None else torch.device("meta")  # replaced below if compressed
    ebc = EmbeddingBagCollection(tables=embedding_tables(spec, dim, model.embedding_dtype), device=plain)
    torch.manual_seed(seed)
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=list(model.resolved_dense_arch(spec)),
        over_arch_layer_sizes=list(model.over_arch),
        dense_device=dense_device,
    )
    if model.arch == "dlrm":
        net = DLRM(**common)
    else:
        net = DLRM_DCN(**common, dcn_num_layers=model.dcn_num_layers, dcn_low_rank_dim=model.dcn_low_rank_dim)
    if model.compression is not None:
        from torchrec.modules.embedding_configs import DataType

        tables = qr_table_configs(spec, dim, DataType[model.embedding_dtype.upper()], model.compression)
        net.sparse_arch = qr_sparse_arch(EmbeddingBagCollection(tables=tables, device=tables_device),
                                         spec, dim, model.compression)
    return DLRMTrain(net)
