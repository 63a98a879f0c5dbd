"""A decoding loop for transformers causal LMs that wastes nothing on a CPU: the rollout's default.

``model.generate`` spends most of a CPU decode step on copies, not on the model (``benchmarks/decode.py``
prints the split): with a padding mask, transformers' SDPA path repeats each key/value head for every
query head of its group (``repeat_kv``: the whole cache copied at every layer, every step), the dynamic
cache grows by ``torch.cat`` (the whole cache copied again), and a batch keeps decoding every row until
its longest row stops (72% of the rollout's row-steps were rows that had already stopped). This loop runs
the same model forward, with:

- **grouped-query attention without copies**: the ``zerosim_sdpa`` attention implementation calls
  ``scaled_dot_product_attention(..., enable_gqa=True)`` with the padding mask (transformers enables GQA in
  SDPA only without a mask or off CPU); the result is the same as SDPA over repeated heads;
- **a cache that grows in place** (:class:`GrowingLayer`): written into a buffer with room for the whole
  call, read as a view;
- **finished rows leave the batch**: when rows stop, the batch and its cache keep only the live rows, and
  the left-padding columns that no live row needs are dropped;
- **stops found on token ids**: a per-tokenizer table of each token's text, scanned only for tokens that
  hold a stop string's last character;
- **only the needed logits**: the prefill computes the last position's logits only, and each step keeps
  the sampled token's log-probability instead of the whole vocabulary's logits.

Sampling draws from the distribution transformers samples (temperature, then top-p) by inverse CDF on the
global RNG (:func:`sample`: one uniform per row, a top-k for the nucleus), so a seed gives the same tokens on
every call but not ``generate``'s; in a batch, rows that leave change which draws the others get (the
distribution is the same). Log-probs are ``log_softmax(logits / temperature)`` of the sampled token, as
``HFGenerator`` has always returned them.

Models the loop does not cover (sliding-window or non-attention layers, encoder-decoders) are left to
``generate`` (:func:`supports_fast_decode`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from zerosim.core.sampling import Sampling

ATTENTION = "zerosim_sdpa"
_registered = False


def gqa_sdpa_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' SDPA attention, with grouped-query attention inside the kernel on every device.

    With ``row_starts`` (the batch-invariant decode), each row attends to its own keys from its start column
    on, alone and without a mask: the same kernel call, on the same values, as when the row is decoded by
    itself.

    Under CPU bf16 autocast (bf16 generation) attention computes in fp32: CPU SDPA kernels are no faster in
    bf16 for a prompt and ~6x slower for a decode step's single query (measured: 16 rows, 350 keys, 2.9 ms
    against 0.47 ms), and its matmuls are a small share of a step.
    """
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return gqa_sdpa_attention(
                module, query.float(), key.float(), value.float(), attention_mask, dropout, scaling,
                is_causal, **kwargs,
            )  # fmt: skip
    row_starts = kwargs.get("row_starts")
    if row_starts is not None:
        rows = [
            F.scaled_dot_product_attention(
                query[b : b + 1],
                key[b : b + 1, :, s:],
                value[b : b + 1, :, s:],
                scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )  # fmt: skip
            for b, s in enumerate(row_starts)
        ]
        return torch.cat(rows).transpose(1, 2).contiguous(), None
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register ``zerosim_sdpa`` with transformers (attention and its mask: SDPA's); returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(ATTENTION, gqa_sdpa_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
        _registered = True
    return ATTENTION


class GrowingLayer(DynamicLayer):
    """A cache layer written in place into a buffer with ``reserve`` free positions, read as a view."""

    def __init__(self, reserve: int):
        super().__init__()
        self.reserve = reserve
        self.length = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = self.values = None
        self.is_initialized = True

    def _grow(self, needed: int, like: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
        b, h, _, d = like.shape
        buf = like.new_empty((b, h, needed + self.reserve, d))
        if old is not None:
            buf[:, :, : self.length] = old[:, :, : self.length]
        return buf

    def update(self, key_states, value_states, *args, **kwargs):
        if value_states.dtype != key_states.dtype:  # bf16 autocast: keys fp32 after the rotary, values bf16
            value_states = value_states.to(key_states.dtype)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self.keys is None or end > self.keys.shape[-2]:
            self.keys = self._grow(end, key_states, self.keys)
            self.values = self._grow(end, value_states, self.values)
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def preload(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start from ``keys``/``values`` (the reused columns) with ``reserve`` positions free after them."""
        self.is_initialized, self.dtype, self.device = True, keys.dtype, keys.device
        self.keys = self.values = None
        self.keys = self._grow(keys.shape[-2], keys, None)
        self.values = self._grow(keys.shape[-2], values, None)
        self.keys[:, :, : keys.shape[-2]] = keys
        self.values[:, :, : keys.shape[-2]] = values
        self.length = keys.shape[-2]

    def row(self, b: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``b``'s keys and values from column ``start`` on (copies)."""
        return self.keys[b, :, start : self.length].clone(), self.values[b, :, start : self.length].clone()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[indices], self.values[indices]

    def drop_front(self, columns: int) -> None:
        """Forget the first ``columns`` positions (left padding no live row needs)."""
        if self.keys is not None and columns > 0:
            self.keys, self.values = self.keys[:, :, columns:], self.values[:, :, columns:]
            self.length -= columns


def weights_version(model) -> tuple:
    """What changes whenever ``model``'s weights do: an optimizer step (or any in-place write) bumps each
    parameter's version counter, and a reload moves its storage."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


class PrefixStore:
    """Per-row key/value caches of the sequences the last call decoded, for the next call to continue.

    A multi-turn rollout calls the generator again with each trajectory's context grown by its last turn
    and an observation; the prefix it shares with a stored row (prompt + the tokens fed while decoding) is
    not encoded again: the next call prefills only what is new. The store holds the rows of the last call
    only, and is emptied when the model's weights change (an optimizer step bumps every parameter's
    version counter), so a cache never outlives the weights that computed it.
    """

    def __init__(self, model):
        self.model = model
        self.rows: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self._weights = weights_version(model)

    def fresh(self) -> None:
        """Empty the store if the weights changed since it was filled."""
        version = weights_version(self.model)
        if version != self._weights:
            self.rows, self._weights = [], version

    def match(self, ids: Sequence[int]) -> tuple[int, int]:
        """(entry, shared prefix length) of the stored row sharing the longest prefix with ``ids``."""
        best, best_len = -1, 0
        query = torch.tensor(list(ids), dtype=torch.long)
        for e, (tokens, _) in enumerate(self.rows):
            n = min(len(tokens), len(query))
            if n <= best_len:
                continue
            diff = (tokens[:n] != query[:n]).nonzero()
            shared = int(diff[0]) if len(diff) else n
            if shared > best_len:
                best, best_len = e, shared
        return best, best_len


def supports_fast_decode(model) -> bool:
    """Whether :func:`decode` covers ``model``: a decoder-only LM of full-attention layers taking SDPA."""
    config = getattr(model, "config", None)
    if (
        config is None
        or getattr(config, "is_encoder_decoder", False)
        or not getattr(model, "_supports_sdpa", False)
    ):
        return False
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in layer_types) and not getattr(text, "sliding_window", None)


# tokenizer -> list of each token id's text (decoded alone), for stop scanning
_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_pieces(tokenizer) -> list[str]:
    """Each token id's text, decoded alone (built once per tokenizer: ~1 s for a 49k vocabulary)."""
    if tokenizer not in _PIECES:
        size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
        _PIECES[tokenizer] = tokenizer.batch_decode([[i] for i in range(size)])
    return _PIECES[tokenizer]


class StopScanner:
    """Finds, token by token, the first token that ends a row's text with a stop string."""

    def __init__(self, tokenizer, stop_strings: Sequence[str], rows: int):
        self.stops = tuple(stop_strings)
        self.pieces = token_pieces(tokenizer) if self.stops else []
        self.last_chars = {s[-1] for s in self.stops}
        self.keep = max((len(s) for s in self.stops), default=0)
        self.tails = [""] * rows

    def select(self, rows: Sequence[int]) -> None:
        self.tails = [self.tails[r] for r in rows]

    def hit(self, row: int, token: int) -> bool:
        if not self.stops:
            return False
        piece = self.pieces[token] if token < len(self.pieces) else ""
        text = self.tails[row] + piece
        self.tails[row] = text[-self.keep :]
        return any(c in piece for c in self.last_chars) and any(s in text for s in self.stops)


# a row's nucleus is looked for among its this many most likely tokens (a top-k, not a sort of the vocabulary);
# a row whose top-p mass lies beyond them is sorted whole
NUCLEUS_CANDIDATES = 1024


def nucleus(scores: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's top-p nucleus of ``softmax(scores)``, most likely first: (token ids, probabilities, kept) — the
    tokens transformers' ``TopPLogitsWarper`` keeps (those whose more likely tokens hold less than ``top_p`` of
    the mass; the most likely always), found in a top-k of :data:`NUCLEUS_CANDIDATES` instead of a sort of the
    whole vocabulary (a row whose nucleus reaches past it: sorted whole)."""
    k = min(NUCLEUS_CANDIDATES, scores.shape[-1])
    log_z = torch.logsumexp(scores, dim=-1, keepdim=True)
    values, ids = scores.topk(k, dim=-1)
    probs = (values - log_z).exp()
    above = probs.cumsum(-1) - probs  # the mass of the more likely tokens
    kept = above < top_p
    kept[:, 0] = True
    beyond = kept[:, -1] & (k < scores.shape[-1])  # the nucleus may go on past the candidates
    if beyond.any():
        rows = beyond.nonzero().squeeze(1)
        all_values, all_ids = scores[rows].sort(dim=-1, descending=True)
        all_probs = (all_values - log_z[rows]).exp()
        all_kept = (all_probs.cumsum(-1) - all_probs) < top_p
        all_kept[:, 0] = True
        width = int(all_kept.sum(-1).max())
        pad = max(0, width - k)
        ids, probs, kept = (F.pad(t, (0, pad)) for t in (ids, probs, kept))
        ids[rows, :width], probs[rows, :width], kept[rows, :width] = (
            all_ids[:, :width], all_probs[:, :width], all_kept[:, :width]
        )  # fmt: skip
    return ids, probs, kept


def sample(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """One token per row from the distribution transformers samples: ``softmax(logits / temperature)``, cut to
    its top-p nucleus (:func:`nucleus`); greedy at temperature 0.

    Drawn by inverse CDF — one uniform per row (``torch.rand``, the global RNG) against the cumulative mass —
    instead of ``torch.multinomial``, which draws one exponential per vocabulary entry, and with a top-k instead
    of a sort for the nucleus: on SmolLM2's 49k vocabulary at 16 rows the draw took more time than the model's
    decode step (benchmarks/simulator.py). The distribution is the same; the tokens a seed gives are not
    ``generate``'s."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    scores = logits / temperature
    if top_p < 1.0:
        ids, probs, kept = nucleus(scores, top_p)
        probs = probs * kept
    else:
        ids, probs = None, F.softmax(scores, dim=-1)
    cumulative = probs.cumsum(-1)
    u = torch.rand(cumulative.shape[0], 1, device=cumulative.device, dtype=cumulative.dtype)
    chosen = torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True).clamp(max=probs.shape[-1] - 1)
    # a rounding that lands the draw on a zero-probability slot (past the nucleus) takes the last one before it
    if ids is not None:
        chosen = torch.minimum(chosen, kept.sum(-1, keepdim=True) - 1)
        return ids.gather(1, chosen).squeeze(1)
    return chosen.squeeze(1)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, scale: float, logprobs: bool):
    """One token per row (:func:`sample`) and its log-prob under ``logits / scale`` (zeros without ``logprobs``)."""
    logits = logits.float()
    chosen = sample(logits, temperature, top_p)
    if not logprobs:
        return chosen, [0.0] * len(chosen)
    return chosen, torch.log_softmax(logits / scale, dim=-1).gather(1, chosen[:, None]).squeeze(1).tolist()


@torch.inference_mode()
def decode(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling,
    pad_token_id: int,
    logprobs: bool = True,
    store: PrefixStore | None = None,
) -> list[tuple[list[int], list[float]]]:
    """Continue each prompt until EOS, a stop string or ``max_new_tokens``; (token ids, log-probs) per row.

    A row's tokens end with the EOS or the token that completes a stop string, as ``generate`` leaves them
    once its padding is removed. With a ``store``, each prompt's longest prefix shared with a row of the
    previous call is taken from its cache, and the rows of this call are stored for the next. A prompt that
    repeats an earlier one of the call (a GRPO group's G trajectories of one question) is prefilled once: its
    rows start from a copy of that prompt's cache and logits (:data:`SHARE_REPEATED_PROMPTS`).
    """
    temperature, top_p, stop_strings = sampling.temperature, sampling.top_p, sampling.stop_strings
    eos_token_ids = sampling.eos_ids(tokenizer)
    device = next(model.parameters()).device
    n = len(prompts)
    first: dict[tuple[int, ...], int] = {}  # each distinct prompt -> its place among the prefilled ones
    for ids in prompts:
        first.setdefault(tuple(ids), len(first))
    repeated = SHARE_REPEATED_PROMPTS and len(first) < n
    prefilled = [list(ids) for ids in first] if repeated else prompts
    cache, logits, mask, next_pos = _prefill(model, prefilled, max_new_tokens, store, pad_token_id, device)
    if repeated:  # every row from its prompt's prefill: the cache's rows, the last logits, mask, positions
        index = torch.tensor([first[tuple(ids)] for ids in prompts], device=device)
        cache.batch_select_indices(index)
        logits, mask, next_pos = logits[index], mask[index], next_pos[index]
    scale = temperature if temperature > 0 else 1.0
    tokens: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    live = list(range(n))  # original row of each batch row
    scanner = StopScanner(tokenizer, stop_strings, n)
    saved: list = [None] * n  # (fed tokens, per-layer key/value) of each row, for the store

    def save(rows: Sequence[int]) -> None:
        if store is None:
            return
        starts = (mask.shape[1] - mask.sum(dim=1)).tolist()  # a row's real columns are its last ones
        for b in rows:
            row = live[b]
            fed = list(prompts[row]) + tokens[row][:-1]
            kv = [layer.row(b, int(starts[b])) for layer in cache.layers]
            saved[row] = (torch.tensor(fed, dtype=torch.long), kv)

    for step in range(max_new_tokens):
        chosen, picked = _pick(logits, temperature, top_p, scale, logprobs)
        keep = []
        for b, (tok, lp) in enumerate(zip(chosen.tolist(), picked, strict=True)):
            row = live[b]
            tokens[row].append(tok)
            logps[row].append(lp)
            if tok not in eos_token_ids and not scanner.hit(b, tok):
                keep.append(b)
        if not keep or step == max_new_tokens - 1:
            save(range(len(live)))
            break
        if len(keep) < len(live):  # finished rows leave the batch and its cache
            kept = set(keep)
            save([b for b in range(len(live)) if b not in kept])
            index = torch.tensor(keep, device=device)
            chosen, mask, next_pos = chosen[index], mask[index], next_pos[index]
            cache.batch_select_indices(index)
            scanner.select(keep)
            live = [live[b] for b in keep]
            front = int(mask.any(dim=0).int().argmax())  # left padding no live row needs
            if front > 0:
                mask = mask[:, front:]
                for layer in cache.layers:
                    layer.drop_front(front)
        mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
        out = model(
            input_ids=chosen[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=cache,
            use_cache=True,
        )  # fmt: skip
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    if store is not None:
        store.rows = [r for r in saved if r is not None]
    return list(zip(tokens, logps, strict=True))


# A call's prompts that repeat an earlier one are prefilled once (decode). A switch for benchmarks/step.py, which
# times a step with and without it; the rows are the same either way up to the float rounding of a batch's size.
SHARE_REPEATED_PROMPTS = True


def _prefill(model, prompts, max_new_tokens: int, store: PrefixStore | None, pad_token_id: int, device):
    """Encode ``prompts`` (left-padded to one width) into a fresh cache with room for ``max_new_tokens`` more:
    (cache, each row's last logits, attention mask, next position ids). A prefix a row shares with a row of
    ``store`` is copied from it, and the prefix every prompt shares is encoded once; the forward covers only the
    columns after the shortest of those."""
    n = len(prompts)
    width = max(len(p) for p in prompts)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    cache = Cache(layers=[GrowingLayer(max_new_tokens) for _ in range(layers)])
    reused = [(-1, 0)] * n
    entries = []  # (tokens, per-layer keys/values) that rows continue from
    if store is not None:
        store.fresh()
        entries = list(store.rows)
        # at least the last prompt token is fed: its logits start the decoding
        reused = [(e, min(r, len(p) - 1)) if e >= 0 else (e, 0) for p in prompts for e, r in [store.match(p)]]
    shared = _shared_prefix(prompts)
    if (
        n > 1
        and shared >= MIN_SHARED_PREFIX
        and any(r < min(shared, len(p) - 1) for p, (_, r) in zip(prompts, reused, strict=True))
    ):
        # the prefix every prompt shares (a system prompt, the instructions): encoded once, not once per row
        entries.append(_encode_alone(model, prompts[0][:shared], layers, device))
        reused = [
            (len(entries) - 1, min(shared, len(p) - 1)) if r < min(shared, len(p) - 1) else (e, r)
            for p, (e, r) in zip(prompts, reused, strict=True)
        ]
    # Columns [0, past) come from the store; the forward runs on [past, width): a row's new tokens end at
    # the right edge, and a row with fewer new tokens than the widest recomputes some it could have reused.
    past = width - max(len(p) - r for p, (_, r) in zip(prompts, reused, strict=True))
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        if ids:
            input_ids[row, width - len(ids) :] = torch.tensor(list(ids), dtype=torch.long)
            mask[row, width - len(ids) :] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    if past > 0:
        _preload(cache, entries, prompts, reused, width, past)
    out = model(
        input_ids=input_ids[:, past:], attention_mask=mask, position_ids=positions[:, past:],
        past_key_values=cache, use_cache=True, logits_to_keep=1,
    )  # fmt: skip
    return cache, out.logits[:, -1, :], mask, positions[:, -1:] + 1


MIN_SHARED_PREFIX = 8  # tokens every prompt of a call shares, below which they are encoded with each row


def _shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """The length of the prefix all ``prompts`` share."""
    first = list(prompts[0])
    shared = len(first)
    for p in prompts[1:]:
        n = min(shared, len(p))
        same = [a == b for a, b in zip(first[:n], p[:n], strict=True)]
        shared = same.index(False) if False in same else n
        if shared == 0:
            break
    return shared


def _encode_alone(model, ids: Sequence[int], layers: int, device) -> tuple[torch.Tensor, list]:
    """(tokens, per-layer keys/values) of ``ids`` encoded by themselves."""
    cache = Cache(layers=[GrowingLayer(0) for _ in range(layers)])
    tokens = torch.tensor([list(ids)], dtype=torch.long, device=device)
    positions = torch.arange(tokens.shape[1], device=device)[None]
    model(input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return tokens[0].cpu(), [layer.row(0, 0) for layer in cache.layers]


def _preload(cache: Cache, entries, prompts, reused, width: int, past: int) -> None:
    """Fill the cache's columns [0, past) with each row's reused keys/values (left padding: zeros)."""
    for i, layer in enumerate(cache.layers):
        like_k, like_v = next(kv[i] for _, kv in entries)
        keys = like_k.new_zeros((len(prompts), like_k.shape[0], past, like_k.shape[2]))
        values = like_v.new_zeros((len(prompts), like_v.shape[0], past, like_v.shape[2]))
        for row, (p, (e, _)) in enumerate(zip(prompts, reused, strict=True)):
            count = past - (width - len(p))  # this row's tokens left of the forward block
            if count > 0:
                k, v = entries[e][1][i]
                keys[row, :, past - count :] = k[:, :count]
                values[row, :, past - count :] = v[:, :count]
        layer.preload(keys, values)


@torch.inference_mode()
def decode_invariant(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling,
    pad_token_id: int,
    logprobs: bool = True,
    rows_per_forward: int = 16,
) -> list[tuple[list[int], list[float]]]:
    """:func:`decode` whose every row is computed exactly as when it is decoded alone (greedy: same tokens).

    A CPU matmul's rounding depends on how many rows it multiplies, and an attention kernel's on how much
    padding precedes a row's keys, so a batched greedy decode can write other text than one request at a
    time. Here each prompt is encoded alone (no padding), every decode step runs the model on exactly
    ``rows_per_forward`` rows (short batches are filled with rows that attend to nothing but themselves;
    rows that stop stay until the batch ends), and each row attends to its own keys only. The cost: the
    prompts are encoded one by one, and batches keep their full width.
    """
    out: list[tuple[list[int], list[float]]] = []
    for start in range(0, len(prompts), rows_per_forward):
        chunk = prompts[start : start + rows_per_forward]
        out += _decode_rows_alone(
            model, tokenizer, chunk, max_new_tokens, rows_per_forward, sampling=sampling,
            pad_token_id=pad_token_id, logprobs=logprobs,
        )  # fmt: skip
    return out


def _decode_rows_alone(
    model, tokenizer, prompts, max_new_tokens, width_rows, *, sampling: Sampling, pad_token_id, logprobs
):
    temperature, top_p, stop_strings = sampling.temperature, sampling.top_p, sampling.stop_strings
    eos_token_ids = sampling.eos_ids(tokenizer)
    device = next(model.parameters()).device
    n = len(prompts)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    width = max(len(p) for p in prompts)
    first_logits, row_caches = [], []
    for ids in prompts:  # each prompt alone: what a one-request call computes
        row_cache = Cache(layers=[GrowingLayer(0) for _ in range(layers)])
        ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        positions = torch.arange(ids.shape[1], device=device)[None]
        result = model(
            input_ids=ids, position_ids=positions, past_key_values=row_cache, use_cache=True, logits_to_keep=1
        )
        first_logits.append(result.logits[0, -1])
        row_caches.append(row_cache)
    cache = Cache(layers=[GrowingLayer(max_new_tokens) for _ in range(layers)])
    for i, layer in enumerate(cache.layers):
        k0 = row_caches[0].layers[i].keys
        keys = k0.new_zeros((width_rows, k0.shape[1], width, k0.shape[3]))
        values = torch.zeros_like(keys)
        for row, rc in enumerate(row_caches):
            length = rc.layers[i].length
            keys[row, :, width - length :] = rc.layers[i].keys[0, :, :length]
            values[row, :, width - length :] = rc.layers[i].values[0, :, :length]
        layer.preload(keys, values)
    del row_caches
    # a filler row starts at the column of its first fed token: it attends to its own tokens only
    starts = [width - len(p) for p in prompts] + [width] * (width_rows - n)
    next_pos = torch.tensor([len(p) for p in prompts] + [0] * (width_rows - n), device=device)
    logits = torch.stack(first_logits)
    scale = temperature if temperature > 0 else 1.0
    tokens: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    live = list(range(n))
    scanner = StopScanner(tokenizer, stop_strings, n)
    feed = torch.full((width_rows,), pad_token_id, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        chosen, picked = _pick(logits, temperature, top_p, scale, logprobs)
        still = []
        for row, tok, lp in zip(live, chosen.tolist(), picked, strict=True):
            tokens[row].append(tok)
            logps[row].append(lp)
            feed[row] = tok
            if tok not in eos_token_ids and not scanner.hit(row, tok):
                still.append(row)
        live = still
        if not live or step == max_new_tokens - 1:
            break
        result = model(
            input_ids=feed[:, None], position_ids=next_pos[:, None], past_key_values=cache, use_cache=True,
            row_starts=starts,
        )  # fmt: skip
        logits = result.logits[live, -1]
        next_pos = next_pos + 1
    return list(zip(tokens, logps, strict=True))


class attention_implementation:
    """Context manager: run ``model`` with the attention implementation ``name``, then restore its own."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name

    def __enter__(self):
        self.previous = self.model.config._attn_implementation
        if self.previous != self.name:
            self.model.set_attn_implementation(self.name)
        return self.model

    def __exit__(self, *exc):
        if self.previous != self.name:
            self.model.set_attn_implementation(self.previous)
