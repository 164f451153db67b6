"""Exact cross-modal retrieval metrics (R@K, mean and median rank), computed in chunks.

The rank of a query is the 0-based position of its best true match in the candidates sorted by
score (dot product of the embeddings; cosine for normalised ones):

    rank(i) = #{k not a match of i : s[i, k] > m}  +  #{k not a match of i : s[i, k] == m, k < j}

where m is the highest score among i's true matches and j the smallest index of a true match
scoring m. Ties are therefore broken by candidate index (a lower index ranks first), so a result
never depends on the sort algorithm, the chunk size or the number of ranks; and other true
matches (several captions of one image) never count against a query. Recall@K is the fraction
of queries with rank < K; `mean_rank` and `median_rank` are 1-based (numpy's median: the mean of
the two middle values for an even count).

Matches are given by ids: candidate k is a true match of query i when
`query_ids[i] == candidate_ids[k]`. The default (both `arange(N)`) is one-to-one pairs; several
captions per image use the image's index as the captions' id; zero-shot classification uses the
labels as query ids and `arange(classes)` as candidate ids.

Memory: queries are processed in chunks of rows so that a chunk's score block holds at most
`chunk_elements` values; nothing of size queries x candidates is ever built. Under
`torch.distributed` each rank scores its own contiguous share of the queries against all
candidates and the per-query ranks are gathered, so every rank works and every rank returns the
same metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmtrain import distributed

DEFAULT_KS = (1, 5, 10)
# Values in one chunk's score block: 2^24 floats = 64 MiB, plus a few boolean masks.
DEFAULT_CHUNK_ELEMENTS = 1 << 24

__all__ = [
    "DEFAULT_KS",
    "DEFAULT_CHUNK_ELEMENTS",
    "check_finite",
    "query_share",
    "retrieval_ranks",
    "distributed_ranks",
    "rank_metrics",
    "retrieval_metrics",
]


def check_finite(features: torch.Tensor, name: str) -> None:
    """Raise ValueError when `features` hold NaN or inf: every comparison with NaN is false, so
    a NaN query would silently rank first."""
    if not bool(torch.isfinite(features).all()):
        raise ValueError(
            f"embeddings of {name!r} contain NaN or inf; the model diverged or its weights are "
            "damaged, so retrieval metrics would be meaningless"
        )


def _ids(ids: torch.Tensor | None, n: int, device: torch.device, what: str) -> torch.Tensor:
    if ids is None:
        return torch.arange(n, device=device)
    ids = torch.as_tensor(ids, device=device).long()
    if ids.shape != (n,):
        raise ValueError(f"{what} must have shape [{n}], got {list(ids.shape)}")
    return ids


def retrieval_ranks(
    queries: torch.Tensor,
    candidates: torch.Tensor,
    query_ids: torch.Tensor | None = None,
    candidate_ids: torch.Tensor | None = None,
    *,
    start: int = 0,
    stop: int | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """0-based rank (module docstring) of queries[start:stop], int64 [stop - start].

    queries [Nq, D] and candidates [Nc, D] on one device; ids as in the module docstring
    (default: query i matches candidate i, which needs Nq == Nc). Raises ValueError when a query
    has no true match among the candidates.
    """
    if queries.dim() != 2 or candidates.dim() != 2 or queries.shape[1] != candidates.shape[1]:
        raise ValueError(
            f"queries {list(queries.shape)} and candidates {list(candidates.shape)} must be "
            "[N, D] with the same D"
        )
    n_queries, n_candidates = queries.shape[0], candidates.shape[0]
    if query_ids is None and candidate_ids is None and n_queries != n_candidates:
        raise ValueError(
            f"{n_queries} queries and {n_candidates} candidates: give query_ids and "
            "candidate_ids to say which candidates match which query"
        )
    stop = n_queries if stop is None else stop
    if not 0 <= start <= stop <= n_queries:
        raise ValueError(f"query range [{start}, {stop}) is not within [0, {n_queries})")
    device = queries.device
    qids = _ids(query_ids, n_queries, device, "query_ids")
    cids = _ids(candidate_ids, n_candidates, device, "candidate_ids")
    index = torch.arange(n_candidates, device=device)
    rows = max(1, chunk_elements // max(1, n_candidates))
    candidates_t = candidates.t()
    out = []
    for lo in range(start, stop, rows):
        hi = min(lo + rows, stop)
        scores = queries[lo:hi] @ candidates_t  # [rows, Nc]: the only large block
        out.append(_chunk_ranks(scores, qids[lo:hi], cids, index, lo))
    if not out:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(out)


def _chunk_ranks(
    scores: torch.Tensor,
    qids: torch.Tensor,
    cids: torch.Tensor,
    index: torch.Tensor,
    first_query: int,
) -> torch.Tensor:
    """Ranks for one block of query rows (see the module docstring for the rule)."""
    match = qids[:, None] == cids[None, :]
    has_match = match.any(dim=1)
    if not bool(has_match.all()):
        missing = first_query + int(torch.nonzero(~has_match)[0])
        raise ValueError(f"query {missing} has no true match among the candidates")
    best = scores.masked_fill(~match, float("-inf")).amax(dim=1, keepdim=True)
    # The first true match scoring `best`: its index decides the ties with other candidates.
    at_best = match & (scores == best)
    first = torch.where(at_best, index, index.numel()).amin(dim=1, keepdim=True)
    others = ~match
    above = (scores > best) & others
    tied_before = (scores == best) & others & (index < first)
    return (above | tied_before).sum(dim=1)


def query_share(n_queries: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of the queries rank `rank` scores: contiguous, sizes differing by at most 1."""
    base, extra = divmod(n_queries, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def distributed_ranks(
    queries: torch.Tensor,
    candidates: torch.Tensor,
    query_ids: torch.Tensor | None = None,
    candidate_ids: torch.Tensor | None = None,
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Ranks of all queries, int64 [Nq], the work split over the ranks of `torch.distributed`.

    Every rank must hold the same full `queries` and `candidates` (e.g. gathered embeddings);
    each scores its share (`query_share`), then the shares are gathered. Without a process group
    this is `retrieval_ranks` of all queries.
    """
    world, me = distributed.world_size(), distributed.rank()
    n = queries.shape[0]
    start, stop = query_share(n, me, world)
    mine = retrieval_ranks(
        queries,
        candidates,
        query_ids,
        candidate_ids,
        start=start,
        stop=stop,
        chunk_elements=chunk_elements,
    )
    if world == 1:
        return mine
    # Shares differ by at most one query: pad to the largest so every rank gathers one shape.
    longest = query_share(n, 0, world)[1]
    padded = torch.full((longest,), -1, dtype=torch.long, device=mine.device)
    padded[: mine.numel()] = mine
    gathered = distributed.all_gather(padded).view(world, longest)
    sizes = [stop - start for start, stop in (query_share(n, r, world) for r in range(world))]
    return torch.cat([gathered[r, :size] for r, size in enumerate(sizes)])


def rank_metrics(ranks: torch.Tensor, ks: Sequence[int] = DEFAULT_KS) -> dict[str, float | int]:
    """`R@K` (fractions), 1-based `mean_rank` and `median_rank`, and `n_queries` from 0-based
    ranks."""
    n = int(ranks.numel())
    if n == 0:
        raise ValueError("no queries to compute retrieval metrics on")
    one_based = ranks.double().cpu() + 1.0
    out: dict[str, float | int] = {f"R@{k}": float((ranks < k).double().mean()) for k in ks}
    out["mean_rank"] = float(one_based.mean())
    ordered = one_based.sort().values
    out["median_rank"] = float((ordered[(n - 1) // 2] + ordered[n // 2]) / 2)
    out["n_queries"] = n
    return out


def retrieval_metrics(
    features: dict[str, torch.Tensor],
    pairs: Sequence[tuple[str, str]],
    *,
    ks: Sequence[int] = DEFAULT_KS,
    groups: dict[str, torch.Tensor] | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> dict[str, dict[str, float | int]]:
    """Metrics in both directions of each pair, keyed `"a->b"` (queries from a, candidates b).

    `features[name]` [N_name, D]: row i of two towers belongs to the same sample unless `groups`
    says otherwise: `groups[name][i]` is the id of the item row i describes (e.g. the image
    index of each of several captions); rows of two towers match when their ids are equal.
    Works on one process or, with identical inputs on every rank, under `torch.distributed`.
    """
    groups = groups or {}
    out: dict[str, dict[str, float | int]] = {}
    for a, b in pairs:
        for q, c in ((a, b), (b, a)):
            for name in (q, c):
                if name not in features:
                    raise KeyError(f"no embeddings for tower {name!r} (have {sorted(features)})")
                check_finite(features[name], name)
            ranks = distributed_ranks(
                features[q],
                features[c],
                groups.get(q),
                groups.get(c),
                chunk_elements=chunk_elements,
            )
            out[f"{q}->{c}"] = rank_metrics(ranks, ks)
    return out
