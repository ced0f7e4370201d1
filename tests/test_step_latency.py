"""`bole-tune step`'s GDN round: each way an engine can commit is timed and the cheapest counts, and the folded
way really commits every round (under the interpreter on a CPU, and replayed from a CUDA graph on a GPU)."""

import pytest
import torch

from bole_tune.gdn_layer import gdn_tree_commit, gdn_tree_step
from bole_tune.kernels import TreeVerifyResult, tree_commit
from bole_tune.profiles import load_model
from bole_tune.render import GDN_ROUND_LABELS
from bole_tune.step_latency import GDN_ROUNDS, StepModel, _Weights, measure_step_curve
from conftest import requires_gpu
from helpers import assert_close
from test_cli import TINY_MODEL


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny-moe.yaml"
    path.write_text(TINY_MODEL)
    return load_model(str(path))


def step_model(tiny, device, batch=2, size=4):
    return StepModel(tiny, batch, size, _Weights(tiny, device), context=16, device=device)


def layer_inputs(m: StepModel):
    """The GDN layer's projections, as `StepModel.gdn_layer` computes them."""
    from bole_tune.step_latency import _rms
    x = _rms(m.x)
    proj = x @ m.wt.gdn_in
    b, a = (x @ m.wt.gdn_gates).chunk(2, dim=-1)
    return proj[:, :m.params.channels], a, b


def test_folded_rounds_commit_what_separate_commits_do(tiny, device):
    """Two folded rounds from a verified round leave the state two explicit commits leave, and the first folded
    round's outputs are the verify's after the first commit."""
    m = step_model(tiny, device)
    state0, conv0 = m.state.clone(), m.conv_state.clone()
    m.gdn_folded_rounds()  # the setup round (into the second buffer), then two folded rounds
    first, _ = m._fold_buffers()
    folded_state, folded_o = m.state.clone(), first.o.clone()

    m.state.copy_(state0)
    m.conv_state.copy_(conv0)
    mixed, a, b = layer_inputs(m)
    steps = []
    for _ in range(2):  # the setup round and the first folded one, each committed on its own
        steps.append(gdn_tree_step(mixed, a, b, m.params, m.state, m.conv_state, m.slots, m.tree, validate=False))
        gdn_tree_commit(m.state, m.conv_state, m.slots, steps[-1], m.accepted, validate=False)
    assert_close(folded_o.float(), steps[1].o.float(), 2e-2, "the first folded round's outputs")
    assert_close(folded_state, m.state, 1e-5, "the state after two folded rounds")
    assert not torch.allclose(folded_state, state0), "the folded rounds committed nothing"


def test_step_points_take_the_cheapest_round(tiny, device, monkeypatch):
    """Every way is timed, the Gluon ring of three where `StepModel.ring_ways` names it (here made to), and the
    cheapest counts."""
    ways = StepModel.ring_ways
    monkeypatch.setattr(StepModel, "ring_ways", lambda self: {**ways(self), "ring of 3": 3})
    (point,) = measure_step_curve(tiny, [2], [4], context=16, device=device, repeats=3, serial=False)
    timed = {*GDN_ROUNDS, "ring of 3"}
    assert set(point.gdn_rounds_us) == timed
    assert all(v > 0 for v in point.gdn_rounds_us.values())
    assert point.gdn_round in timed and point.gdn_us == min(point.gdn_rounds_us.values())
    d = point.as_dict()
    assert d["gdn_round"] == point.gdn_round and set(d["gdn_rounds_us"]) == timed
    assert set(GDN_ROUND_LABELS) == set(GDN_ROUNDS)  # the step table names each way


def test_the_gluon_ring_is_timed_where_its_tables_take_fewer_rounds(tiny, device, monkeypatch):
    """A ring of three joins the rings of four and two only where the point's ring rounds run on the Gluon verify
    and its 9-node paths (trees of depth 8) make a ring of four too wide for it; 8-node paths take four."""
    deep = step_model(tiny, device, batch=1, size=32)
    shallow = step_model(tiny, device, batch=2, size=24)
    assert (deep.tree.depth, shallow.tree.depth) == (8, 7)
    if torch.device(device).type == "cpu":  # the planner's own answer: no Gluon verify on a CPU
        assert not deep.ring_on_gluon() and deep.ring_ways() == {"ring": 4, "ring of 2": 2}
    monkeypatch.setattr(StepModel, "ring_on_gluon", lambda self: True)
    assert deep.ring_ways() == {"ring": 4, "ring of 2": 2, "ring of 3": 3}
    assert shallow.ring_ways() == {"ring": 4, "ring of 2": 2}
    monkeypatch.setattr(StepModel, "ring_on_gluon", lambda self: False)
    assert deep.ring_ways() == {"ring": 4, "ring of 2": 2}


def fresh_copy(res: TreeVerifyResult) -> TreeVerifyResult:
    """A copy of a result's factors, its path not yet committed."""
    return TreeVerifyResult(*(t.clone() for t in (res.o, res.u, res.log_decay, res.k, res.k_scale)),
                            torch.zeros_like(res.committed), res.tree)


@requires_gpu
def test_folded_rounds_fold_on_every_graph_replay(tiny):
    """Replayed from one CUDA graph (as `bole-tune step` times them), both rounds fold on every replay: each
    replay moves the state as committing the previous replay's second result, then its own first, does."""
    m = step_model(tiny, "cuda", batch=3, size=8)
    m.gdn_folded_rounds()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        m.gdn_folded_rounds()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.gdn_folded_rounds()
    first, second = m._fold_buffers()
    for _ in range(3):
        torch.cuda.synchronize()
        expected, pending = m.state.clone(), fresh_copy(second)
        graph.replay()
        torch.cuda.synchronize()
        tree_commit(expected, m.slots, pending, m.accepted, validate=False)
        tree_commit(expected, m.slots, fresh_copy(first), m.accepted, validate=False)
        assert_close(m.state, expected, 1e-5, "the state after a replay of two folded rounds")


def test_ring_rounds_in_the_layer_match_separate_commits(tiny, device):
    """Four rounds of the layer through a ring of two rounds (read, read, write, read), then a flush, give every
    round's outputs and the final state that four rounds each committed on its own give."""
    from bole_tune.kernels import PendingRing
    from bole_tune.kernels.conv import tree_conv_commit

    m = step_model(tiny, device)
    state0, conv0 = m.state.clone(), m.conv_state.clone()
    mixed, a, b = layer_inputs(m)
    ring = PendingRing(m.state.shape[0], 2, m.tree.depth + 1, m.tree.num_nodes, m.tree.num_requests, device)
    arena = ring.results(m.heads, torch.bfloat16)
    ring_outputs, writes = [], []
    for _ in range(4):
        step = ring.begin(m.tree)
        writes.append(step.write)
        s = gdn_tree_step(mixed, a, b, m.params, m.state, m.conv_state, m.slots, m.tree, validate=False,
                          ring=step.layer(arena))
        tree_conv_commit(m.conv_state, m.slots, s.conv_inputs, m.tree, m.accepted, validate=False)
        ring.end(step, m.slots, m.accepted, validate=True)
        ring_outputs.append(s.o.float().clone())
    ring.flush(m.slots, [m.state], [arena])
    assert writes == [False, False, True, False]

    ring_state = m.state.clone()
    m.state.copy_(state0)
    m.conv_state.copy_(conv0)
    for index in range(4):
        s = gdn_tree_step(mixed, a, b, m.params, m.state, m.conv_state, m.slots, m.tree, validate=False)
        gdn_tree_commit(m.state, m.conv_state, m.slots, s, m.accepted, validate=False)
        assert_close(ring_outputs[index], s.o.float(), 2e-2, f"round {index}'s outputs")
    # 1e-4, not the folded rounds' 1e-5: a read round takes the pending tokens' dot products with q and k on the
    # inputs' 16-bit operands, as the verify's Gram products are (H200: 2.2e-5)
    assert_close(ring_state, m.state, 1e-4, "the state after four rounds and the flush")
    assert not torch.allclose(ring_state, state0), "the rounds committed nothing"


class Killed(Exception):
    pass


def test_a_killed_step_run_keeps_the_points_it_measured(tiny, tmp_path):
    """`measure_and_store` writes the points measured so far while it runs (here after every point), merged
    into the stored curve: a run stopped part way keeps them, and the old curve's other points stay."""
    from bole_tune import database
    from bole_tune.step_latency import measure_and_store

    first = measure_and_store([tiny], batches=(1,), tree_sizes=(1, 4), context=16, repeats=1, serial=False,
                              db_dir=tmp_path)
    old = {p.tree_size: p.step_us for p in first.points["Tiny-MoE"]}
    seen = []

    def stop_at_the_first(model, batch, size, point):
        seen.append(point)
        raise Killed

    with pytest.raises(Killed):
        measure_and_store([tiny], batches=(1,), tree_sizes=(1, 4), context=16, repeats=1, serial=False,
                          db_dir=tmp_path, progress=stop_at_the_first, checkpoint_s=0)
    curve = database.load(first.path)["step_curves"]["Tiny-MoE/bf16"]
    stored = {p["tree_size"]: p["step_us"] for p in curve["points"]}
    assert sorted(stored) == [1, 4] and len(seen) == 1
    # the file keeps 0.01 us: on a GPU a point of a few hundred us differs from it by more than approx's 1e-6
    assert stored[1] == pytest.approx(seen[0].step_us, abs=0.005)  # the killed run's point, written before it stopped
    assert stored[4] == pytest.approx(old[4], abs=0.005)  # not measured again: the first run's point stays
    assert all("measured" in p for p in curve["points"])  # each point names the run that measured it
