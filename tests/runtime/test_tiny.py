"""kiln-tiny: deterministic weights and tokenizer, size rules, a small state dict."""

from __future__ import annotations

import pytest
import torch

from runtime.models.tiny import BOS_ID, PAD_ID, TinyConfig, TinyTokenizer, build_tiny


def test_build_tiny_gives_identical_weights_every_time_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = build_tiny(), build_tiny()
    assert torch.equal(torch.rand(1), before)  # fork_rng: the caller's stream is untouched
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tokenizer_hashes_words_stably_with_bos_and_padding():
    tok = TinyTokenizer(vocab_size=4096, max_length=8)
    ids, mask = tok(["A red Circle!", ""])
    assert ids[0, 0] == BOS_ID and ids[1, 0] == BOS_ID
    assert ids[0, 1:4].tolist() == [tok.word_id("a"), tok.word_id("red"), tok.word_id("circle")]
    assert ids[0, 4:].eq(PAD_ID).all() and ids[1, 1:].eq(PAD_ID).all()
    assert mask.sum(1).tolist() == [4, 1]
    long_ids, _ = tok([" ".join(["word"] * 20)])
    assert long_ids.shape == (1, 8) and long_ids.ne(PAD_ID).all()


def test_tiny_rejects_frame_counts_and_sizes_it_cannot_render():
    cfg = TinyConfig()
    cfg.check_video_size(64, 64, 9)
    with pytest.raises(ValueError, match="1 \\+ 4k frames"):
        cfg.check_video_size(64, 64, 8)
    with pytest.raises(ValueError, match="multiples of 16"):
        cfg.check_video_size(60, 64, 9)


def test_tiny_is_a_few_megabytes_with_most_weights_in_the_streamed_blocks():
    model = build_tiny()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = sum(p.numel() * p.element_size() for p in model.transformer.blocks.parameters())
    assert total < 20 * 2**20
    assert blocks > 0.5 * sum(p.numel() * p.element_size() for p in model.transformer.parameters())


def test_tiny_transformer_keeps_the_latent_shape():
    model = build_tiny()
    x = torch.randn(1, model.cfg.latent_channels, 3, 8, 8)
    text = model.text_encoder(*model.tokenizer(["a cat"]))
    out = model.transformer(x, torch.tensor([500.0]), text)
    assert out.shape == x.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("tokens", [48, 512, 2304])
def test_sliced_self_attention_equals_the_batched_call_bit_for_bit(threads, tokens):
    from runtime.models.tiny import SlicedAttention, _attention

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(tokens)
        for b, heads, d in ((2, 4, 128), (1, 3, 96)):
            q, k, v = (torch.randn(b, tokens, d, generator=g) for _ in range(3))
            assert torch.equal(SlicedAttention(heads)(q, k, v), _attention(q, k, v, heads))
    finally:
        torch.set_num_threads(before)


def test_a_long_self_attention_runs_in_slices_that_hooks_see():
    """The hooks that leave a step part-way run between the slices of a long attention."""
    from runtime.models.tiny import SlicedAttention

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        attention, calls = SlicedAttention(4), []
        attention.slice.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
        attention(*(torch.randn(2, 1024, 128) for _ in range(3)))
        assert calls == [torch.Size([1, 1, 1024, 32])] * 8  # every batch row, every head
        calls.clear()
        attention(*(torch.randn(2, 48, 128) for _ in range(3)))  # short: one call, no slices
        assert calls == []
    finally:
        torch.set_num_threads(before)
