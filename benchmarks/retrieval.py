"""Retrieval speed on the embedded factbook corpus (on demand, not CI): ``python benchmarks/retrieval.py``.

1. BM25: bm25s (what eval.bm25 uses) vs rank_bm25, same stemmed tokens, single thread: index time and
   top-10 for N factbook questions, side by side with the ratio. Target: bm25s >= 10x rank_bm25.
2. Dense (MiniLM): passage and query encoding timed separately; then flat / HNSW / IVF-PQ build time and
   top-10 search time for the N pre-encoded queries, recall@10 against flat. Target: flat < 1 s.
3. Top-5 hit rate (gold answer in a top-5 passage) of one-hop dev questions for BM25, dense and hybrid.

Passage embeddings are cached under $ZEROSIM_HOME/bench (keyed by corpus sha256) so reruns skip the
minutes of CPU encoding; ``--reencode`` forces it. Needs rank_bm25 (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def row(name: str, *cells: str) -> None:
    print(f"  {name:<34}" + "".join(f"{c:>16}" for c in cells))


def hit_rate(results, questions) -> float:
    from zerosim.core.metrics import answer_in_text  # whole words, as eval recall@k

    hits = sum(
        any(answer_in_text(d.contents, q.golden_answers) for d in docs)
        for q, docs in zip(questions, results, strict=True)
    )
    return hits / len(questions)


def bench_bm25(docs, queries: list[str]):
    import bm25s
    import rank_bm25
    import Stemmer

    stemmer = Stemmer.Stemmer("english")
    corpus_tokens, t_tok = timed(
        bm25s.tokenize,
        [d.contents for d in docs],
        stopwords="en",
        stemmer=stemmer,
        return_ids=False,
        show_progress=False,
    )
    query_tokens = bm25s.tokenize(
        queries, stopwords="en", stemmer=stemmer, return_ids=False, show_progress=False
    )
    print(f"\nBM25 · {len(docs):,} passages · {len(queries):,} queries · top-10 · 1 thread")
    print(f"  tokenising the corpus (shared, not in the figures below): {t_tok:.2f} s")

    fast = bm25s.BM25()
    _, t_index_fast = timed(fast.index, corpus_tokens, show_progress=False)
    known = [[t for t in q if t in fast.vocab_dict] or [next(iter(fast.vocab_dict))] for q in query_tokens]
    (fast_ids, _), t_query_fast = timed(fast.retrieve, known, k=10, show_progress=False, n_threads=1)

    slow, t_index_slow = timed(rank_bm25.BM25Okapi, corpus_tokens)

    def rank_bm25_top10():
        return [np.argsort(-slow.get_scores(q), kind="stable")[:10] for q in query_tokens]

    slow_ids, t_query_slow = timed(rank_bm25_top10)
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(fast_ids.tolist(), slow_ids, strict=True)])

    row("", "bm25s", "rank_bm25", "ratio")
    row("index", f"{t_index_fast:.3f} s", f"{t_index_slow:.3f} s", f"{t_index_slow / t_index_fast:.1f}x")
    row(
        f"{len(queries):,} queries",
        f"{t_query_fast:.3f} s",
        f"{t_query_slow:.3f} s",
        f"{t_query_slow / t_query_fast:.1f}x",
    )
    total_fast, total_slow = t_index_fast + t_query_fast, t_index_slow + t_query_slow
    row("index + queries", f"{total_fast:.3f} s", f"{total_slow:.3f} s", f"{total_slow / total_fast:.1f}x")
    print(f"  top-10 overlap bm25s vs rank_bm25 (lucene vs okapi idf): {overlap:.2f}")
    verdict = "met" if total_slow / total_fast >= 10 else "MISSED"
    print(f"  target bm25s >= 10x rank_bm25 (index + queries): {verdict}")


def passage_embeddings(retriever, reencode: bool):
    from eval.index import corpus_fingerprint
    from zerosim.core.models import zerosim_home

    sha = corpus_fingerprint(retriever.docs)["sha256"][:16]
    path = zerosim_home() / "bench" / f"factbook-{sha}-{retriever.encoder_name}.f32"
    shape = (len(retriever.docs), retriever.dimension)
    if path.is_file() and not reencode:
        print(f"  passage embeddings: reused {path} (--reencode to time the encoding)")
        return np.memmap(path, dtype=np.float32, mode="r", shape=shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    embeddings, seconds = timed(retriever.encode_passages, tmp, progress=True)
    embeddings.flush()
    tmp.rename(path)
    print(f"  encoding {shape[0]:,} passages: {seconds:.1f} s ({shape[0] / seconds:.1f} passages/s)")
    return np.memmap(path, dtype=np.float32, mode="r", shape=shape)


def bench_dense(docs, queries: list[str], dev, reencode: bool):
    import torch

    from eval.bm25 import BM25Retriever
    from eval.dense import DenseRetriever
    from eval.hybrid import HybridRetriever
    from zerosim.core.search import SearchRequest

    print(f"\nDense · MiniLM (384-d) · {len(docs):,} passages · {len(queries):,} queries · top-10")
    print(f"  torch threads {torch.get_num_threads()}")
    flat = DenseRetriever(docs)
    embeddings = passage_embeddings(flat, reencode)
    query_embeddings, t_encode = timed(flat.encode_queries, queries)
    print(f"  encoding {len(queries):,} queries (one batch): {t_encode:.2f} s")

    built = {}
    row("", "build", "search", "recall@10")
    reference = None
    for name, options in (("flat", None), ("hnsw", None), ("ivfpq", None)):
        retriever = DenseRetriever(docs, faiss_type=name, faiss_options=options)
        _, t_build = timed(retriever.add_embeddings, embeddings)
        results, t_search = timed(retriever.search_embeddings, query_embeddings, 10)
        ids = [{d.id for d in r} for r in results]
        reference = reference or ids
        recall = np.mean([len(a & b) / 10 for a, b in zip(ids, reference, strict=True)])
        o = retriever.faiss_options
        if name == "hnsw":
            label = f"hnsw (M={o['hnsw_m']}, ef={o['ef_search']})"
        elif name == "ivfpq":
            label = f"ivfpq ({o['nlist']}x{o['pq_m']}x{o['nbits']}b, np={o['nprobe']})"
        else:
            label = "flat (IndexFlatIP)"
        row(label, f"{t_build:.2f} s", f"{t_search:.3f} s", f"{recall:.3f}")
        built[name] = retriever
    _, t_flat = timed(built["flat"].search_embeddings, query_embeddings, 10)
    print(
        f"  target flat search of {len(queries):,} encoded queries < 1 s: {'met' if t_flat < 1 else 'MISSED'}"
    )

    print(f"\nTop-5 hit rate · {len(dev)} one-hop dev questions · full corpus")
    bm25 = BM25Retriever(docs).index()
    requests = [SearchRequest(q.question) for q in dev]
    engines = {
        "bm25 (bm25s)": bm25,
        "dense flat": built["flat"],
        "dense hnsw": built["hnsw"],
        "dense ivfpq": built["ivfpq"],
        "hybrid bm25 + dense flat (RRF)": HybridRetriever(bm25, built["flat"]),
    }
    for name, engine in engines.items():
        print(f"  {name:<34}{hit_rate(engine.search(requests, 5), dev):>8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=1000, help="factbook questions used as queries")
    parser.add_argument("--skip-dense", action="store_true", help="BM25 only (no encoder)")
    parser.add_argument("--reencode", action="store_true", help="encode the passages even if cached")
    args = parser.parse_args()

    from zerosim.core.data.embedded import ensure_factbook, load_questions
    from zerosim.core.data.qa import load_corpus

    docs = load_corpus(ensure_factbook(progress=False).corpus)
    questions = load_questions("factbook", "train") + load_questions("factbook", "test")
    queries = [q.question for q in questions[: args.queries]]
    dev = [q for q in load_questions("factbook", "dev") if q.metadata.get("hops") == 1]
    print(
        f"factbook: {len(docs):,} passages; {len(queries):,} queries from train+test questions; {os.cpu_count()} CPUs"
    )
    bench_bm25(docs, queries)
    if not args.skip_dense:
        bench_dense(docs, queries, dev, args.reencode)


if __name__ == "__main__":
    main()
