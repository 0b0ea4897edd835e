"""Routing mass (Eq. 1) from the observer equals a brute-force loop over tokens."""

from __future__ import annotations

import numpy as np
import torch

from pwcal.stats.routing import RoutingMass
from pwrun.model.moe import moe_forward
from pwrun.model.spec import MoESpec
from pwrun.model.weights import MoEWeights


def test_routing_mass_matches_brute_force() -> None:
    torch.manual_seed(0)
    spec = MoESpec(num_experts=6, top_k=2, expert_intermediate=8, norm_topk_prob=False)
    w = MoEWeights(router=torch.randn(6, 16), gate_up=torch.randn(6, 16, 16), down=torch.randn(6, 16, 8))
    obs = RoutingMass(num_layers=2, num_experts=6)
    xs = [torch.randn(n, 16) for n in (5, 17)]
    for x in xs:
        moe_forward(x, w, spec, layer=1, observer=obs)
    brute = np.zeros(6)
    count = np.zeros(6, dtype=np.int64)
    for x in xs:
        for t in range(x.shape[0]):
            p = torch.softmax(x[t] @ w.router.T, -1)
            top = torch.topk(p, 2)
            for v, e in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                brute[e] += v
                count[e] += 1
    m = obs.mass()
    assert np.allclose(m[1], brute / brute.sum(), atol=1e-6)
    assert m[0].sum() == 0 and np.array_equal(obs.tokens[1], count)
