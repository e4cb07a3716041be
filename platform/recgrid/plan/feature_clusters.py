"""Tower feature clustering for Disaggregated Multi-Tower: which features share a tower (not a
TorchRec partitioner; `recgrid towers` calls it).

From pooled embeddings of a trained model (one [F, D] block per sample), the paper's recipe:
1. the interaction matrix I(i, j) = mean over samples of |cos(e_i, e_j)|;
2. a distance: "coherent" D = 1 - I puts strongly interacting features in one tower (their
   interaction is then computed before the cross-host step, by the tower module); "diverse"
   D = I spreads them over the towers;
3. coordinates X in a few dimensions fitted to the distances by an optimizer (stress, Adam,
   from a classical-MDS start);
4. constrained k-means: N towers whose sizes are all within [lo, hi] with hi <= balance * lo,
   each assignment step an exact min-cost assignment of features to tower slots.
Also the paper's naive baseline (strided: feature f to tower f % N) and the two scores the
planted-group test reports (purity, adjusted Rand index).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

STRATEGIES: tuple[str, ...] = ("coherent", "diverse")


def interaction_matrix(pooled: np.ndarray) -> np.ndarray:
    """I(i, j) = mean over samples of |cos(e_i, e_j)|, from pooled embeddings [n, F, D]."""
    e = np.asarray(pooled, dtype=np.float64)
    e = e / np.maximum(np.linalg.norm(e, axis=2, keepdims=True), 1e-12)
    out = np.zeros((e.shape[1], e.shape[1]))
    for start in range(0, len(e), 4096):  # bounded memory: [chunk, F, F] at a time
        out += np.abs(np.einsum("nfd,ngd->nfg", e[start:start + 4096], e[start:start + 4096])).sum(0)
    return out / max(1, len(e))


def distances(interaction: np.ndarray, strategy: str = "coherent") -> np.ndarray:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    d = 1.0 - interaction if strategy == "coherent" else interaction.copy()
    d = (d + d.T) / 2
    np.fill_diagonal(d, 0.0)
    return np.clip(d, 0.0, None)


def fit_coordinates(dist: np.ndarray, dims: int = 8, steps: int = 800, seed: int = 0) -> np.ndarray:
    """Coordinates [F, dims] whose pairwise distances fit `dist`: classical MDS as the start, then
    Adam on the stress Σ_{i<j} (|x_i - x_j| - d_ij)²."""
    import torch

    n = len(dist)
    dims = max(1, min(dims, n - 1))
    j = np.eye(n) - 1.0 / n
    b = -0.5 * j @ (dist ** 2) @ j
    vals, vecs = np.linalg.eigh(b)
    top = np.argsort(vals)[::-1][:dims]
    start = vecs[:, top] * np.sqrt(np.clip(vals[top], 1e-9, None))
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(start, dtype=torch.float64) + 1e-3 * torch.randn(n, dims, generator=g, dtype=torch.float64)
    x.requires_grad_(True)
    target = torch.tensor(dist, dtype=torch.float64)
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    opt = torch.optim.Adam([x], lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        diff = x.unsqueeze(0) - x.unsqueeze(1)
        d = torch.sqrt((diff * diff).sum(-1) + 1e-12)
        loss = ((d - target)[upper] ** 2).sum()
        loss.backward()
        opt.step()
    return x.detach().numpy()


def size_bounds(n: int, k: int, balance: float) -> tuple[int, int]:
    """Tower sizes [lo, hi]: lo the most even floor, hi <= balance * lo (and room for all n)."""
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= towers <= features, got {k} towers for {n} features")
    if balance < 1:
        raise ValueError(f"balance must be >= 1 (largest <= balance x smallest), got {balance}")
    lo = n // k
    hi = max(math.ceil(n / k), int(math.floor(balance * lo)))
    return lo, min(hi, n - (k - 1) * lo)


def balanced_kmeans(x: np.ndarray, k: int, balance: float = 1.5, seed: int = 0, restarts: int = 8,
                    iterations: int = 50) -> np.ndarray:
    """k-means whose clusters all have between `size_bounds` lo and hi members: each assignment
    step is an exact min-cost assignment of points to lo required and hi - lo optional slots per
    cluster (dummy points fill the unused optional slots). Best of `restarts` k-means++ starts."""
    from scipy.optimize import linear_sum_assignment

    n = len(x)
    lo, hi = size_bounds(n, k, balance)
    dummies = k * hi - n
    big = 1e12
    rng = np.random.default_rng(seed)
    best, best_cost = None, math.inf
    for _ in range(restarts):
        centers = _kmeans_pp(x, k, rng)
        labels = None
        for _ in range(iterations):
            d2 = ((x[:, None, :] - centers[None, :, :]) ** 2).sum(-1)  # [n, k]
            # slot columns: cluster c's lo required slots, then its hi - lo optional ones
            cost = np.repeat(d2, hi, axis=1)
            required = np.tile(np.arange(hi) < lo, k)
            dummy = np.where(required, big, 0.0)[None, :].repeat(dummies, axis=0)
            rows, cols = linear_sum_assignment(np.vstack([cost, dummy]))
            new = (cols[rows < n] // hi)[np.argsort(rows[rows < n])]
            if labels is not None and np.array_equal(new, labels):
                break
            labels = new
            centers = np.stack([x[labels == c].mean(0) for c in range(k)])
        total = float(((x - centers[labels]) ** 2).sum())
        if total < best_cost:
            best, best_cost = labels, total
    return _canonical(best)


def _kmeans_pp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    centers = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        d2 = np.min([((x - c) ** 2).sum(1) for c in centers], axis=0)
        p = d2 / d2.sum() if d2.sum() > 0 else np.full(len(x), 1 / len(x))
        centers.append(x[rng.choice(len(x), p=p)])
    return np.stack(centers)


def _canonical(labels: np.ndarray) -> np.ndarray:
    """Relabel clusters in order of their first member (tower 0 holds feature 0)."""
    order = {c: i for i, c in enumerate(dict.fromkeys(labels.tolist()))}
    return np.array([order[c] for c in labels.tolist()])


def strided_labels(n: int, k: int) -> np.ndarray:
    """The paper's naive assignment: feature f in tower f % k."""
    return np.arange(n) % k


def labels_from_groups(groups: Sequence[Sequence[int]], n: int) -> np.ndarray:
    out = np.full(n, -1)
    for g, members in enumerate(groups):
        out[list(members)] = g
    return out


def purity(labels: np.ndarray, truth: np.ndarray) -> float:
    """Share of features whose tower's most common true group is their own."""
    total = 0
    for c in np.unique(labels):
        total += np.bincount(truth[labels == c]).max()
    return total / len(labels)


def adjusted_rand_index(labels: np.ndarray, truth: np.ndarray) -> float:
    """Hubert and Arabie's adjusted Rand index (1: identical partitions, ~0: chance)."""
    def comb2(v):
        return v * (v - 1) / 2.0

    table = np.zeros((labels.max() + 1, truth.max() + 1))
    np.add.at(table, (labels, truth), 1)
    index = comb2(table).sum()
    a, b = comb2(table.sum(1)).sum(), comb2(table.sum(0)).sum()
    expected = a * b / comb2(len(labels))
    top = (a + b) / 2
    return float((index - expected) / (top - expected)) if top != expected else 1.0


@dataclass(frozen=True)
class Partition:
    """A partitioner's answer: tower of each feature, and what it was computed from."""

    labels: np.ndarray  # [F] tower per feature
    interaction: np.ndarray  # [F, F]
    coordinates: np.ndarray  # [F, dims]
    strategy: str
    balance: float

    def towers(self, names: Sequence[str]) -> list[list[str]]:
        return [[names[f] for f in np.flatnonzero(self.labels == t)] for t in range(int(self.labels.max()) + 1)]

    def sizes(self) -> list[int]:
        return np.bincount(self.labels).tolist()


def partition_features(pooled: np.ndarray, towers: int, strategy: str = "coherent", dims: int = 8,
                       balance: float = 1.5, seed: int = 0) -> Partition:
    """The whole recipe, from pooled embeddings [n, F, D] to N balanced towers."""
    interaction = interaction_matrix(pooled)
    coords = fit_coordinates(distances(interaction, strategy), dims=dims, seed=seed)
    labels = balanced_kmeans(coords, towers, balance=balance, seed=seed)
    return Partition(labels, interaction, coords, strategy, balance)
