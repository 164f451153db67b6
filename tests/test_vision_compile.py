"""A compiled native-resolution vision tower (`train.compile`) compiles a bounded number of
times however its batches' page sizes vary.

Every micro-batch of a native VLM holds pages of other sizes, so the patch count varies and so
does the attention layout: how many frames and windows of each length. A block that traced its
loop over the layout's groups recompiled for every new layout and, past dynamo's recompile
limit (8 per function), ran uncompiled. Now the grouped attention runs eagerly (one SDPA per
group length, as compiled) and the rest of the block is traced with the patch count dynamic.
Real inductor on the CPU (.ci/run installs a C++ compiler), float64 so compiled equals eager up
to rounding.
"""

from __future__ import annotations

import random

import pytest
import torch

from mmtrain.models import create_model
from mmtrain.spec import load_spec
from mmtrain.train import metrics, parallel

EXACT = {"rtol": 1e-9, "atol": 1e-12}  # float64: ~1e-16 per rounding, a few hundred of them


def _pages(rng: random.Random, count: int) -> list[torch.Tensor]:
    """`count` pages of random sides (multiples of the 8-pixel merge unit): new layouts."""
    sides = range(16, 88, 8)
    return [torch.rand(3, rng.choice(sides), rng.choice(sides), dtype=torch.float64)
            for _ in range(count)]  # fmt: skip


@pytest.mark.slow
def test_vision_blocks_compile_a_bounded_number_of_times_over_page_layouts():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    spec = load_spec("tiny-qwen2-vl")
    eager = create_model(spec, dtype=torch.float64, seed=1)
    compiled = parallel.apply_compile(create_model(spec, dtype=torch.float64, seed=1))
    towers = [model.towers["vision"] for model in (eager, compiled)]
    rng = random.Random(0)
    frames = []
    for count in (2, 3, 1, 4):  # four micro-batches, each of other page sizes and counts
        pages = _pages(rng, count)
        outputs = []
        for tower in towers:
            tower.zero_grad(set_to_none=True)
            tokens = torch.cat(tower.embed(pages))
            tokens.square().sum().backward()
            outputs.append((tokens, [p.grad for p in tower.parameters()]))
        torch.testing.assert_close(outputs[1], outputs[0], **EXACT)
        frames.append(counters["frames"]["ok"])
    assert frames[0] > 0, "dynamo compiled nothing"
    # The first layout compiles each piece of a block, the second may recompile it once with
    # the patch count dynamic; no later layout compiles anything.
    assert frames[1] <= 2 * frames[0] and frames[3] == frames[1], frames
    assert metrics.compile_counts()["compiled_frames"] == frames[3]
