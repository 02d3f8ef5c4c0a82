"""Kimi Delta Attention (K3_SPEC §3): short convolutions, per-channel decay, the delta rule.

Shapes: N = packed tokens, T = one sequence's tokens, H = heads, d = head dim (dk = dv = d),
P = H * d, K = conv kernel, C = chunk length. The delta rule runs in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from deltafin.checkpoint.config import ModelConfig
from deltafin.kernels.linear import linear
from deltafin.models.cache import KDACache, KDATrail
from deltafin.models.common import l2_normalize, rms_norm
from deltafin.models.weights import KDAWeights

CHUNK = 16  # in fp32 a 64-token chunk's (I+A)^-1 loses over 2x more per token (tests/deltafin/models/test_kda.py)
_PAIR_BUDGET = 1 << 24  # floats in one [heads, C, C, d] decay block (64 MB): bounds prefill memory


def causal_conv(z: torch.Tensor, kernel: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv: y[t,c] = sum_j kernel[c,j] * z[t-K+1+j, c], earlier inputs from `window`.

    z [..., T, P], kernel [P, K], window [..., K-1, P] (fp32; leading dims: sequences run side by side).
    Returns (y [..., T, P] fp32, new window [..., K-1, P])."""
    k = kernel.shape[1]
    full = torch.cat([window, z.float()], dim=-2)  # [..., K-1+T, P]
    y = (full.unfold(-2, k, 1) * kernel).sum(-1)  # unfold: [..., T, P, K]
    return y, full[..., full.shape[-2] - (k - 1):, :]


def kda_decay(cfg: ModelConfig, w: KDAWeights, graw: torch.Tensor) -> torch.Tensor:
    """Log-decay g [T, H, d] (fp32, < 0): K3 lb*sigmoid(exp(A)*(x+dt)); Kimi Linear -exp(A)*softplus(x+dt)."""
    x = graw.float().view(-1, cfg.kda_heads, cfg.kda_head_dim) + w.dt_bias
    rate = w.a_log.exp().unsqueeze(-1)  # [H, 1]
    if cfg.gate_lower_bound is not None:
        return cfg.gate_lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x)


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact recurrence, one token at a time. q, k [T,H,dk]; v [T,H,dv]; g [T,H,dk]; beta [T,H];
    S [H,dk,dv]. Per head: S = S*exp(g); u = v - S^T k; S += beta*k u^T; o = S^T q."""
    outs = []
    for t in range(q.shape[0]):
        S = S * g[t].exp().unsqueeze(-1)
        u = (v[t] - torch.bmm(k[t].unsqueeze(1), S).squeeze(1)) * beta[t].unsqueeze(-1)  # [H, dv]
        S = S + k[t].unsqueeze(-1) * u.unsqueeze(1)
        outs.append(torch.bmm(q[t].unsqueeze(1), S).squeeze(1))
    return torch.stack(outs), S


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C]: A is nilpotent, so the Neumann series is
    finite and factors as (I - A)(I + A^2)(I + A^4)...: log2(C) matmuls, no triangular solve needed."""
    c = A.shape[-1]
    eye = torch.eye(c, dtype=A.dtype, device=A.device)
    result, power, span = eye - A, A @ A, 2
    while span < c:
        result = result @ (eye + power)
        power = power @ power
        span *= 2
    return result


_SAFE_EXPONENT = 80.0  # e^80 = 5.5e34: times |q|,|k| ~ 1 summed over 128 channels stays below fp32's 3.4e38


def _pair_products(G: torch.Tensor, Q: torch.Tensor, K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KK[h,i,j] = sum_c k_i k_j e^(G_i-G_j) (j < i) and QK[h,i,j] = sum_c q_i k_j e^(G_i-G_j) (j <= i).

    Two matmuls with the decay split at the chunk's middle row m: e^(G_i-G_j) = e^(G_i-G_m) e^(G_m-G_j).
    Each factor's exponent is at most half the chunk's decay span (K3: 8 tokens * |lb| = 40), never the
    e^-G of the whole prefix, which overflows. When some chunk's span would overflow a factor (possible with
    Kimi Linear's unbounded gate), the call takes the pairwise form instead."""
    c = K.shape[-2]
    mid = G[..., c // 2:c // 2 + 1, :]
    if float((G - mid).detach().abs().amax()) > _SAFE_EXPONENT:
        return _pair_products_pairwise(G, Q, K)
    Kj = (K * (mid - G).exp()).transpose(-1, -2)  # k_j e^(G_m - G_j), [.., d, C(j)]
    after = (G - mid).exp()  # e^(G_i - G_m)
    kk, qk = (K * after) @ Kj, (Q * after) @ Kj
    lower = torch.ones(c, c, dtype=torch.bool, device=K.device).tril()
    return kk.masked_fill_(~lower.tril(-1), 0.0), qk.masked_fill_(~lower, 0.0)


def _pair_products_pairwise(G: torch.Tensor, Q: torch.Tensor, K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same products with every decay formed from its own difference (e^(G_i-G_j), j <= i, at most 1):
    [.., C, C, d] per group of rows, within _PAIR_BUDGET floats."""
    lead, (c, d) = K.shape[:-2], K.shape[-2:]
    G, Q, K = (x.reshape(-1, c, d) for x in (G, Q, K))
    lower = torch.ones(c, c, dtype=torch.bool, device=K.device).tril()
    group = max(1, _PAIR_BUDGET // (c * c * d))
    kk, qk = [], []
    for s in range(0, K.shape[0], group):
        Gs, Ks, Qs = G[s:s + group], K[s:s + group], Q[s:s + group]
        decay = (Gs.unsqueeze(2) - Gs.unsqueeze(1)).masked_fill(~lower.unsqueeze(-1), float("-inf")).exp()
        Kj = Ks.unsqueeze(1)  # [h, 1, C(j), d]
        kk.append(((Ks.unsqueeze(2) * decay) * Kj).sum(-1))
        qk.append(((Qs.unsqueeze(2) * decay) * Kj).sum(-1))
    strict = lower.tril(-1)
    return (torch.cat(kk).masked_fill(~strict, 0.0).view(*lead, c, c),
            torch.cat(qk).view(*lead, c, c))


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       S: torch.Tensor, chunk: int = CHUNK,
                       taken: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence in chunked (WY) form for prefill; shapes as `delta_rule_recurrent`. `taken`: positions
    (0 < r < T) whose state is wanted too, filled in place; outputs and final state are the same as without.

    Within a chunk, G = cumsum(g): A = diag(beta) KK (strictly lower), Tinv = (I + A)^-1,
    W = Tinv (beta*e^G*K), U = Tinv (beta*V), V' = U - W S, O = (e^G*Q) S + QK V',
    S <- e^G_C * S + (e^(G_C - G)*K)^T V'. Padding rows have k = v = g = beta = 0.
    Everything that does not involve S is computed for all chunks at once; only the state's passage from
    chunk to chunk is a loop (three small matmuls a chunk)."""
    t, h, dk = k.shape
    pad = (-t) % chunk
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (t + pad) // chunk
    as_chunks = lambda x: x.reshape(n, chunk, h, -1).transpose(1, 2)  # [n, H, C, *]
    qc, kc, vc, gc = (as_chunks(x) for x in (q, k, v, g))
    bc = beta.reshape(n, chunk, h).transpose(1, 2).unsqueeze(-1)  # [n, H, C, 1]
    G = gc.cumsum(2)
    KK, QK = _pair_products(G, qc, kc)  # [n, H, C, C]
    Tinv = _unit_lower_inverse(bc * KK)
    eG = G.exp()
    W = Tinv @ (bc * eG * kc)  # [n, H, C, dk]
    U = Tinv @ (bc * vc)  # [n, H, C, dv]
    Qg = qc * eG
    Gc = G[:, :, -1:, :]  # [n, H, 1, dk]
    Kd = ((Gc - G).exp() * kc).transpose(2, 3)  # [n, H, dk, C]
    keep = Gc.transpose(2, 3).exp()  # [n, H, dk, 1]
    outs = []
    for i in range(n):
        Vp = U[i] - W[i] @ S
        outs.append(Qg[i] @ S + QK[i] @ Vp)
        _take_inside(taken or {}, i * chunk, (i + 1) * chunk, (k, v, g, beta), S)
        S = keep[i] * S + Kd[i] @ Vp
        if taken and (i + 1) * chunk in taken:
            taken[(i + 1) * chunk] = S
    out = torch.stack(outs).transpose(1, 2).reshape(n * chunk, h, -1)
    return out[:t], S


def _take_inside(taken: dict[int, torch.Tensor], a: int, b: int, kvgb: tuple[torch.Tensor, ...],
                 S: torch.Tensor) -> None:
    """The states wanted strictly inside chunk [a, b): its first state `S` carried on by the exact recurrence
    (the outputs are not needed: any query will do, k)."""
    k, v, g, beta = kvgb
    for r in [r for r in taken if a < r < b]:
        taken[r] = delta_rule_recurrent(k[a:r], k[a:r], v[a:r], g[a:r], beta[a:r], S)[1]


def kda_forward(cfg: ModelConfig, w: KDAWeights, x: torch.Tensor,
                spans: Sequence[tuple[int, int, KDACache]]) -> torch.Tensor:
    """One KDA layer over packed tokens x [N, D]. `spans` are (start, length, cache) per sequence; caches
    are updated. A one-token span (decode) runs the recurrence; longer spans (prefill) the chunked form, but
    for a speculative sequence (`cache.speculative`), which runs the recurrence and leaves a `KDATrail` so
    that its state after any of its tokens can be recomputed exactly (cache.SequenceCache.rewind).
    Prefill spans of one length run side by side, their heads stacked (heads are independent): one chunk
    loop for a batch of equal prompts (a training batch), not one per prompt."""
    n_tok = x.shape[0]
    h, d = cfg.kda_heads, cfg.kda_head_dim
    proj = torch.stack([linear(x, w.q), linear(x, w.k), linear(x, w.v)])  # [3, N, P]
    graw = linear(linear(x, w.f_a), w.f_b)
    beta = torch.sigmoid(linear(x, w.b).float())  # [N, H]
    gate = linear(x, w.g) if w.g is not None else linear(linear(x, w.g_a), w.g_b)
    groups = _side_by_side(spans)
    if len(groups) == 1 and len(groups[0]) == 1:  # one sequence: its rows are all of x
        o = _delta_rule_group(cfg, w, proj, graw, beta, groups[0])
    else:
        o = torch.empty(n_tok, h, d, device=x.device)
        for group in groups:
            rows = torch.cat([torch.arange(s, s + n) for s, n, _ in group]).to(x.device)
            o[rows] = _delta_rule_group(cfg, w, proj[:, rows], graw[rows], beta[rows], group)
    o = rms_norm(o, None, cfg.rms_norm_eps) * w.o_norm * torch.sigmoid(gate.float().view(n_tok, h, d))
    return linear(o.reshape(n_tok, h * d).to(x.dtype), w.o)


def _side_by_side(spans: Sequence[tuple[int, int, KDACache]]) -> list[list[tuple[int, int, KDACache]]]:
    """Spans grouped to run together: non-speculative prefill spans of equal length share a group; decode
    and speculative spans run alone (their recurrence is per token anyway), and so do spans whose states are
    taken inside the forward (cache.KDACache.marks)."""
    groups: dict[int, list[tuple[int, int, KDACache]]] = {}
    alone = []
    for span in spans:
        if span[1] > 1 and not span[2].speculative and not span[2].marks:
            groups.setdefault(span[1], []).append(span)
        else:
            alone.append([span])
    return [*groups.values(), *alone]


def _delta_rule_group(cfg: ModelConfig, w: KDAWeights, proj: torch.Tensor, graw: torch.Tensor, beta: torch.Tensor,
                      group: Sequence[tuple[int, int, KDACache]]) -> torch.Tensor:
    """B sequences of T tokens each (rows sequence after sequence): conv, the delta rule with the B sequences'
    heads stacked, their caches updated -> [B*T, H, d] fp32."""
    b, t = len(group), group[0][1]
    h, d = cfg.kda_heads, cfg.kda_head_dim
    caches = [c for _, _, c in group]
    windows = torch.stack([c.conv for c in caches], dim=1)  # [3, B, K-1, P]
    ys, win = zip(*(causal_conv(proj[j].view(b, t, -1), w.conv[j], windows[j]) for j in range(3)), strict=True)
    qkv = [F.silu(y).view(b, t, h, d) for y in ys]
    q = l2_normalize(qkv[0], cfg.qk_norm_eps) * d ** -0.5
    k = l2_normalize(qkv[1], cfg.qk_norm_eps)
    g = kda_decay(cfg, w, graw).view(b, t, h, d)
    stacked = lambda z: z.transpose(0, 1).reshape(t, b * h, *z.shape[3:])  # [B, T, H, *] -> [T, B*H, *]
    speculative = caches[0].speculative
    rule = delta_rule_recurrent if t == 1 or speculative else delta_rule_chunked
    state = torch.cat([c.state for c in caches])  # [B*H, dk, dv]
    args = (stacked(q), stacked(k), stacked(qkv[2]), stacked(g), stacked(beta.view(b, t, h)))
    if caches[0].marks:  # alone in its group (_side_by_side)
        o, state = _run_taking(rule, caches[0], proj, args, state, t)
    else:
        o, state = rule(*args, state)
    if speculative:  # alone in its group (_side_by_side)
        c = caches[0]
        fed = torch.stack([torch.cat([c.conv[j], proj[j].float()]) for j in range(3)])
        c.trail = KDATrail(fed, c.state, k[0], qkv[2][0], g[0], beta)
    for i, c in enumerate(caches):  # each its own storage: a kept prefix must not hold its batch's states alive
        own = state[i * h:(i + 1) * h]
        c.conv, c.state = torch.stack([wj[i] for wj in win]), own.clone() if b > 1 else own
        if c.marks:
            c.fed += t
            if c.fed in c.marks:  # a mark at this call's end (a long forward runs in pieces)
                c.taken[c.fed] = (c.conv, c.state)
    return o.view(t, b, h, d).transpose(0, 1).reshape(b * t, h, d)


def _run_taking(rule: Callable[..., tuple[torch.Tensor, torch.Tensor]], c: KDACache, proj: torch.Tensor,
                args: tuple[torch.Tensor, ...], state: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rule` over this call's t tokens of one sequence, taking the states its cache's marks ask for inside
    the call (the call's end is the cache's own state, taken by the caller): each one's delta-rule state and
    conv window, in `c.taken` by the mark's offset into the forward."""
    inside = {m - c.fed: m for m in c.marks if c.fed < m < c.fed + t}
    if not inside:
        return rule(*args, state)
    states: dict[int, torch.Tensor] = dict.fromkeys(inside)  # type: ignore[arg-type]
    o, final = rule(*args, state, taken=states)
    full = torch.cat([c.conv, proj.float()], dim=1)  # [3, K-1+t, P]: the window before, then the inputs
    width = c.conv.shape[1]
    for r, m in inside.items():
        c.taken[m] = (full[:, r:r + width].clone(), states[r])
    return o, final
