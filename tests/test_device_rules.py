"""The decode path under CUDA's device rules, on a CPU (tests/device_emulation.py).

The tiny targets' parameters sit on the emulation's virtual device; every torch call is checked as CUDA
would check it. Sessions 40 and 42 found on a lent GPU that the decode path mixed host and device
tensors (a drafter left on the host; the dynamic tree adding host scores to the drafter's device
log-probs). These tests fail on such faults without a GPU, and the first one shows that the checks bite.
The whole tiny-model suite runs the same way with ANCHORSPEC_TEST_DEVICE=emulated.
"""

import pytest
import torch

import device_emulation
from anchorspec.data.regenerate import AnswerRequest, ContinuousBatcher
from anchorspec.decode.batch import BatchKV
from anchorspec.decode.engine import GenerationConfig, generate_speculative, generate_vanilla
from anchorspec.decode.propose import EagleProposer
from anchorspec.decode.round import BatchDecoder
from anchorspec.decode.sampling import SamplingParams
from anchorspec.decode.tree import TreeShape, dynamic_tree
from device_emulation import DeviceMismatch
from helpers import random_drafter, tiny_target
from batch_world import MIX, build, make_prompts, run_batched


@pytest.fixture
def emulated():
    """A virtual device for this test (or the session's, under ANCHORSPEC_TEST_DEVICE=emulated)."""
    with device_emulation.emulating() as mode:
        yield mode


def test_the_emulation_refuses_what_cuda_refuses(emulated):
    """Negative controls: each of these raises on a GPU, so each must raise here."""
    target = tiny_target("llama")
    weight = target.embed_weight
    assert emulated.is_on(weight)
    host = torch.randn(3, weight.shape[1], dtype=weight.dtype)
    with pytest.raises(DeviceMismatch):
        host + weight[:3]  # an elementwise op across devices
    with pytest.raises(DeviceMismatch):
        weight.index_select(0, torch.tensor([1, 2]))  # a host index for a device tensor
    with pytest.raises(DeviceMismatch):
        target.model(torch.tensor([[1, 2, 3]]))  # host token ids into a device embedding
    with pytest.raises(DeviceMismatch):
        torch.cat([host, weight[:3]])
    with pytest.raises(DeviceMismatch):
        weight.numpy()
    # what CUDA allows: a host index in indexing, a 0-dim host scalar, moves, values brought back
    assert emulated.is_on(weight[torch.tensor([1, 2])])
    assert emulated.is_on(weight * torch.tensor(2.0, dtype=weight.dtype))
    moved = host.to(weight.device)
    assert emulated.is_on(moved) and not emulated.is_on(host)
    assert not emulated.is_on(moved.cpu()) and not emulated.is_on(moved.to("cpu"))
    assert isinstance((host + moved.cpu()).sum().item(), float)


def test_dynamic_tree_takes_children_from_the_device(emulated):
    """The drafter's top-k live on the device; the tree's scores are host bookkeeping (session 42's fault)."""
    device = tiny_target("llama").embed_weight.device
    program = dynamic_tree(7, torch.tensor([3, 4], device=device), torch.tensor([-0.1, -0.2], device=device),
                           TreeShape(2, 3, 6))
    request = next(program)
    children = (torch.tensor([[5, 6], [8, 9]], device=device),
                torch.tensor([[-0.3, -0.5], [-0.4, -0.9]], dtype=torch.float64, device=device))
    program.send(children)
    with pytest.raises(StopIteration) as done:
        program.send(children)
    tree = done.value.value
    assert request[0] == [0, 1] and tree.size == 6 and not emulated.is_on(tree.tokens)


@pytest.mark.parametrize("shape", [TreeShape.chain(4), TreeShape(3, 4, 12)])
def test_greedy_speculative_decoding_on_the_device(emulated, shape):
    target = tiny_target("qwen3")
    proposer = EagleProposer(random_drafter(target))
    prompt = make_prompts([9], 0)[0]
    cfg = GenerationConfig(max_new_tokens=16)
    assert generate_speculative(target, proposer, prompt, cfg, shape).token_ids == \
        generate_vanilla(target, prompt, cfg).token_ids


def test_batched_rounds_on_the_device(emulated):
    """Oracle and random drafters, trees, chains and a plain row, joining and leaving a shared cache."""
    target = tiny_target("llama")
    drafter = random_drafter(target)
    prompts = make_prompts([3, 17, 8, 1, 25, 11], 0)
    cfgs = [GenerationConfig(max_new_tokens=n) for _, _, n in MIX]
    refs = [generate_vanilla(target, p, c).token_ids for p, c in zip(prompts, cfgs)]
    decs = [build(target, drafter, k, s, p, c) for (k, s, _), p, c in zip(MIX, prompts, cfgs)]
    out = run_batched(BatchDecoder(target, BatchKV(1, 4)), decs)
    assert [r.token_ids for r in out] == refs


def test_sampled_speculative_decoding_on_the_device(emulated):
    target = tiny_target("llama")
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(1.0, 0.9), seed=3)
    res = generate_speculative(target, EagleProposer(random_drafter(target)), make_prompts([6], 1)[0], cfg,
                               TreeShape(2, 3, 6))
    assert len(res.token_ids) == 12


def test_continuous_batching_on_the_device(emulated):
    """regenerate's and synth-prompts' decode loop: greedy rows equal their solo greedy decoding."""
    target = tiny_target("llama")
    prompts = make_prompts([4, 9, 2, 7], 2)
    batcher = ContinuousBatcher(target, batch_size=3, max_new_tokens=6)
    for i, p in enumerate(prompts):
        batcher.add(AnswerRequest(i, p.tolist()))
    got = {request.key: res.token_ids for request, res in batcher.run()}
    cfg = GenerationConfig(max_new_tokens=6)
    assert got == {i: generate_vanilla(target, p, cfg).token_ids for i, p in enumerate(prompts)}
