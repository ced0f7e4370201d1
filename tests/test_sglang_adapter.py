"""The SGLang adapter (bole_tune.engines.sglang): proven equal to SGLang 0.5.23's own tree-verify kernel and
snapshot commit, its device-side tree conversion, and `install` on a backend laid out as SGLang's.

SGLang's kernel runs from its wheel (python3 scripts/engine_packages.py [DIR]; DIR from
$BOLE_TUNE_ENGINE_PACKAGES, default ~/.cache/bole-tune/engine-packages) in one subprocess per test session
(`sglang_kernel_check`): under TRITON_INTERPRET=1 on a CPU, on the GPU otherwise. Without the packages those
tests skip visibly, or fail with one line when BOLE_TUNE_REQUIRE_ENGINES=1.
"""

import os
import random
from types import SimpleNamespace

import pytest
import torch

from conftest import requires_gpu
from helpers import TOLERANCE, assert_close

from bole_tune import TreeBatch
from bole_tune.draft_trees import SGLangBeam
from bole_tune.acceptance import load_acceptance
from bole_tune.engines.engine_check import EngineUnavailable
from bole_tune.engines.sglang import SGLangTreeVerifyKernel, install, sglang_parents, sglang_tree
from bole_tune.engines.sglang_kernel_check import run_sglang_cases

PACKAGES = os.environ.get("BOLE_TUNE_ENGINE_PACKAGES", os.path.expanduser("~/.cache/bole-tune/engine-packages"))


# --- trees in SGLang's convention ------------------------------------------------------------------------

def random_tree(size, rng, deep=False):
    """bole-tune parents of one request with one root (node 0), parents before children."""
    if deep:
        return [-1] + [max(0, i - 1 - rng.randrange(2)) for i in range(1, size)]
    return [-1] + [rng.randrange(i) for i in range(1, size)]


def beam_tree(steps, topk, draft_tokens):
    tree = SGLangBeam(load_acceptance("qwen3.5-mtp-mbpp"), steps, topk).tree(draft_tokens)
    return [-1] + [p + 1 for p in tree.parents]


def make_case(trees, hk, hv, d, dtype, seed, padded=(), num_slots=None, steps=None):
    """SGLang's tensors for one batch of trees (all of one size, as SGLang verifies), slots shuffled."""
    gen = torch.Generator().manual_seed(seed)
    b, t = len(trees), len(trees[0])
    n = b * t
    slots = num_slots or b + 3
    cache = torch.randperm(slots, generator=gen)[:b].to(torch.int32)
    for r in padded:
        cache[r] = -1
    rng = random.Random(seed)
    if steps is None:
        steps = [rng.choice([-1] + list(range(t))) if rng.random() < 0.15 else rng.randrange(t) for _ in trees]
    return {
        "q": torch.randn(1, n, hk, d, generator=gen).to(dtype),
        "k": torch.randn(1, n, hk, d, generator=gen).to(dtype),
        "v": torch.randn(1, n, hv, d, generator=gen).to(dtype),
        "a": (torch.randn(n, hv, generator=gen) * 2).to(dtype),
        "b": torch.randn(n, hv, generator=gen).to(dtype),
        "A_log": torch.randn(hv, generator=gen) * 0.5,
        "dt_bias": torch.randn(hv, generator=gen),
        "pool": torch.randn(slots, hv, d, d, generator=gen) * 0.3,
        "cache_indices": cache,
        "parents": torch.tensor([sglang_parents(p) for p in trees], dtype=torch.int32),
        "steps": torch.tensor(steps, dtype=torch.int64),
    }


def cases():
    rng = random.Random(7)
    bf16 = torch.bfloat16
    out = [
        # Hv = Hk = 1, random trees of every size class up to 64 nodes
        make_case([random_tree(1, rng)] * 2, 1, 1, 16, bf16, 1),
        make_case([random_tree(5, rng) for _ in range(3)], 1, 1, 16, bf16, 2),
        make_case([random_tree(64, rng), random_tree(64, rng, deep=True)], 1, 1, 16, bf16, 3),
        # Hv/Hk 2: mixed trees in one batch (chain, star, random, SGLang's beam), a padding request
        make_case([list(range(-1, 15)), [-1] + [0] * 15, random_tree(16, rng), beam_tree(5, 4, 16)],
                  1, 2, 16, bf16, 4, padded=(1,)),
        make_case([beam_tree(8, 4, 32), random_tree(32, rng, deep=True)], 2, 4, 32, bf16, 5),
        # Hv = Hk = 2 and 4, chains (MTP) and SGLang's smallest tree
        make_case([list(range(-1, 3)), beam_tree(3, 1, 4)], 2, 2, 32, bf16, 6),
        make_case([beam_tree(5, 4, 8), random_tree(8, rng)], 4, 4, 16, bf16, 7),
        make_case([beam_tree(8, 8, 64)], 2, 4, 16, bf16, 8),
        make_case([random_tree(33, rng)], 1, 4, 16, torch.float32, 9),
    ]
    return out


@pytest.fixture(scope="module")
def sglang_results():
    all_cases = cases()
    try:
        return all_cases, run_sglang_cases(all_cases, PACKAGES)
    except EngineUnavailable as error:
        if os.environ.get("BOLE_TUNE_REQUIRE_ENGINES") == "1":
            pytest.fail(f"engine packages: {error}", pytrace=False)
        pytest.skip(f"{error}")


def adapter_round(case, device, kernel=None, pools=None):
    """The adapter on one case: (o [1, N, Hv, dv], the pool after its commit)."""
    x = {name: t.to(device) for name, t in case.items()}
    b, t = x["parents"].shape
    pool = x["pool"].clone() if pools is None else pools[0]
    kernel = kernel or SGLangTreeVerifyKernel()
    o = kernel.target_verify(x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"], ssm_states=pool,
                             cache_indices=x["cache_indices"],
                             query_start_loc=torch.arange(0, b * t + 1, t, dtype=torch.int32, device=device),
                             intermediate_states_buffer=None, intermediate_state_indices=None, cache_steps=t,
                             retrieve_parent_token=x["parents"])
    kernel.commit(x["steps"], x["cache_indices"], pools=[pool] if pools is None else pools)
    return o, pool


def compare(case, sglang, o, pool):
    dtype = case["q"].dtype
    tolerance = TOLERANCE[dtype]
    b, t = case["parents"].shape
    real = (case["cache_indices"] >= 0).repeat_interleave(t)  # padding rows: SGLang reads a zero state
    assert o.shape == sglang["o"].shape and o.dtype == sglang["o"].dtype
    err_o = assert_close(o.cpu()[0, real].float(), sglang["o"][0, real].float(), tolerance, "output")
    err_s = assert_close(pool.cpu(), sglang["pool"], tolerance, "committed state")
    return err_o, err_s


def test_sglang_tree_matches_host_topology():
    rng = random.Random(3)
    trees = [random_tree(24, rng), random_tree(24, rng, deep=True), list(range(-1, 23)), [-1] + [0] * 23,
             beam_tree(5, 4, 24)]
    parents = torch.tensor([sglang_parents(p) for p in trees], dtype=torch.int32)
    parents[:, 0] = 99  # node 0's entry is never read
    got = sglang_tree(parents)
    want = TreeBatch.from_parents(trees)
    for name in ("offsets", "parents", "node_depth", "dfs_enter", "dfs_exit"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for block in (16, 32):
        assert torch.equal(got.block_depths(block)[0], want.block_depths(block)[0])
    assert got.depth == 23 and sglang_tree(parents, max_depth=5).depth == 5


def test_equal_to_sglang_kernel(sglang_results, device):
    all_cases, results = sglang_results
    for i, (case, sglang) in enumerate(zip(all_cases, results)):
        o, pool = adapter_round(case, device)
        compare(case, sglang, o, pool)


def test_all_layer_commit_and_layer_from_pool(sglang_results, device):
    """Two layers in one pool [L, slots, ...] as SGLang allocates it: the layer comes from where ssm_states lies,
    the commit is one launch, each layer equal to SGLang's."""
    all_cases, results = sglang_results
    first, second = 3, 4  # same batch size? use two layers of case 3 with its own inputs
    case = all_cases[first]
    pools = torch.stack([case["pool"], case["pool"] * -0.5]).to(device)
    other = dict(case, pool=case["pool"] * -0.5)
    kernel = SGLangTreeVerifyKernel(pools=pools)
    x = {n: t.to(device) for n, t in case.items()}
    b, t = x["parents"].shape
    qsl = torch.arange(0, b * t + 1, t, dtype=torch.int32, device=device)
    outs = []
    for layer, inputs in ((0, case), (1, other)):
        y = {n: v.to(device) for n, v in inputs.items()}
        # every layer of a round gets the same retrieve_parent_token buffer, as SGLang's forward metadata does
        outs.append(kernel.target_verify(y["A_log"], y["dt_bias"], y["q"], y["k"], y["v"], y["a"], y["b"],
                                         ssm_states=pools[layer], cache_indices=y["cache_indices"],
                                         query_start_loc=qsl, intermediate_states_buffer=None,
                                         intermediate_state_indices=None, cache_steps=t,
                                         retrieve_parent_token=x["parents"]))
    kernel.commit(x["steps"], x["cache_indices"])  # the installed pools, one launch
    compare(case, results[first], outs[0], pools[0])
    # layer 1 against the adapter's single-layer run of the same inputs (checked against SGLang above)
    o1, pool1 = adapter_round(other, device)
    assert torch.equal(outs[1], o1)
    torch.testing.assert_close(pools[1], pool1, rtol=1e-5, atol=1e-5)
    del second


def test_round_split_over_two_parent_buffers_refused(device):
    """A layer verified under another retrieve_parent_token buffer starts another round; committing a round that
    covers only some of the pool's layers would leave the others stale, so it is refused."""
    rng = random.Random(5)
    case = make_case([random_tree(4, rng), random_tree(4, rng)], 1, 1, 16, torch.bfloat16, 41)
    x = {n: t.to(device) for n, t in case.items()}
    pools = torch.stack([x["pool"], x["pool"].clone()])
    kernel = SGLangTreeVerifyKernel(pools=pools)
    qsl = torch.arange(0, 9, 4, dtype=torch.int32, device=device)
    buffers = [x["parents"].clone() for _ in range(2)]  # both alive: two distinct buffers
    for layer in (0, 1):
        kernel.target_verify(x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"], ssm_states=pools[layer],
                             cache_indices=x["cache_indices"], query_start_loc=qsl, cache_steps=4,
                             retrieve_parent_token=buffers[layer])  # another buffer each layer
    before = pools.clone()
    with pytest.raises(RuntimeError, match=r"verified layers \[1\] of the pool's 2"):
        kernel.commit(x["steps"], x["cache_indices"])
    assert torch.equal(pools, before)


def test_track_slots(sglang_results, device):
    """mamba_track_indices: the state of node mamba_steps_to_track[r] lands in the track slot; -1 skips."""
    all_cases, results = sglang_results
    case, sglang = all_cases[3], results[3]
    x = {n: t.to(device) for n, t in case.items()}
    b, t = x["parents"].shape
    slots = case["pool"].shape[0]
    pool = torch.cat([x["pool"], torch.zeros(b, *x["pool"].shape[1:], device=device)])
    track = torch.arange(slots, slots + b, dtype=torch.int32, device=device)
    track_steps = torch.tensor([2, -1, 0, 5][:b], device=device)
    kernel = SGLangTreeVerifyKernel()
    o = kernel.target_verify(x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"], ssm_states=pool,
                             cache_indices=x["cache_indices"],
                             query_start_loc=torch.arange(0, b * t + 1, t, dtype=torch.int32, device=device),
                             retrieve_parent_token=x["parents"])
    kernel.commit(x["steps"], x["cache_indices"], pools=[pool], track_indices=track, track_steps=track_steps)
    assert_close(pool[:slots].cpu(), sglang["pool"], TOLERANCE[torch.bfloat16], "committed state")
    for r in range(b):
        s = int(track_steps[r])
        if s < 0 or case["cache_indices"][r] < 0:
            assert (pool[slots + r] == 0).all()
        else:
            assert_close(pool[slots + r].cpu(), sglang["snapshots"][r, s], TOLERANCE[torch.bfloat16], f"track {r}")
    del o


def test_rounds_share_one_conversion_and_buffers(device):
    rng = random.Random(5)
    case = make_case([random_tree(8, rng) for _ in range(2)], 1, 2, 16, torch.bfloat16, 11)
    x = {n: t.to(device) for n, t in case.items()}
    kernel = SGLangTreeVerifyKernel()
    qsl = torch.arange(0, 17, 8, dtype=torch.int32, device=device)
    states = [x["pool"].clone(), x["pool"].clone()]
    for pool in states:
        kernel.target_verify(x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"], ssm_states=pool,
                             cache_indices=x["cache_indices"], query_start_loc=qsl, retrieve_parent_token=x["parents"])
    first = kernel._current
    assert first.layers == {0, 1}
    storage = kernel._storage
    kernel.target_verify(x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"], ssm_states=states[0],
                         cache_indices=x["cache_indices"], query_start_loc=qsl, retrieve_parent_token=x["parents"])
    assert kernel._current is not first  # layer 0 again: a new round, same storage
    assert kernel._storage is storage


def test_rounds_keep_each_layers_result_and_stay_exact(device):
    """Rounds of one size hand `tree_verify` the same result object per layer (checked by the record of its last
    check, not in full), and two rounds through one kernel give what two fresh kernels give."""
    from bole_tune.kernels.verify.result import result_stamp_of

    rng = random.Random(9)
    case = make_case([random_tree(8, rng) for _ in range(2)], 1, 2, 16, torch.bfloat16, 12)
    kernel = SGLangTreeVerifyKernel()
    pool = case["pool"].to(device).clone()
    outs, kept = [], []
    for _ in range(2):
        o, pool = adapter_round(case, device, kernel=kernel, pools=[pool])
        rnd = kernel._current
        kept.append(rnd.results.layer(0, rnd.tree))
        outs.append(o.clone())
    assert kept[0] is kept[1] and result_stamp_of(kept[1]) is not None
    fresh = case["pool"].to(device).clone()
    for i in range(2):
        o, fresh = adapter_round(case, device, kernel=SGLangTreeVerifyKernel(), pools=[fresh])
        assert torch.equal(o, outs[i]), f"round {i}'s outputs"
    assert torch.equal(pool, fresh)


def test_a_commit_of_fewer_requests_than_verified_leaves_the_rest(device):
    """SGLang may commit fewer rows than it verified (padding at the end): the rows past n keep their slots, as a
    commit of all rows with those rows' steps at -1 (the launch path without padding) leaves them."""
    rng = random.Random(13)
    case = make_case([random_tree(6, rng) for _ in range(3)], 1, 2, 16, torch.bfloat16, 14)
    x = {n: t.to(device) for n, t in case.items()}
    pools = []
    for rows in (2, 3):
        kernel = SGLangTreeVerifyKernel()
        pool = x["pool"].clone()
        kernel.target_verify(x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"], ssm_states=pool,
                             cache_indices=x["cache_indices"],
                             query_start_loc=torch.arange(0, 19, 6, dtype=torch.int32, device=device),
                             retrieve_parent_token=x["parents"])
        steps = x["steps"].clone()
        if rows == 3:
            steps[2] = -1  # the third row: nothing to commit
        kernel.commit(steps[:rows], x["cache_indices"][:rows], pools=[pool])
        pools.append(pool)
    assert torch.equal(pools[0], pools[1])
    third = int(case["cache_indices"][2])
    assert torch.equal(pools[0][third], x["pool"][third]), "the row past n was committed"
    assert not torch.equal(pools[0], x["pool"]), "nothing was committed"


def test_refuses_ragged_and_bf16_pool(device):
    case = make_case([[-1, 0], [-1, 0]], 1, 1, 16, torch.bfloat16, 12)
    x = {n: t.to(device) for n, t in case.items()}
    kernel = SGLangTreeVerifyKernel()
    args = (x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"])
    with pytest.raises(ValueError, match="ragged"):
        kernel.target_verify(*args, ssm_states=x["pool"], cache_indices=x["cache_indices"],
                             query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32), retrieve_parent_token=x["parents"][:, :1])
    with pytest.raises(TypeError, match="mamba-ssm-dtype"):
        kernel.target_verify(*args, ssm_states=x["pool"].bfloat16(), cache_indices=x["cache_indices"],
                             query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32),
                             retrieve_parent_token=x["parents"])


# --- install on a backend laid out as SGLang 0.5.23's ----------------------------------------------------

def fake_backend(layers=2, slots=6, hv=2, d=16, **pool_flags):
    """HybridLinearAttnBackend -> linear_attn_backend (GDNAttnBackend) -> kernel_dispatcher, req_to_token_pool
    .mamba_pool.mamba_cache (temporal [L, slots, Hv, V, K], intermediate_ssm, conv, intermediate_conv_window)."""
    temporal = torch.zeros(layers, slots, hv, d, d)
    cache = SimpleNamespace(temporal=temporal, intermediate_ssm=torch.zeros(layers, slots, 4, hv, d, d),
                            conv=[torch.zeros(layers, slots, 8, 3)], intermediate_conv_window=[torch.zeros(1)],
                            replayssm_d=None, replayssm_rawv=None)
    mamba_pool = SimpleNamespace(mamba_cache=cache, **pool_flags)
    req_pool = SimpleNamespace(mamba_pool=mamba_pool, get_speculative_mamba2_params_all_layers=lambda: cache)

    class GDNAttnBackend:
        pass

    linear = GDNAttnBackend()
    linear.kernel_dispatcher = SimpleNamespace(tree_verify_kernel=object(), verify_kernel=object())
    linear.req_to_token_pool = req_pool
    linear.accept_lens_pool = None
    linear.forward_metadata = None

    class HybridLinearAttnBackend:
        def update_mamba_state_after_mtp_verify(self, *args, **kwargs):
            self.original_calls = getattr(self, "original_calls", 0) + 1

    hybrid = HybridLinearAttnBackend()
    hybrid.linear_attn_backend = linear
    return hybrid


def test_install_on_fake_backend():
    hybrid = fake_backend()
    wrapper = SimpleNamespace(decode_backend=hybrid, prefill_backend=hybrid)  # HybridAttnBackend's split
    kernel = install(wrapper, sglang_version="0.5.23", max_depth=5)
    assert hybrid.linear_attn_backend.kernel_dispatcher.tree_verify_kernel is kernel
    assert kernel.pools is hybrid.linear_attn_backend.req_to_token_pool.mamba_pool.mamba_cache.temporal
    assert kernel.max_depth == 5
    # a chain round (no retrieve_parent_token): SGLang's own commit runs
    hybrid.linear_attn_backend.forward_metadata = SimpleNamespace(retrieve_parent_token=None)
    hybrid.update_mamba_state_after_mtp_verify(torch.zeros(1, dtype=torch.int64), None, None, None)
    assert hybrid.original_calls == 1


@pytest.mark.parametrize("change, error, words", [
    (dict(sglang_version="0.5.22"), RuntimeError, "SGLang 0.5.22"),
    (dict(replayssm_spec_fold=True), ValueError, "ReplaySSM"),
    (dict(kda=True), ValueError, "KDA"),
    (dict(bf16=True), ValueError, "float32"),
    (dict(layout=True), ValueError, "layout"),
    (dict(no_snapshots=True), ValueError, "intermediate_ssm"),
])
def test_install_refuses(change, error, words):
    version = change.pop("sglang_version", "0.5.23")
    flags = {k: v for k, v in change.items() if k.startswith("replayssm")}
    hybrid = fake_backend(**flags)
    cache = hybrid.linear_attn_backend.req_to_token_pool.mamba_pool.mamba_cache
    if change.get("kda"):
        hybrid.linear_attn_backend.__class__.__name__ = "KDAAttnBackend"
    if change.get("bf16"):
        cache.temporal = cache.temporal.bfloat16()
    if change.get("layout"):
        cache.temporal = cache.temporal.transpose(-1, -2)
    if change.get("no_snapshots"):
        cache.intermediate_ssm = None
    with pytest.raises(error, match=words):
        install(hybrid, sglang_version=version)
    with pytest.raises(ValueError, match="no hybrid"):
        install(SimpleNamespace(), sglang_version="0.5.23")


def test_kernels_only_folder_runs_sglang_kernel_unchanged(tmp_path):
    """The kernels-only folder (scripts/engine_packages.py --sglang-kernels, what the GPU machine carries):
    SGLang's kernel files byte for byte as in its wheel, and bit for bit the outputs of SGLang's full
    package on the same cases (so the shim's device queries change nothing where both run)."""
    import importlib.util
    import zipfile
    from pathlib import Path

    from bole_tune.engines.engine_check import engine_site

    try:
        full = engine_site(PACKAGES, "sglang")
    except EngineUnavailable as error:
        if any(Path(PACKAGES).glob("sglang_kernels-*/site")):  # a GPU machine given the kernels-only folder
            pytest.skip(f"SGLang's full package is not here to compare with: {error}")
        if os.environ.get("BOLE_TUNE_REQUIRE_ENGINES") == "1":
            pytest.fail(f"engine packages: {error}", pytrace=False)
        pytest.skip(f"{error}")
    script = Path(__file__).resolve().parents[1] / "scripts" / "engine_packages.py"
    spec = importlib.util.spec_from_file_location("engine_packages", script)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    site = recipe.build_sglang_kernels(tmp_path, wheel_cache=Path(PACKAGES))
    wheel = sorted((Path(PACKAGES) / "wheels").glob("sglang-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as archive:
        for name in recipe.KERNEL_FILES:
            assert (site / name).read_bytes() == archive.read(name), name
    rng = random.Random(3)
    small = [make_case([random_tree(6, rng), beam_tree(3, 1, 4)[:4] + [2, 1]], 1, 2, 16, torch.bfloat16, 31)]
    ours, theirs = run_sglang_cases(small, site=site), run_sglang_cases(small, site=full)
    for name in ("o", "snapshots", "pool"):
        assert torch.equal(ours[0][name], theirs[0][name]), name


# --- production shapes on the GPU ------------------------------------------------------------------------

@requires_gpu
def test_equal_to_sglang_kernel_production_shapes():
    """Qwen3.5-9B's GDN heads (Hk 16, Hv 32, dk = dv = 128), B 16, T 64: SGLang's beam trees (8, 8, 64) and
    random trees, SGLang's kernel (on the GPU, from its wheel) against the adapter."""
    rng = random.Random(13)
    trees = [beam_tree(8, 8, 64) if r % 2 else random_tree(64, rng) for r in range(16)]
    all_cases = [make_case(trees, 16, 32, 128, torch.bfloat16, 21, num_slots=40),
                 make_case([beam_tree(5, 4, 8)] * 16, 16, 32, 128, torch.bfloat16, 22, num_slots=40)]
    try:
        results = run_sglang_cases(all_cases, PACKAGES, interpret=False)
    except EngineUnavailable as error:
        if os.environ.get("BOLE_TUNE_REQUIRE_ENGINES") == "1":
            pytest.fail(f"engine packages: {error}", pytrace=False)
        pytest.skip(f"SGLang's packages (BOLE_TUNE_ENGINE_PACKAGES={PACKAGES}): {error}")
    for case, sglang in zip(all_cases, results):
        o, pool = adapter_round(case, "cuda")
        compare(case, sglang, o, pool)
