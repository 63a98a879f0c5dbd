"""Rollout speed (on demand, not CI): ``python benchmarks/rollout.py --policy CHECKPOINT``.

Our multi-turn rollout vs a ZeroSearch-style loop, same policy, prompts, retriever and sampling seed,
printed side by side from one run:

- **ours** (``zerosim.agent.rollout.SearchRollout``): generation stops at ``</search>``, ``</answer>`` or EOS
  (stop strings inside ``generate``), token-in/token-out, one batched search call per turn;
- **ZeroSearch-style**: a fixed token budget per turn with no stop strings (EOS only), then the text is cut
  at the first closing tag and re-tokenised, and one search call per trajectory.

Reported: wall time, sampled tokens, *useful* tokens (policy tokens up to and including the turn's stop,
i.e. what both loops keep), useful tokens per second, and the share of sampled tokens past a stop tag.
Targets: ours >= 3x useful tokens/s; < 2% of our sampled tokens past a stop tag.

The policy must speak the tag protocol: pass a warm-started checkpoint (``zerosim policy warmstart``, or the
demo's ``outputs/demo/warmstart/final``). The base SmolLM2 never emits a tag, so both loops would only
measure EOS.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STOPS = ("</search>", "</answer>")


def row(name: str, *cells: str) -> None:
    print(f"  {name:<30}" + "".join(f"{c:>14}" for c in cells))


class BatchCounts:
    """What a loop's time goes with, counted on the model's forward passes: ``generate`` calls, decode steps
    (one-token forwards), row-steps (rows computed over all decode steps: ``generate`` runs every row until
    the longest stops, zerosim's loop only the live ones) and prefill tokens (rows x columns encoded by the
    other forwards, padding included: ``generate`` encodes the whole context every turn, zerosim's loop
    what the last turn did not)."""

    def __init__(self):
        self.calls = self.steps = self.row_steps = self.prefill = 0
        self._hook = None

    def watch(self, model) -> None:
        def count(_module, _args, kwargs):
            ids = kwargs.get("input_ids")
            if ids is None:
                return
            if ids.shape[1] == 1:
                self.steps += 1
                self.row_steps += ids.shape[0]
            else:
                self.prefill += ids.numel()

        self._hook = model.register_forward_pre_hook(count, with_kwargs=True)

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()


class CountingGenerator:
    """Wraps an ``HFGenerator``: counts sampled tokens (before the cut), kept tokens and calls."""

    def __init__(self, inner, batches: BatchCounts):
        self.inner = inner
        self.sampled = 0
        self.kept = 0
        self.batches = batches
        cut = inner._cut
        pad = inner.pad_token_id

        def counting_cut(ids, logps):
            out = cut(ids, logps)
            # after a row stops, generate pads it: trailing pads were never sampled
            raw = len(ids)
            while raw > len(out.token_ids) and ids[raw - 1] == pad:
                raw -= 1
            self.sampled += raw
            self.kept += len(out.token_ids)
            return out

        inner._cut = counting_cut

    def generate(self, prompts, max_new_tokens):
        self.batches.calls += 1
        return self.inner.generate(prompts, max_new_tokens)


def zerosearch_loop(
    model, tokenizer, engine, questions, *, k, max_turns, budget, max_obs_tokens, seed, counts=None,
    decoder="zerosim",
):  # fmt: skip
    """The baseline: fixed budget per turn, cut at the first tag afterwards, one search per trajectory.
    ``counts`` (:class:`BatchCounts`) records its calls, decode steps and prefill."""
    import torch

    from zerosim.agent.protocol import parse_action
    from zerosim.agent.rollout import ProtocolTokens, build_prompt
    from zerosim.core.generation import HFGenerator
    from zerosim.core.sampling import Sampling
    from zerosim.core.search import SearchRequest

    torch.manual_seed(seed)
    tokens = ProtocolTokens(tokenizer, max_obs_tokens)
    gen = HFGenerator(model, tokenizer, sampling=Sampling(temperature=1.0), decoder=decoder)
    contexts = [tokens.prompt(build_prompt(q.question)) for q in questions]
    active = list(range(len(questions)))
    sampled = useful = 0
    for turn in range(max_turns):
        if not active:
            break
        batch = [contexts[i] for i in active]
        outs = gen.generate(batch, budget)
        if counts is not None:
            counts.calls += 1
        still = []
        for i, out in zip(active, outs, strict=True):
            sampled += len(out.token_ids)
            text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            ends = [text.find(s) + len(s) for s in STOPS if s in text]
            text = text[: min(ends)] if ends else text
            kept = tokens.encode(text)  # decode -> re-tokenise round trip, as ZeroSearch does
            useful += len(kept)
            contexts[i] = contexts[i] + kept
            kind, query = parse_action(text)
            if kind == "search" and turn < max_turns - 1:
                docs = engine.search([SearchRequest(query=query)], k)[0]  # one call per trajectory
                contexts[i] = contexts[i] + tokens.observation(docs)
                still.append(i)
        active = still
    return sampled, useful


def _with_decoder(generator, decoder: str):
    from zerosim.core.generation import HFGenerator

    return HFGenerator(generator.model, generator.tokenizer, sampling=generator.sampling, decoder=decoder)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--policy", default="outputs/demo/warmstart/final", help="a policy that speaks the tags"
    )
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument(
        "--budget", type=int, default=256, help="ZeroSearch-style tokens per turn (theirs: 500)"
    )
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--decoder", default="zerosim", choices=("zerosim", "transformers"),
        help="the decoder both loops use (benchmarks/decode.py compares decoders)",
    )  # fmt: skip
    args = parser.parse_args()
    if not Path(args.policy).is_dir() and args.policy != "smollm2":
        raise SystemExit(
            f"policy {args.policy} not found: run `zerosim policy warmstart --config configs/demo.yaml` (or the demo) "
            "first, or pass --policy CHECKPOINT"
        )

    import torch

    from zerosim.agent.rollout import RolloutConfig, SearchRollout, build_prompt
    from zerosim.core.data.embedded import load_questions
    from zerosim.core.models import load_causal_lm, load_tokenizer
    from zerosim.engines import SearchConfig, build_search_engine

    questions = load_questions("factbook", "dev", limit=args.questions)
    tokenizer, model = load_tokenizer(args.policy), load_causal_lm(args.policy)
    engine = build_search_engine(SearchConfig(engine="bm25"))
    config = RolloutConfig(
        max_turns=args.max_turns, max_new_tokens=args.budget, max_obs_tokens=128, max_completion_tokens=4096
    )
    rollout = SearchRollout(
        tokenizer,
        engine,
        config=config,
        k=args.k,
        examples={build_prompt(q.question): (q.question, q.golden_answers) for q in questions},
    )
    prompts = [build_prompt(q.question) for q in questions]
    rollout.run(_with_decoder(rollout.generator_for(model), args.decoder), prompts[:2], step=0)  # warm-up

    torch.manual_seed(args.seed)
    counting = CountingGenerator(_with_decoder(rollout.generator_for(model), args.decoder), BatchCounts())
    counting.batches.watch(model)
    started = time.perf_counter()
    trajectories, timing = rollout.run(counting, prompts, step=0)
    t_ours = time.perf_counter() - started
    counting.batches.stop()
    useful_ours = sum(sum(t.env_mask) for t in trajectories)

    started = time.perf_counter()
    zs_counts = BatchCounts()
    zs_counts.watch(model)
    sampled_zs, useful_zs = zerosearch_loop(
        model, tokenizer, engine, questions, k=args.k, max_turns=args.max_turns, budget=args.budget,
        max_obs_tokens=128, seed=args.seed, counts=zs_counts, decoder=args.decoder,
    )  # fmt: skip
    t_zs = time.perf_counter() - started
    zs_counts.stop()

    searches = sum(t.searches for t in trajectories)
    print(
        f"\n{len(questions)} questions, policy {args.policy}, budget {args.budget} tokens/turn, "
        f"{args.max_turns} turns, BM25 k={args.k}; ours made {searches} searches"
    )
    row("", "seconds", "sampled tok", "useful tok", "useful tok/s", "past stop")
    past_zs = (sampled_zs - useful_zs) / max(sampled_zs, 1)
    past_ours = (counting.sampled - counting.kept) / max(counting.sampled, 1)
    row(
        "ZeroSearch-style loop",
        f"{t_zs:.1f}",
        str(sampled_zs),
        str(useful_zs),
        f"{useful_zs / t_zs:.1f}",
        f"{100 * past_zs:.1f}%",
    )
    row(
        "zerosim rollout",
        f"{t_ours:.1f}",
        str(counting.sampled),
        str(useful_ours),
        f"{useful_ours / t_ours:.1f}",
        f"{100 * past_ours:.1f}%",
    )
    ratio = (useful_ours / t_ours) / max(useful_zs / t_zs, 1e-9)
    print(
        f"\n  useful tokens/s ratio: {ratio:.1f}x (target >= 3x); ours past a stop tag: {100 * past_ours:.2f}% (target < 2%)"
    )
    print(f"  ours: generate {timing['generate']:.1f} s, search {timing['search']:.1f} s")
    # what explains the times: the batch pays for its longest row at every decode step, and re-encodes contexts
    print("\n  where the time goes        calls  decode steps  steps/s   row-steps  live share  prefill tok")
    for name, c, seconds, live in [
        ("ZeroSearch-style loop", zs_counts, t_zs, sampled_zs),
        ("zerosim rollout", counting.batches, t_ours, counting.sampled),
    ]:
        print(
            f"  {name:<24}{c.calls:>7}{c.steps:>14}{c.steps / seconds:>9.2f}{c.row_steps:>12}"
            f"{live / max(c.row_steps, 1):>11.0%}{c.prefill:>13}"
        )


if __name__ == "__main__":
    main()
