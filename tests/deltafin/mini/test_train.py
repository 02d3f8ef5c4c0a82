"""k3-mini's training: the forward it trains is the runtime's forward, gradients reach every kind of
parameter, the loss falls, the router is balanced K3's way, and quantized experts are what gets shipped."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.mini import train
from deltafin.models import mla
from deltafin.runtime.pipeline import compute_logits

CPU = torch.device("cpu")


@pytest.fixture()
def tiny(tiny_dir):
    cfg = load_config(tiny_dir)
    return cfg, train.load_parameters(cfg, tiny_dir, CPU)


def _ids(cfg, b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size - 256, (b, t), generator=torch.Generator().manual_seed(seed))


def test_training_forward_is_the_runtime_forward(tiny_dir, tiny):
    """Two sequences side by side in training = each through the serving stack (MXFP4 experts decoded, bf16
    spine), every position; the runtime is the independent path here (stage, weight store, caches)."""
    cfg, params = tiny
    ids = _ids(cfg, 2, 40)
    with torch.no_grad():
        logits = train.forward(cfg, params, ids).view(2, 40, -1)
    for b in range(2):
        served = torch.from_numpy(compute_logits(tiny_dir, ids[b].tolist(), device="cpu"))
        # fp32 both ways; rows batched differently round differently (~1e-6 of the logits' scale)
        assert torch.allclose(logits[b], served, rtol=1e-4, atol=1e-4)
        assert torch.equal(logits[b].argmax(-1), served.argmax(-1))


def test_gradients_reach_every_kind_of_parameter(tiny):
    cfg, params = tiny
    loads: list[torch.Tensor] = []
    train.loss_of(cfg, params, _ids(cfg, 2, 33), loads).backward()
    layer, kda, mla_layer = cfg.moe_layers[0], cfg.kda_layers[0], cfg.mla_layers[0]
    for name in ("model.embed_tokens.weight", "lm_head.weight", f"model.layers.{kda}.self_attn.A_log",
                 f"model.layers.{kda}.self_attn.q_conv1d.weight",
                 f"model.layers.{mla_layer}.self_attn.kv_b_proj.weight",
                 f"model.layers.{layer}.block_sparse_moe.gate.weight", f"model.layers.{layer}.mlp_res_proj.weight",
                 train.experts_name(layer, "w2")):
        assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name
    bias = params[f"model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"]
    assert bias.grad is None and not bias.requires_grad  # balanced by counts, not by gradient
    used = loads[0] > 0  # experts nobody chose get no gradient; the chosen ones do
    grad = params[train.experts_name(layer, "w1")].grad.abs().sum((1, 2))
    assert torch.equal(grad > 0, used)
    assert int(loads[0].sum()) == 2 * 32 * cfg.experts_per_token  # 32 inputs per window of 33


def test_mla_blockwise_path_trains_like_the_fused_one(tiny, monkeypatch):
    """On CUDA and MPS, prefill MLA runs blockwise (running max and sum); training through it must give the
    fused path's loss and gradients (forced here: a 1-byte block budget means 64-key blocks)."""
    cfg, params = tiny
    ids = _ids(cfg, 1, 150, seed=1)
    name = f"model.layers.{cfg.mla_layers[0]}.self_attn.q_b_proj.weight"
    results = []
    for budget in (mla.MLA_BLOCK_BYTES, 1):
        monkeypatch.setattr(mla, "MLA_BLOCK_BYTES", budget)
        params[name].grad = None
        loss = train.loss_of(cfg, params, ids)
        loss.backward()
        results.append((loss.item(), params[name].grad.clone()))
    (fused_loss, fused_grad), (block_loss, block_grad) = results
    assert abs(fused_loss - block_loss) < 1e-5  # the same softmax, summed in blocks (fp32)
    assert torch.allclose(fused_grad, block_grad, rtol=1e-3, atol=1e-6)


def test_loss_falls_on_a_repeated_text(tiny):
    """A stream that repeats a 97-token phrase: 25 steps must take the loss far below its start (ln vocab)."""
    cfg, params = tiny
    phrase = np.random.default_rng(0).integers(0, cfg.vocab_size - 256, 97)
    tokens = np.tile(phrase, 60).astype(np.uint16)
    tc = train.TrainConfig(steps=25, quantized_steps=0, batch=4, seq=48, lr=3e-3, warmup=3, log_every=24)
    history = train.train(cfg, params, tokens, tc, CPU)
    assert history[0]["loss"] > 6.0  # ln(768) = 6.6: a random model
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]


def test_router_balance_moves_toward_the_less_chosen(tiny):
    cfg, params = tiny
    layer = cfg.moe_layers[0]
    bias = params[f"model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"]
    before = bias.detach().clone()
    load = torch.arange(cfg.num_experts)  # expert e chosen e times: mean (E-1)/2
    loads = [load if i == 0 else torch.full((cfg.num_experts,), 3) for i in range(len(cfg.moe_layers))]
    train.balance_router(cfg, params, loads, 0.01)
    step = bias.detach() - before
    assert torch.allclose(step[: cfg.num_experts // 2], torch.full((cfg.num_experts // 2,), 0.01))
    assert torch.allclose(step[cfg.num_experts // 2:], torch.full((cfg.num_experts // 2,), -0.01))


def test_quantized_experts_are_frozen_mxfp4_values(tiny):
    from deltafin.kernels.quant import dequantize_mxfp4, quantize_mxfp4

    cfg, params = tiny
    name = train.experts_name(cfg.moe_layers[0], "w3")
    with torch.no_grad():
        params[name].mul_(1.37)  # off the MXFP4 grid
    train.quantize_experts(cfg, params)
    w = params[name]
    assert not w.requires_grad
    for e in (0, cfg.num_experts - 1):
        assert torch.equal(dequantize_mxfp4(quantize_mxfp4(w[e])), w[e])  # on the grid: what export stores


def test_learning_rate_warms_up_then_decays_to_the_floor():
    tc = train.TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr=1e-4)
    lrs = [train.learning_rate(tc, s) for s in range(120)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:100], lrs[11:100], strict=False))
    assert lrs[100:] == [1e-4] * 20
