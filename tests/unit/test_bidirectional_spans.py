"""Bidirectional prompt spans (Gemma 3's image tokens) in paged attention, against Hugging Face.

The reference attends each sequence's queries over its whole context read back from the cache,
under the dense mask Hugging Face's Gemma 3 builds for that sequence (`create_masks_for_vision_model`
on its token types: OR(causal, same image run) for full layers, AND(window, OR(...)) for sliding
ones), float32. The batch mixes a fresh prompt with spans, a later chunk with a span beside earlier
context in the cache, sequences without spans (fresh and later) and a decode.
"""

from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch
from transformers import Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import (
    create_masks_for_vision_model,
    get_block_sequence_ids_for_mask,
)

from workers.kernels import kernel_library
from workers.layers.attention import Attention, AttentionMetadata, build_attention_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 8, 4
CPU = torch.device("cpu")
KERNEL = [False, True] if kernel_library.load() is not None else [False]

# (start position, query tokens, spans): spans as the caller passes them, the prompt's all.
BATCH = [
    (0, 14, [(3, 3), (6, 2), (10, 1)]),  # fresh: two touching spans (one run, as HF), a lone token
    (9, 12, [(2, 4), (11, 6)]),  # a later chunk: one span in the cache, one in this chunk
    (5, 7, []),  # a later chunk without spans
    (0, 8, []),  # a fresh prompt without spans: stays causal (is_causal)
    (20, 1, [(4, 6)]),  # a decode after an image prompt
    (0, 9, [(1, 8)]),  # fresh, a span reaching the chunk's end
]


def _tables(seed: int, num_blocks: int) -> list[list[int]]:
    """Scattered block tables for BATCH."""
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(-(-(s + n) // BLOCK_SIZE))] for s, n, _ in BATCH]


def _hf_masks(context: int, spans: list[tuple[int, int]], window: int | None) -> torch.Tensor:
    """(context, context) Hugging Face Gemma 3's mask over a whole sequence with these spans."""
    config = Gemma3TextConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        sliding_window=window or 4,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    token_types = torch.zeros(1, context, dtype=torch.int64)
    for first, length in spans:
        token_types[0, first : first + length] = 1
    masks = create_masks_for_vision_model(
        config, torch.zeros(1, context, 8), None, None, torch.arange(context)[None],
        get_block_sequence_ids_for_mask(token_types),
    )  # fmt: skip
    return masks["full_attention" if window is None else "sliding_attention"][0, 0]


def _reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: list[list[int]],
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    out, offset = [], 0
    for table, (start, n, spans) in zip(tables, BATCH):
        context = start + n
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in
                              range(context)])  # fmt: skip
        k = cache[0].flatten(0, 1)[slots].transpose(0, 1)  # (Hkv, context, D)
        v = cache[1].flatten(0, 1)[slots].transpose(0, 1)
        mask = _hf_masks(context, spans, window)[start:]  # (n, context)
        qs = q[offset : offset + n].transpose(0, 1)  # (H, n, D)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
        scores = qs @ k.transpose(-1, -2) * HEAD_DIM**-0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out.append((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1))
        offset += n
    return torch.cat(out)


def _step(
    window: int | None,
    softcap: float | None,
    use_kernel: bool,
    decode_rows: list[bool] | None = None,
    with_spans: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(the layer's output, the reference, the metadata) for BATCH; the earlier context's K/V
    are random in the cache, the step's own go in with the forward."""
    tables = _tables(0, 40)
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 40, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
    num_tokens = sum(n for _, n, _ in BATCH)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g)
    meta = build_attention_metadata(
        [s for s, _, _ in BATCH], [n for _, n, _ in BATCH], tables, BLOCK_SIZE, CPU,
        decode_rows=decode_rows,
        bidirectional_spans=[spans for _, _, spans in BATCH] if with_spans else None,
    )  # fmt: skip
    attn = Attention(HEADS, HEAD_DIM, KV_HEADS, HEAD_DIM**-0.5, window, softcap)
    attn.has_decode_kernel = use_kernel
    attn.kv_cache = cache
    out = attn(q, k, v, meta)
    return out, _reference(q, cache, tables, window, softcap), meta


@pytest.mark.parametrize("use_kernel", KERNEL)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("window", [None, 4, 7, 100])
def test_matches_hugging_face_masks(
    window: int | None, softcap: float | None, use_kernel: bool
) -> None:
    """Full layers and sliding ones (windows shorter than a span: HF bounds the span by the window
    counted from the query), SDPA and the explicit softcapped scores, the decode by the kernel or
    the padded path."""
    out, ref, _ = _step(window, softcap, use_kernel)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_spans_change_the_output() -> None:
    """The test could not pass with the spans ignored: their queries see later keys."""
    out, _, _ = _step(None, None, False)
    causal, _, _ = _step(None, None, False, with_spans=False)
    assert not torch.allclose(causal[3:8], out[3:8], atol=1e-3)  # the first prompt's run
    # The tokens before it: the same up to the rounding of the masked group's attention kernel,
    # which differs from the causal one's by a few ulps on some CPUs (AVX512).
    torch.testing.assert_close(causal[:3], out[:3], atol=1e-6, rtol=1e-6)


def test_sequences_with_spans_never_take_decode_rows() -> None:
    """A prompt with spans marked as decode rows (--batch-invariant) still attends both ways."""
    out, ref, meta = _step(4, None, False, decode_rows=[True] * len(BATCH))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert meta.decode is not None and not meta.decode.is_whole_batch


def test_groups_of_the_mixed_batch() -> None:
    """Fresh prompts without spans keep the is_causal group; those with spans join the masked one."""
    _, _, meta = _step(None, None, False)
    fresh, masked = meta.groups
    assert fresh.kv_blocks is None and fresh.mask is None
    assert fresh.q_tokens.tolist() == list(range(33, 41))  # the fourth sequence only
    assert masked.kv_blocks is not None and masked.kv_blocks.size(0) == 4  # seqs 0, 1, 2, 5
    assert meta.decode is not None and meta.decode.q_tokens.tolist() == [41]


def _assert_same_metadata(a: AttentionMetadata, b: AttentionMetadata) -> None:
    def same(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        return x == y

    for f in fields(AttentionMetadata):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("groups", "span_groups"):
            assert len(x) == len(y)
            for gx, gy in zip(x, y):
                for gf in fields(gx):
                    assert same(getattr(gx, gf.name), getattr(gy, gf.name)), gf.name
        elif f.name in ("decode", "prefill"):
            assert (x is None) == (y is None)
            if x is not None:
                for df in fields(x):
                    assert same(getattr(x, df.name), getattr(y, df.name)), df.name
        elif f.name == "other_kv_groups":
            assert len(x) == len(y)
            for ox, oy in zip(x, y):
                _assert_same_metadata(ox, oy)
        else:
            assert same(x, y), f.name


@pytest.mark.parametrize("decode_only", [False, True])
def test_without_spans_the_metadata_is_unchanged(decode_only: bool) -> None:
    """No spans, empty lists, and spans that do not change the step (in the cache already, one
    token long) build the very tensors of a call without the argument."""
    if decode_only:
        start_pos, query_lens = [3, 17, 30], [1, 1, 1]
        idle = [[(0, 3)], [(2, 1), (5, 7)], []]
    else:
        start_pos, query_lens = [0, 9, 5, 12], [14, 12, 7, 1]
        idle = [[(10, 1)], [(2, 4), (21, 9)], [], [(0, 12)]]
    rng = random.Random(2)
    tables = [[rng.randrange(60) for _ in range(-(-(s + n) // 4))]
              for s, n in zip(start_pos, query_lens)]  # fmt: skip
    others = [[[rng.randrange(60) for _ in t] for t in tables]]
    for other in (None, others):
        plain = build_attention_metadata(start_pos, query_lens, tables, 4, CPU, other)
        for spans in ([[] for _ in start_pos], idle):
            with_arg = build_attention_metadata(
                start_pos, query_lens, tables, 4, CPU, other, bidirectional_spans=spans
            )
            _assert_same_metadata(with_arg, plain)


def test_other_kv_groups_read_their_own_tables() -> None:
    """A further KV-cache group (Gemma 3's sliding layers) attends the masked group with spans
    through its own block tables: the same K/V placed by other tables give the same output."""
    start_pos, query_lens, spans = [0, 6], [10, 8], [[(2, 5)], [(7, 4)]]
    tables = [[5, 1, 9], [0, 3, 7, 2]]
    moved = [[11, 4, 8], [10, 6, 12, 13]]
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 14, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
    moved_cache = torch.zeros_like(cache)
    for old, new in zip(tables, moved):
        moved_cache[:, new] = cache[:, old]
    q = torch.randn(18, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(18, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(18, KV_HEADS, HEAD_DIM, generator=g)
    meta = build_attention_metadata(
        start_pos, query_lens, tables, BLOCK_SIZE, CPU, [moved], bidirectional_spans=spans
    )
    outs = []
    for group, kv in ((0, cache), (1, moved_cache)):
        attn = Attention(HEADS, HEAD_DIM, KV_HEADS, HEAD_DIM**-0.5, sliding_window=3)
        attn.kv_cache = kv
        outs.append(attn(q, k, v, meta.for_kv_group(group)))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_a_span_split_by_the_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match=r"span \[4, 10\) is split"):
        build_attention_metadata([0], [8], [[0, 1]], 4, CPU, bidirectional_spans=[[(4, 6)]])
    with pytest.raises(ValueError, match=r"span \[2, 6\) is split"):
        build_attention_metadata([4], [4], [[0, 1]], 4, CPU, bidirectional_spans=[[(2, 4)]])
