"""recgrid: two-dimensional sparse-parallel DLRM training on TorchRec, orchestrated by Ray."""

__version__ = "0.1.0"
