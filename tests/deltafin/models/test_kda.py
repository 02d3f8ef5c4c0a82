"""Kimi Delta Attention: the chunked form equals the recurrence, and its pieces equal their plain forms."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltafin.models import kda
from deltafin.models.common import l2_normalize


def _delta_inputs(t: int, h: int = 3, d: int = 16, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(t, h, d, generator=g, dtype=dtype), 1e-6) * d ** -0.5
    k = l2_normalize(torch.randn(t, h, d, generator=g, dtype=dtype), 1e-6)
    v = torch.randn(t, h, d, generator=g, dtype=dtype)
    decay = -5 * torch.sigmoid(2 * torch.randn(t, h, d, generator=g, dtype=dtype))
    beta = torch.sigmoid(torch.randn(t, h, generator=g, dtype=dtype))
    S0 = torch.randn(h, d, d, generator=g, dtype=dtype) * 0.1
    return q, k, v, decay, beta, S0


def test_chunked_kda_equals_recurrent():
    for t in (1, 5, 16, 37, 70):  # shorter than, equal to and across several chunks, with padding
        args = _delta_inputs(t)
        o_ref, s_ref = kda.delta_rule_recurrent(*args)
        o, s = kda.delta_rule_chunked(*args)
        # float64: the two forms are the same algebra, so only double rounding (~1e-15) separates them
        assert torch.allclose(o, o_ref, rtol=1e-10, atol=1e-12) and torch.allclose(s, s_ref, rtol=1e-10, atol=1e-12)
        o32, s32 = kda.delta_rule_chunked(*(a.float() for a in args))
        per_token = (o32.double() - o_ref).norm(dim=(1, 2)) / o_ref.norm(dim=(1, 2))
        assert per_token.max() < 1e-5  # fp32, chunk 16


def test_the_chunk_length_is_the_more_exact_in_fp32():
    """Why CHUNK is 16: over 256 tokens (3 seeds) a 64-token chunk's (I+A)^-1 loses ~3x more per token to fp32
    rounding (median 6.7-7.5e-7 against 2.4-2.5e-7, measured); asserted with room at 2x."""
    assert kda.CHUNK == 16
    for seed in range(3):
        args = _delta_inputs(256, seed=seed)
        o_ref, _ = kda.delta_rule_recurrent(*args)
        error = {}
        for chunk in (16, 64):
            o32, _ = kda.delta_rule_chunked(*(a.float() for a in args), chunk=chunk)
            error[chunk] = float(((o32.double() - o_ref).norm(dim=(1, 2)) / o_ref.norm(dim=(1, 2))).median())
        assert 2 * error[16] < error[64], error


def test_pair_products_split_at_the_middle_equal_the_pairwise_form():
    """The two-matmul form (decay split at the chunk's middle) == every decay formed from its own difference,
    at K3's bounded gate; with a decay steep enough to overflow a split factor (Kimi Linear's gate is
    unbounded) the pairwise form is taken and the chunked rule still equals the recurrence."""
    q, k, v, decay, beta, S0 = _delta_inputs(64, dtype=torch.float32)
    chunks = [x.view(4, 16, 3, 16).transpose(1, 2) for x in (decay, q, k)]
    G = chunks[0].cumsum(2)
    split, pairwise = kda._pair_products(G, chunks[1], chunks[2]), kda._pair_products_pairwise(G, chunks[1], chunks[2])
    for a, b in zip(split, pairwise, strict=True):
        assert float((a - b).norm() / b.norm()) < 1e-6  # fp32, each product a rounding or two apart
    steep = _delta_inputs(37, seed=1)
    steep = (*steep[:3], steep[3] * 6, *steep[4:])  # up to 30 per token: 240 across half a chunk
    o_ref, s_ref = kda.delta_rule_recurrent(*steep)
    o, s = kda.delta_rule_chunked(*(a.float() for a in steep))
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert float((o.double() - o_ref).norm() / o_ref.norm()) < 1e-5


def test_unit_lower_inverse():
    g = torch.Generator().manual_seed(3)
    A = torch.randn(2, 16, 16, generator=g, dtype=torch.float64).tril(-1)
    eye = torch.eye(16, dtype=torch.float64)
    # float64 products of a 16x16 factorization against LAPACK's inverse: ~1e-13 in practice
    assert torch.allclose(kda._unit_lower_inverse(A), torch.linalg.inv(eye + A), rtol=1e-9, atol=1e-9)


def test_causal_conv_matches_conv1d():
    g = torch.Generator().manual_seed(4)
    z, w = torch.randn(9, 6, generator=g), torch.randn(6, 4, generator=g)
    want = F.conv1d(z.T.unsqueeze(0), w.unsqueeze(1), padding=3, groups=6)[0, :, :9].T
    y, window = kda.causal_conv(z, w, torch.zeros(3, 6))
    assert torch.allclose(y, want, atol=1e-6) and torch.equal(window, z[-3:])  # 4-term fp32 sums, O(1) values
    # continuing from a window equals convolving the whole sequence
    y1, win1 = kda.causal_conv(z[:5], w, torch.zeros(3, 6))
    y2, _ = kda.causal_conv(z[5:], w, win1)
    assert torch.allclose(torch.cat([y1, y2]), want, atol=1e-6)


def test_equal_prefill_spans_run_side_by_side_as_each_alone(tiny_dir):
    """Two prompts of one length in one forward (their heads stacked in one chunk loop) give what each gives
    alone, outputs and caches; a third of another length runs in its own group."""
    cfg, layer, w, fresh = _tiny_kda_layer(tiny_dir)
    g = torch.Generator().manual_seed(3)
    lengths = (24, 24, 9)
    x = torch.randn(sum(lengths), cfg.hidden_size, generator=g)
    caches, spans, start = [], [], 0
    for n in lengths:
        caches.append(fresh().layers[layer])
        spans.append((start, n, caches[-1]))
        start += n
    together = kda.kda_forward(cfg, w, x, spans)
    for (s, n, c) in spans:
        alone_cache = fresh().layers[layer]
        alone = kda.kda_forward(cfg, w, x[s:s + n], [(0, n, alone_cache)])
        # fp32: the same operations per head; the matmuls over more rows at once may round differently (~1e-7)
        assert torch.allclose(together[s:s + n], alone, rtol=1e-5, atol=1e-6)
        assert torch.allclose(c.state, alone_cache.state, rtol=1e-5, atol=1e-6)
        assert c.state.untyped_storage().nbytes() == c.state.numel() * 4  # not a view of the batch's states
        assert torch.allclose(c.conv, alone_cache.conv, rtol=1e-5, atol=1e-6)  # projections of more rows at once


def test_states_taken_inside_a_chunked_run_are_the_runs_to_there():
    """The chunked rule asked for the states after r tokens (inside chunks, at a chunk's end) gives the state a
    run of those r tokens alone ends with; its outputs and final state are unchanged by the asking."""
    args = _delta_inputs(70)
    o_plain, s_plain = kda.delta_rule_chunked(*args)
    taken: dict[int, torch.Tensor] = dict.fromkeys((1, 7, 16, 33, 69))  # type: ignore[arg-type]
    o, s = kda.delta_rule_chunked(*args, taken=taken)
    assert torch.equal(o, o_plain) and torch.equal(s, s_plain)
    q, k, v, g, beta, S0 = args
    for r, state in taken.items():
        _, want = kda.delta_rule_recurrent(q[:r], k[:r], v[:r], g[:r], beta[:r], S0)
        # float64: the same algebra, chunked up to the chunk's start then token by token
        assert torch.allclose(state, want, rtol=1e-10, atol=1e-12), r


def _tiny_kda_layer(tiny_dir):
    from deltafin.checkpoint.config import load_config
    from deltafin.mini.train import load_parameters
    from deltafin.models.cache import new_sequence_cache
    from deltafin.models.weights import layer_weights

    cfg = load_config(tiny_dir)
    layer = cfg.kda_layers[0]
    prefix = f"model.layers.{layer}."
    params = load_parameters(cfg, tiny_dir, torch.device("cpu"))
    tensors = {k.removeprefix(prefix): v.detach() for k, v in params.items() if k.startswith(prefix)}
    w = layer_weights(cfg, layer, tensors, lambda t, role: t).attn
    fresh = lambda: new_sequence_cache(cfg, range(cfg.num_layers), torch.device("cpu"), torch.float32)
    return cfg, layer, w, fresh


def test_a_layer_takes_marked_states_in_one_run_and_in_pieces(tiny_dir):
    """A KDA layer whose cache is marked at some offsets takes, as it runs, the conv window and state a run
    of only that many tokens leaves (in one call and across calls, as a long forward's pieces feed it), and
    its outputs are the unmarked layer's exactly (the marked sequence runs alone, not beside another)."""
    cfg, layer, w, fresh = _tiny_kda_layer(tiny_dir)
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    plain = fresh()
    out_plain = kda.kda_forward(cfg, w, x, [(0, 40, plain.layers[layer])])
    marks = [3, 16, 25, 39]
    for cuts in ((40,), (16, 24), (10, 15, 15)):  # one call, or pieces: 16 then 24 (a mark at a call's end)
        marked = fresh()
        marked.mark(marks)
        c, at, outs = marked.layers[layer], 0, []
        for n in cuts:
            outs.append(kda.kda_forward(cfg, w, x[at:at + n], [(0, n, c)]))
            at += n
        if cuts == (40,):
            assert torch.equal(torch.cat(outs), out_plain) and torch.equal(c.state, plain.layers[layer].state)
        assert sorted(c.taken) == marks
        for r in marks:
            alone = fresh()
            kda.kda_forward(cfg, w, x[:r], [(0, r, alone.layers[layer])])
            conv, state = c.taken[r]
            # fp32: the same steps, chunked from another start (one rounding order or another, ~1e-7)
            assert torch.allclose(conv, alone.layers[layer].conv, rtol=1e-5, atol=1e-6), (cuts, r)
            assert torch.allclose(state, alone.layers[layer].state, rtol=1e-4, atol=1e-6), (cuts, r)
