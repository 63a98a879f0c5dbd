"""zerosim's decoding loop (zerosim.core.decode) against transformers ``generate`` (HFGenerator decoder="transformers").

Same tokens greedily (sampled: the same distribution), log-probs within float tolerance of a teacher-forced forward,
stops on the same token, and a multi-turn context continued from the stored prefix instead of encoded again.
"""

from __future__ import annotations

import pytest
import torch

from zerosim.core.decode import ATTENTION, gqa_sdpa_attention, supports_fast_decode
from zerosim.core.generation import HFGenerator
from zerosim.core.models import load_causal_lm
from zerosim.core.sampling import GREEDY, Sampling


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(str(tiny_model_dir))


def prompts_of(tokenizer, n: int = 6) -> list[list[int]]:
    texts = ["What is the capital of France?", "Hi", "Name a river in Asia, please, and its length.",
             "2 + 2 =", "Tell me about the moon", "Who wrote Hamlet and when was it first staged?"]  # fmt: skip
    return [tokenizer(t)["input_ids"] for t in (texts * 2)[:n]]


def teacher_forced(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def test_the_tiny_model_takes_the_fast_path(model, tokenizer):
    assert supports_fast_decode(model)
    assert HFGenerator(model, tokenizer).decoder == "zerosim"
    assert HFGenerator(model, tokenizer, collective=True).decoder == "transformers"  # ranks sync steps
    with pytest.raises(ValueError, match="decoder 'vllm' is not one of zerosim, transformers"):
        HFGenerator(model, tokenizer, decoder="vllm")


def test_grouped_query_attention_equals_sdpa_over_repeated_heads():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 6, 1, 8), torch.randn(3, 2, 20, 8), torch.randn(3, 2, 20, 8)
    mask = torch.zeros(3, 1, 1, 20)
    mask[1, ..., :7] = float("-inf")  # left padding
    ours, _ = gqa_sdpa_attention(torch.nn.Module(), q, k, v, mask, scaling=8**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), attn_mask=mask, scale=8**-0.5
    )
    torch.testing.assert_close(ours, ref.transpose(1, 2))


def test_greedy_batch_gives_the_tokens_of_generate_and_teacher_forced_logprobs(model, tokenizer):
    prompts = prompts_of(tokenizer, 6)  # ragged: left padding, rows of different lengths
    fast = HFGenerator(model, tokenizer, sampling=GREEDY).generate(prompts, 12)
    slow = HFGenerator(model, tokenizer, sampling=GREEDY, decoder="transformers").generate(prompts, 12)
    assert [g.token_ids for g in fast] == [g.token_ids for g in slow]
    for prompt, g, s in zip(prompts, fast, slow, strict=True):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=0)
        torch.testing.assert_close(
            torch.tensor(g.logprobs), teacher_forced(model, prompt, g.token_ids), atol=1e-4, rtol=0
        )
    assert model.config._attn_implementation != ATTENTION  # restored after decoding


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_the_nucleus_is_the_one_transformers_top_p_keeps(top_p):
    """Found in a top-k, and for a row whose nucleus reaches past it (a flat one) in a whole sort."""
    from transformers import TopPLogitsWarper

    from zerosim.core.decode import NUCLEUS_CANDIDATES, nucleus

    torch.manual_seed(0)
    scores = torch.randn(6, 3 * NUCLEUS_CANDIDATES) * 3
    scores[2] = torch.randn(3 * NUCLEUS_CANDIDATES) * 0.05  # its nucleus holds more than the candidates
    expected = TopPLogitsWarper(top_p)(None, scores.clone()) > -float("inf")
    ids, probs, kept = nucleus(scores, top_p)
    found = torch.zeros_like(expected)
    for row in range(scores.shape[0]):
        found[row, ids[row][kept[row]]] = True
    assert torch.equal(found, expected)
    assert int(kept[2].sum()) > NUCLEUS_CANDIDATES
    torch.testing.assert_close(
        probs.gather(1, ids.new_zeros(6, 1)), scores.softmax(-1).max(-1, keepdim=True).values
    )


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_sampling_draws_from_the_tempered_softmax_of_the_nucleus(top_p):
    from zerosim.core.decode import sample

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(40_000, 1)
    torch.manual_seed(0)
    drawn = sample(logits, 0.8, top_p)
    probs = (logits[0] / 0.8).softmax(-1)
    if top_p < 1.0:  # transformers' nucleus: the tokens whose more likely ones hold less than top_p
        probs = probs * ((probs.cumsum(-1) - probs) < top_p)
        probs = probs / probs.sum()
    freq = torch.bincount(drawn, minlength=6).float() / len(drawn)
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)
    torch.manual_seed(0)
    assert torch.equal(sample(logits, 0.8, top_p), drawn)  # a seed gives the same draws


def test_sampling_one_prompt_is_reproducible_for_a_seed_and_scores_its_tokens(model, tokenizer):
    prompt = prompts_of(tokenizer, 1)
    out = []
    for _ in range(2):
        torch.manual_seed(7)
        gen = HFGenerator(model, tokenizer, sampling=Sampling(temperature=0.9, top_p=0.8))
        out.append(gen.generate(prompt, 16)[0])
    assert out[0].token_ids == out[1].token_ids and len(out[0].token_ids) == 16
    # log-probs are the tempered full softmax's (what TRL's importance ratio reads), not the nucleus's
    with torch.inference_mode():
        raw = model(torch.tensor([prompt[0] + out[0].token_ids])).logits[0, len(prompt[0]) - 1 : -1].float()
    tempered = torch.log_softmax(raw / 0.9, -1).gather(1, torch.tensor(out[0].token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(out[0].logprobs), tempered, atol=1e-4, rtol=0)


def test_rows_stop_on_the_token_that_completes_a_stop_string_and_leave_the_batch(model, tokenizer):
    prompts = prompts_of(tokenizer, 6)
    free = HFGenerator(model, tokenizer, sampling=GREEDY).generate(prompts, 16)
    # a stop string some rows write early and others later or never: the text of row 0's 4th token
    stop = tokenizer.decode(free[0].token_ids[3:4])
    assert stop.strip()
    sampling = Sampling(temperature=0.0, stop_strings=[stop])
    fast = HFGenerator(model, tokenizer, sampling=sampling).generate(prompts, 16)
    slow = HFGenerator(model, tokenizer, sampling=sampling, decoder="transformers")
    slow = slow.generate(prompts, 16)
    assert [(g.token_ids, g.finish) for g in fast] == [(g.token_ids, g.finish) for g in slow]
    assert fast[0].finish == "stop" and len(fast[0].token_ids) <= 4
    from zerosim.core.decode import token_pieces

    assert token_pieces(tokenizer) is token_pieces(tokenizer)  # the text table is built once per tokenizer
    assert {g.finish for g in fast} >= {"stop", "length"}  # some rows stopped while others went on


def test_a_multi_turn_context_continues_from_the_stored_prefix(model, tokenizer):
    """Turn 2 prefills only what turn 1 did not feed, and writes what a fresh encoding writes."""
    prompts = prompts_of(tokenizer, 4)
    observation = tokenizer(" <information>Paris is the capital.</information>")["input_ids"]
    fed: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: fed.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        reuse = HFGenerator(model, tokenizer, sampling=GREEDY)
        first = reuse.generate(prompts, 8)
        turn2 = [p + g.token_ids + observation for p, g in zip(prompts, first, strict=True)]
        fed.clear()
        second = reuse.generate(turn2, 8)
        prefilled = fed[0]
        fresh = HFGenerator(model, tokenizer, sampling=GREEDY, reuse_prefix=False).generate(turn2, 8)
    finally:
        hook.remove()
    # every row's prompt and its first turn came from the store: at most the observation and the one
    # sampled token turn 1 never fed are encoded again
    assert prefilled <= len(prompts) * (len(observation) + 1)
    assert prefilled < sum(len(t) for t in turn2) / 2
    assert [g.token_ids for g in second] == [g.token_ids for g in fresh]
    for context, g in zip(turn2, second, strict=True):
        torch.testing.assert_close(
            torch.tensor(g.logprobs), teacher_forced(model, context, g.token_ids), atol=1e-4, rtol=0
        )


def test_the_stored_prefix_is_dropped_when_the_weights_change(model, tokenizer):
    prompts = prompts_of(tokenizer, 2)
    gen = HFGenerator(model, tokenizer, sampling=GREEDY)
    first = gen.generate(prompts, 6)
    assert gen.store.rows
    turn2 = [p + g.token_ids for p, g in zip(prompts, first, strict=True)]
    with torch.no_grad():
        weight = model.model.layers[0].mlp.up_proj.weight
        saved = weight.clone()
        weight.mul_(1.5)  # an optimizer step: in place, the version counter moves
    try:
        second = gen.generate(turn2, 6)
        fresh = HFGenerator(model, tokenizer, sampling=GREEDY, reuse_prefix=False).generate(turn2, 6)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    for g, f in zip(second, fresh, strict=True):
        assert g.token_ids == f.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(f.logprobs), atol=1e-5, rtol=0)


def test_a_batch_invariant_call_writes_for_each_prompt_what_a_call_with_that_prompt_alone_writes(
    model, tokenizer
):
    """Bit for bit: the same tokens and the same log-probs, whatever else is in the batch."""
    prompts = prompts_of(tokenizer, 6)
    gen = HFGenerator(model, tokenizer, sampling=GREEDY, batch_invariant=True)
    assert gen.store is None  # a reused prefix was computed in another batch: not invariant
    batched = gen.generate(prompts, 20)
    for prompt, together in zip(prompts, batched, strict=True):
        alone = gen.generate([prompt], 20)[0]
        assert (alone.token_ids, alone.logprobs, alone.finish) == (
            together.token_ids,
            together.logprobs,
            together.finish,
        )
    # and the rows still decode what the model says: teacher-forced log-probs of the written tokens
    for prompt, g in zip(prompts, batched, strict=True):
        torch.testing.assert_close(
            torch.tensor(g.logprobs), teacher_forced(model, prompt, g.token_ids), atol=1e-4, rtol=0
        )


def test_batch_invariance_holds_across_forward_chunks(model, tokenizer):
    prompts = prompts_of(tokenizer, 5)
    from zerosim.core.decode import decode_invariant

    options = dict(sampling=GREEDY, pad_token_id=tokenizer.pad_token_id)
    from zerosim.core.decode import attention_implementation, register_attention

    with attention_implementation(model, register_attention()):
        chunked = decode_invariant(model, tokenizer, prompts, 10, rows_per_forward=2, **options)
        alone = [
            decode_invariant(model, tokenizer, [p], 10, rows_per_forward=2, **options)[0] for p in prompts
        ]
    assert chunked == alone


def test_the_prefix_every_prompt_shares_is_encoded_once(model, tokenizer):
    system = tokenizer("You are a search engine. Write three short results for the query below, please.")
    prompts = [system["input_ids"] + p for p in prompts_of(tokenizer, 4)]
    shared = len(system["input_ids"])
    fed: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: fed.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        fast = HFGenerator(model, tokenizer, sampling=GREEDY).generate(prompts, 8)
    finally:
        hook.remove()
    # the shared prefix once, then only what follows it for each row (padded to the longest)
    assert fed[0] == shared
    assert fed[1] == len(prompts) * (max(map(len, prompts)) - shared)
    slow = HFGenerator(model, tokenizer, sampling=GREEDY, decoder="transformers").generate(prompts, 8)
    assert [g.token_ids for g in fast] == [g.token_ids for g in slow]
    for prompt, g in zip(prompts, fast, strict=True):
        torch.testing.assert_close(
            torch.tensor(g.logprobs), teacher_forced(model, prompt, g.token_ids), atol=1e-4, rtol=0
        )


def test_a_groups_repeated_prompt_is_prefilled_once_and_its_rows_are_those_of_unshared_prefills(
    model, tokenizer, monkeypatch
):
    """GRPO's G trajectories of one question share its prompt: 3 groups x 3 rows prefill 3 rows, not 9, and
    write, greedily over two turns (the second continued from the store), what one prefill per row writes."""
    import zerosim.core.decode as decode_module

    prompts = [p for p in prompts_of(tokenizer, 3) for _ in range(3)]
    observations = [tokenizer(f" <information>result {i}</information>")["input_ids"] for i in range(9)]

    def two_turns(share: bool):
        monkeypatch.setattr(decode_module, "SHARE_REPEATED_PROMPTS", share)
        rows: list[int] = []
        hook = model.register_forward_pre_hook(
            lambda _m, _a, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
        )
        try:
            generator = HFGenerator(model, tokenizer, sampling=GREEDY)
            first = generator.generate(prompts, 6)
            prefill_rows = rows[0]
            turn2 = [p + g.token_ids + o for p, g, o in zip(prompts, first, observations, strict=True)]
            second = generator.generate(turn2, 6)
        finally:
            hook.remove()
        return prefill_rows, [g.token_ids for g in first], [g.token_ids for g in second], second, turn2

    shared_rows, first, second, generations, turn2 = two_turns(True)
    unshared_rows, first_alone, second_alone, _, _ = two_turns(False)
    assert (shared_rows, unshared_rows) == (3, 9)
    assert first == first_alone and second == second_alone
    for context, g in zip(turn2, generations, strict=True):  # the copied caches are the rows' own
        torch.testing.assert_close(
            torch.tensor(g.logprobs), teacher_forced(model, context, g.token_ids), atol=1e-4, rtol=0
        )


def _on_bf16_grid_then_fine_tuned(model, tokenizer, prompts):
    """(base, tuned): ``model`` with every linear weight rounded to bf16 (a checkpoint shipped in bf16), and that
    checkpoint fine-tuned by less than half a bf16 step per weight, toward its own greedy continuations (the
    sign of the gradient: what an SFT step at a small learning rate does)."""
    import copy

    base = copy.deepcopy(model)
    with torch.no_grad():
        for module in base.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.bfloat16().float())
    targets = HFGenerator(base, tokenizer, sampling=GREEDY, bf16=False).generate(prompts, 8)
    tuned = copy.deepcopy(base)
    loss = sum(
        -teacher_forced_grad(tuned, p, g.token_ids).sum() for p, g in zip(prompts, targets, strict=True)
    )
    loss.backward()
    with torch.no_grad():
        for module in tuned.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                step = torch.ldexp(torch.ones_like(w), torch.frexp(w)[1] - 8)  # bf16's spacing at w
                w.sub_(0.45 * step * torch.sign(w.grad))
    tuned.zero_grad(set_to_none=True)
    return base, tuned


def teacher_forced_grad(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def test_bf16_generation_keeps_a_fine_tune_that_one_bf16_weight_per_layer_rounds_away(model, tokenizer):
    """A fine-tune of a bf16 checkpoint moves most weights by less than half a bf16 step: one bf16 weight per
    layer computes the checkpoint, not the fine-tuned model (the v2 warm start: EM 14.1 fp32, 4.7 so). The copy's
    hi + lo weights generate with the fine-tuned model's log-probs, within a quarter of what the fine-tune moved
    them; one bf16 weight (zerosim.core.bf16.SPLIT_WEIGHTS=False, the code before) does not."""
    import zerosim.core.bf16 as bf16

    prompts = prompts_of(tokenizer, 4)
    base, tuned = _on_bf16_grid_then_fine_tuned(model, tokenizer, prompts)

    def gaps(split: bool) -> tuple[float, float]:
        generator = HFGenerator(tuned, tokenizer, sampling=GREEDY, bf16=True)
        generator._bf16_copy = bf16.Bf16Copy(tuned, split=split)
        to_tuned = moved = 0.0
        for prompt, g in zip(prompts, generator.generate(prompts, 8), strict=True):
            ours, want = torch.tensor(g.logprobs), teacher_forced(tuned, prompt, g.token_ids)
            to_tuned = max(to_tuned, float((ours - want).abs().max()))
            moved = max(moved, float((want - teacher_forced(base, prompt, g.token_ids)).abs().max()))
        return to_tuned, moved

    assert bf16.SPLIT_WEIGHTS
    to_tuned, moved = gaps(split=True)
    assert moved > 0.01 and to_tuned < 0.25 * moved, (to_tuned, moved)
    one_weight, moved = gaps(split=False)
    assert one_weight > 0.5 * moved, (one_weight, moved)  # what the test tells apart


def test_bf16_generation_computes_from_a_bf16_copy_and_leaves_the_fp32_weights(model, tokenizer):
    """bf16 on CPU: the linear layers' matmuls in bf16 from a copy cast once per change of the weights (not at
    every forward); the model keeps its fp32 weights, and the copy follows them when they change."""
    prompts = prompts_of(tokenizer, 4)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    fp32 = HFGenerator(model, tokenizer, sampling=GREEDY, bf16=False).generate(prompts, 8)
    generator = HFGenerator(model, tokenizer, sampling=GREEDY, bf16=True)
    bf16 = generator.generate(prompts, 8)
    copy = generator._bf16_copy.current()
    from zerosim.core.bf16 import SplitBf16Linear

    assert not any(isinstance(m, torch.nn.Linear) for m in copy.modules())
    linears = [m for m in copy.modules() if isinstance(m, SplitBf16Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert copy.get_input_embeddings().weight.dtype == torch.float32  # the residual stream starts in fp32
    assert all(p.dtype == torch.float32 and torch.equal(p, weights[n]) for n, p in model.named_parameters())
    for g, ref in zip(bf16, fp32, strict=True):  # bf16 logits, within its rounding of the fp32 ones
        assert len(g.token_ids) == len(g.logprobs) > 0
        n = min(len(g.logprobs), len(ref.logprobs))
        if g.token_ids[:n] == ref.token_ids[:n]:
            torch.testing.assert_close(
                torch.tensor(g.logprobs[:n]), torch.tensor(ref.logprobs[:n]), atol=0.1, rtol=0
            )
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.mul_(0.5)  # an optimizer step: the copy is cast again at the next call
    try:
        generator.generate(prompts[:1], 2)
        split = copy.get_output_embeddings()
        hi, lo = split.weight[:, : split.in_features], split.weight[:, split.in_features :]
        assert torch.equal(hi, head.detach().bfloat16())
        assert torch.equal(lo, (head.detach() - hi.float()).bfloat16())
    finally:
        with torch.no_grad():
            head.mul_(2.0)
