"""The routed experts' weighted sum as a holder of wide experts computes its share: each token's pairs summed, the
products the one-process path's; a token with all its pairs in one place sums to the one-process bits."""

from __future__ import annotations

import torch

from deltafin.models.moe import weighted_row_sums


def test_each_row_sums_its_pairs_weighted_outputs():
    g = torch.Generator().manual_seed(0)
    out, weights = torch.randn(7, 5, generator=g), torch.rand(7, generator=g)
    rows = torch.tensor([0, 0, 0, 2, 2, 3, 3])  # row 1 has no pair here: zeros
    got = weighted_row_sums(out, rows, weights, 4)
    want = torch.zeros(4, 5, dtype=torch.float64)
    for p, r in enumerate(rows.tolist()):
        want[r] += out[p].double() * weights[p].double()
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(got[1], torch.zeros(5))


def test_every_pair_of_a_token_in_one_place_is_the_one_process_sum_bit_for_bit():
    """One holder of all k pairs: the same products summed as the local path's [N, k, De] block is."""
    g = torch.Generator().manual_seed(1)
    n, k, d = 6, 16, 32
    out, weights = torch.randn(n * k, d, generator=g), torch.rand(n, k, generator=g)
    local = out.view(n, k, d).clone().mul_(weights.unsqueeze(-1)).sum(1)
    got = weighted_row_sums(out, torch.arange(n).repeat_interleave(k), weights.reshape(-1), n)
    assert torch.equal(got, local)


def test_some_rows_alone_sum_to_the_same_bits_as_in_the_whole():
    """A holder sends rows as they are done: a subset's sums are the whole call's rows, bit for bit, whatever the
    subset's own widest row (the padding width is the call's)."""
    g = torch.Generator().manual_seed(2)
    n, d = 50, 64
    counts = torch.randint(1, 9, (n,), generator=g)
    rows = torch.arange(n).repeat_interleave(counts)
    out, weights = torch.randn(rows.shape[0], d, generator=g), torch.rand(rows.shape[0], generator=g)
    whole = weighted_row_sums(out, rows, weights, n)
    for only in (torch.tensor([3]), torch.tensor([0, 7, 49]), counts.argsort()[:20].sort().values, torch.arange(n)):
        assert torch.equal(weighted_row_sums(out, rows, weights, n, only=only), whole[only])
