"""The portable fused_moe op and the routing against a token-by-token loop over the experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.layers.fused_moe import route
from runtime.plugins.ops import fused_moe


def test_fused_moe_equals_a_loop_over_tokens():
    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 13, 16, 8, 5, 2
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.float64)
    w2 = torch.randn(experts, hidden, inter, dtype=torch.float64)
    logits = torch.randn(tokens, experts)
    logits[:, 4] = -30  # expert 4 gets no token
    weights, ids = route(logits, top_k, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(tokens))
    expected = torch.zeros_like(x)
    for t in range(tokens):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected[t] += w * (w2[e] @ (F.silu(gate) * up))
    assert torch.allclose(fused_moe(x, w13, w2, weights, ids), expected)


def test_route_without_renormalisation_keeps_softmax_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(weights, probs[:, :2])
