"""The ring of pending rounds (`PendingRing`): over many rounds, with requests joining, leaving (flushed or
dropped) and staying, every output equals the float64 node-by-node recurrence run round after round, the slots
are written only in write rounds (and then hold the recurrence's state), and a flush leaves the recurrence's
state in the pool."""

import random

import pytest
import torch

from bole_tune.config import KernelConfig
from bole_tune.kernels import PendingRing, tree_verify
from bole_tune.kernels.reference import verify_reference
from bole_tune.shapes import HeadShape
from bole_tune.workloads import make_inputs, make_tree
from helpers import TOLERANCE, assert_close
from test_folded_commit import accepted_of

F32, BF16 = torch.float32, torch.bfloat16
NUM_SLOTS = 8
HEADS = HeadShape(hk=2, hv=4, dk=32, dv=32)

# id -> (variant, dtype, rounds R, tree kind, rounds to run[, config[, largest tree]])
CASES = {
    "stream-bf16-chains-R3": ("stream", BF16, 3, "chain", 8),
    # trees of at most 8 nodes: the stream launch on stacked rows (`LaunchPolicy.stack_max_tree`)
    "stream-stacked-bf16-chains-R2": ("stream", BF16, 2, "chain", 6, None, 8),
    "stream-stacked-key-steps-fp32-trees-R3": ("stream", F32, 3, "random", 7, KernelConfig(16, 16, 4, 1), 8),
    "stream-key-steps-bf16-trees-R2": ("stream", BF16, 2, "random", 6, KernelConfig(16, 16, 4, 1)),
    "resident-fp32-trees-R3": ("resident", F32, 3, "random", 7),
    "fused-fp32-trees-R2": ("fused", F32, 2, "random", 6),
    "fused-bf16-multi-block-R2": ("fused", BF16, 2, "chain", 4),
    "stream-fp32-chains-R1": ("stream", F32, 1, "chain", 4),
}


def run_rounds(device, variant, dtype, rounds, kind, num_rounds, config=None, max_size=None, seed=3, force=()):
    """``force``: the rounds that write whatever the tables hold (`PendingRing.begin(write=True)`)."""
    rng = random.Random(seed)
    max_size = max_size or (70 if variant == "fused" and kind == "chain" and dtype == BF16 else 12)
    max_path = 8 if kind == "random" else max_size
    ring = PendingRing(NUM_SLOTS, rounds, max_path, capacity=4 * max_size, max_requests=4, device=device)
    arena = ring.results(HEADS, dtype)
    pool = make_inputs(make_tree([1], device=device), HEADS.hk, HEADS.hv, HEADS.dk, HEADS.dv, F32, device,
                       num_slots=NUM_SLOTS).state
    truth = pool.clone()  # the recurrence's pool, committed round by round (float64 inside each round)
    active = rng.sample(range(NUM_SLOTS), 3)
    writes = 0
    for index in range(num_rounds):
        if index:  # one request leaves (its tokens flushed or dropped), one joins a free slot
            leaver = active.pop(rng.randrange(len(active)))
            gone = torch.tensor([leaver], dtype=torch.int32, device=device)
            if rng.random() < 0.5:
                ring.flush(gone, [pool], [arena])
                assert_close(pool[leaver], truth[leaver], TOLERANCE[F32], f"round {index}: the flushed slot")
            else:
                ring.drop(gone)
                pool[leaver] = 0
                truth[leaver] = 0
            active.append(rng.choice([s for s in range(NUM_SLOTS) if s not in active]))
            if rng.random() < 0.5 and len(active) < 4:
                active.append(rng.choice([s for s in range(NUM_SLOTS) if s not in active]))
        slots = torch.tensor(active, dtype=torch.int32, device=device)
        sizes = [rng.randint(1, max_size) for _ in active]
        tree = make_tree(sizes, kind, max_depth=max_path - 1, seed=index, device=device)
        x = make_inputs(tree, HEADS.hk, HEADS.hv, HEADS.dk, HEADS.dv, dtype, device, seed=20 + index)
        step = ring.begin(tree, write=True if index in force else None)
        before = pool.clone()
        res = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots, tree, variant=variant, config=config,
                          ring=step.layer(arena))
        ref = verify_reference(x.q, x.k, x.v, x.g, x.beta, truth, slots, tree)
        assert_close(res.o, ref.o, TOLERANCE[dtype], f"round {index} ({'write' if step.write else 'read'}) outputs")
        if step.write:
            writes += 1
            assert_close(pool[slots.long()], truth[slots.long()], TOLERANCE[F32], f"round {index}: the written slots")
        else:
            assert torch.equal(pool, before), f"round {index}: a read round wrote the pool"
        accepted = torch.tensor([accepted_of(rng, tree, r) for r in range(len(sizes))], device=device)
        truth = ref.committed(truth, slots, tree, accepted).float()
        ring.end(step, slots, accepted, validate=True)
    ring.flush(torch.tensor(active, dtype=torch.int32, device=device), [pool], [arena])
    assert_close(pool, truth, TOLERANCE[F32], "pool after the final flush")
    assert int(ring.count.sum()) == 0
    return writes


@pytest.mark.parametrize("case", [*CASES, "fallback"], ids=[*CASES, "pytorch-fallback"])
def test_ring_over_rounds_matches_the_recurrence(device, case, monkeypatch):
    if case == "fallback":  # off a GPU without the interpreter: the PyTorch closed form does the same
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        device, case = "cpu", "resident-fp32-trees-R3"
    writes = run_rounds(device, *CASES[case])
    variant, dtype, rounds, kind, num_rounds, *_ = CASES[case]
    assert writes == (num_rounds - 1) // rounds  # rounds R, 2R, ...: the first R rounds read


@pytest.mark.parametrize("case", ["stream-bf16-chains-R3", "stream-key-steps-bf16-trees-R2", "stream-fp32-chains-R1",
                                  "stream-stacked-bf16-chains-R2", "fused-bf16-multi-block-R2"])
@pytest.mark.parametrize("precision,before", [("tf32x3", False), (None, True)])
def test_read_round_corrections_other_placements_and_precisions(device, case, precision, before, monkeypatch):
    """The read round's other settings (`run.CORRECT_BEFORE_STREAM`: the corrections start the products and the
    stream reads the decayed state; `run.CORRECT_DOT_PRECISION = "tf32x3"`: their products on three tf32 passes)
    give the recurrence too (the fused kernel ignores the placement)."""
    from bole_tune.kernels.verify import run as run_module

    assert (precision, before) != (run_module.CORRECT_DOT_PRECISION, run_module.CORRECT_BEFORE_STREAM)
    monkeypatch.setattr(run_module, "CORRECT_BEFORE_STREAM", before)
    monkeypatch.setattr(run_module, "CORRECT_DOT_PRECISION", precision)
    variant, dtype, rounds, kind, num_rounds, *config = CASES[case]
    assert run_rounds(device, variant, dtype, rounds, kind, num_rounds, *config) == (num_rounds - 1) // rounds


@pytest.mark.parametrize("case", ["stream-bf16-chains-R3", "resident-fp32-trees-R3", "fused-fp32-trees-R2",
                                  "fused-bf16-multi-block-R2"])
@pytest.mark.parametrize("hint", ["", "evict_last"])
def test_rounds_with_other_state_load_hints(device, case, hint, monkeypatch):
    """The state loads' eviction policy (`run.STATE_HINTS` for the resident kernel's verify, write and read rounds,
    `run.FUSED_STATE_HINTS` for the fused kernel's one-block and multi-block launches) reaches the kernels as a
    launch key and a meta-parameter: the rounds give the recurrence with each policy but the shipped one."""
    from bole_tune.kernels.verify import run as run_module

    assert hint not in run_module.STATE_HINTS.values()
    monkeypatch.setattr(run_module, "STATE_HINTS", {key: hint for key in run_module.STATE_HINTS})
    monkeypatch.setattr(run_module, "FUSED_STATE_HINTS", {key: hint or "evict_first"
                                                          for key in run_module.FUSED_STATE_HINTS})
    variant, dtype, rounds, kind, num_rounds, *config = CASES[case]
    assert run_rounds(device, variant, dtype, rounds, kind, num_rounds, *config) == (num_rounds - 1) // rounds


@pytest.mark.parametrize("variant,name", [("stream", "STATE_HINTS"), ("fused", "FUSED_STATE_HINTS")])
def test_an_unknown_state_load_hint_reaches_the_kernel(device, variant, name, monkeypatch):
    """The hint is the kernel's: one Triton does not know fails the launch with Triton's own error (so the hints
    above were not dropped on the way)."""
    from bole_tune.kernels.verify import run as run_module

    monkeypatch.setattr(run_module, name, {key: "evict_sometimes" for key in getattr(run_module, name)})
    with pytest.raises(Exception, match="evict_sometimes|eviction"):
        run_rounds(device, variant, BF16, 2, "chain", 2)


@pytest.mark.parametrize("case,force", [("stream-bf16-chains-R3", (1, 2, 5)), ("fused-fp32-trees-R2", (3,))])
def test_ring_rounds_written_early_match_the_recurrence(device, case, force):
    """Write rounds asked for early (`begin(write=True)`: after one round, two in a row, and with the tables full
    anyway) fold what the tables hold; the R-round count starts again after each."""
    variant, dtype, rounds, kind, num_rounds, *config = CASES[case]
    writes = run_rounds(device, variant, dtype, rounds, kind, num_rounds, *config, force=force)
    held, expected = 0, 0
    for index in range(num_rounds):
        write = index in force or held >= rounds
        expected += write
        held = 1 if write else held + 1
    assert writes == expected > (num_rounds - 1) // rounds


def test_ring_write_choice_is_checked(device):
    ring = PendingRing(NUM_SLOTS, 2, 4, capacity=16, max_requests=2, device=device)
    tree = make_tree([4, 4], "chain", device=device)
    slots, accepted = torch.tensor([1, 5], dtype=torch.int32, device=device), torch.tensor([3, 1], device=device)
    with pytest.raises(TypeError, match="write: expected None, True or False"):
        ring.begin(tree, write=1)
    plan = []
    for write in (None, True, False, None, None):
        step = ring.begin(tree, write=write)
        plan.append(step.write)
        ring.end(step, slots, accepted)
    # held after each: 1, 1 (written early), 2, 1 (the tables held R = 2 rounds: written), 2
    assert plan == [False, True, False, True, False]
    with pytest.raises(ValueError, match="write=False: the tables already hold rounds=2 rounds"):
        ring.begin(tree, write=False)
    # an early write round, like any, must see every slot with pending tokens
    fresh = PendingRing(NUM_SLOTS, 3, 4, capacity=16, max_requests=2, device=device)
    fresh.end(fresh.begin(tree), slots, accepted)
    step = fresh.begin(tree, write=True)
    with pytest.raises(ValueError, match="a slot with pending tokens is missing from a write round"):
        fresh.end(step, slots[:1].repeat(2), torch.tensor([0, 0], device=device), validate=True)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_ring_rounds_write_every_r_rounds(device, path, monkeypatch):
    if path == "torch":  # the tables' update as batched torch operations (off a GPU without the interpreter)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        device = "cpu"
    ring = PendingRing(NUM_SLOTS, 3, 4, capacity=16, max_requests=4, device=device)
    tree = make_tree([4, 4], "chain", device=device)
    slots = torch.tensor([1, 5], dtype=torch.int32, device=device)
    plan = []
    for _ in range(7):
        step = ring.begin(tree)
        plan.append((step.position, step.write))
        ring.end(step, slots, torch.tensor([3, 1], device=device))
    assert plan == [(0, False), (1, False), (2, False), (3, True), (0, False), (1, False), (2, True)]
    # after the last write round the tables hold that round's paths only: 4 and 2 tokens, ending at each accepted node
    assert ring.count.tolist() == [0, 4, 0, 0, 0, 2, 0, 0]
    assert ring.last[1].tolist()[:4] == [0, 0, 0, 1] and ring.last[5].tolist()[:2] == [0, 1]
    assert ring.rows[1].tolist()[:4] == [2 * 16 + r for r in range(4)]


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_end_takes_strided_slots_and_accepted_nodes_by_their_values(device, path, monkeypatch):
    """`PendingRing.end` with ``state_indices`` and ``accepted`` as strided views (every other element of a larger
    tensor) fills the tables as with their values (the kernel reads them by index: they are copied first; before, a
    strided view's neighbour in memory named the slot)."""
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        device = "cpu"
    tree = make_tree([4, 3, 5], "random", max_depth=4, seed=6, device=device)
    slots, accepted = [2, 6, 5], [3, -1, 4]
    tables = []
    for make in (lambda v, pad: torch.tensor(v, dtype=torch.int32, device=device),
                 lambda v, pad: torch.tensor([e for x in v for e in (x, pad)], dtype=torch.int32, device=device)[::2]):
        ring = PendingRing(NUM_SLOTS, 2, 5, capacity=16, max_requests=4, device=device)
        for _ in range(2):
            ring.end(ring.begin(tree), make(slots, 7), make(accepted, 1))
        tables.append((ring.rows.clone(), ring.last.clone(), ring.count.clone()))
    (rows, last, count), (rows_v, last_v, count_v) = tables
    assert torch.equal(rows_v, rows) and torch.equal(last_v, last) and torch.equal(count_v, count)
    assert count.tolist() == [0, 0, 2 * (len(tree.path_to(0, 3))), 0, 0, 2 * len(tree.path_to(2, 4)), 0, 0]


@pytest.mark.parametrize("variant", ["stream", "fused"])
def test_a_round_reads_only_the_entries_its_pending_rounds_fill(device, variant):
    """A round reads `PendingRing.round_width` entries of each table row (16 for up to 16 pending tokens, then 32):
    with every request accepting its deepest node the tables fill exactly to that width (R = 3 of 8-node paths: 8,
    then 16 tokens in 16 entries of a 32-wide row), and every round's outputs, the written slots and the flushed pool
    still match the float64 recurrence."""
    ring = PendingRing(NUM_SLOTS, 3, 8, capacity=32, max_requests=4, device=device)
    assert ring.width == 32
    arena = ring.results(HEADS, F32)
    pool = make_inputs(make_tree([1], device=device), HEADS.hk, HEADS.hv, HEADS.dk, HEADS.dv, F32, device,
                       num_slots=NUM_SLOTS, seed=5).state
    truth = pool.clone()
    slots = torch.tensor([6, 2], dtype=torch.int32, device=device)
    plan = []
    for index in range(7):
        tree = make_tree([8, 8], "chain", device=device)
        x = make_inputs(tree, HEADS.hk, HEADS.hv, HEADS.dk, HEADS.dv, F32, device, seed=40 + index)
        step = ring.begin(tree)
        plan.append((step.width, step.write, int(ring.count[slots.long()].max())))
        res = tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots, tree, variant=variant, ring=step.layer(arena))
        ref = verify_reference(x.q, x.k, x.v, x.g, x.beta, truth, slots, tree)
        assert_close(res.o, ref.o, TOLERANCE[F32], f"round {index} (width {step.width}) outputs")
        if step.write:
            assert_close(pool[slots.long()], truth[slots.long()], TOLERANCE[F32], f"round {index}: the written slots")
        accepted = torch.tensor([7, 7], device=device)
        truth = ref.committed(truth, slots, tree, accepted).float()
        ring.end(step, slots, accepted, validate=True)
    # (entries read, writes, tokens pending): the second read round's 16 tokens fill its 16 entries
    assert plan == [(16, False, 0), (16, False, 8), (16, False, 16), (32, True, 24), (16, False, 8), (16, False, 16),
                    (32, True, 24)]
    ring.flush(slots, [pool], [arena])
    assert_close(pool, truth, TOLERANCE[F32], "pool after the final flush")


def test_which_kernels_read_a_rounds_own_width():
    """The resident kernel (and the Gluon verify, a resident launch) and the fused kernel with blocks of at most
    `RING_NARROW_FUSED_BLOCK` rows read the round's entries; the fused kernel with larger blocks reads at least
    `RING_FUSED_MIN_COLUMNS`, never more than the table's."""
    from bole_tune.kernels import Launch
    from bole_tune.kernels.verify.run import RING_FUSED_MIN_COLUMNS, RING_NARROW_FUSED_BLOCK, ring_columns

    config, big = KernelConfig(32, 64, 4, 2), 2 * RING_NARROW_FUSED_BLOCK
    for variant, block, step, table, expected in (
            ("resident", 64, 16, 32, 16), ("stream", 16, 16, 64, 16), ("fused", RING_NARROW_FUSED_BLOCK, 16, 32, 16),
            ("fused", big, 16, 64, RING_FUSED_MIN_COLUMNS), ("fused", big, 16, 16, 16), ("fused", big, 64, 64, 64)):
        assert ring_columns(Launch(variant, config, block), step, table) == expected, (variant, block, step, table)


def test_ring_mistakes_are_refused(device):
    ring = PendingRing(NUM_SLOTS, 2, 4, capacity=16, max_requests=2, device=device)
    arena = ring.results(HEADS, F32)
    tree = make_tree([4, 4], "chain", device=device)
    x = make_inputs(tree, HEADS.hk, HEADS.hv, HEADS.dk, HEADS.dv, F32, device, num_slots=NUM_SLOTS)
    with pytest.raises(ValueError, match="tree: depth 7 gives paths of 8 nodes"):
        ring.begin(make_tree([8], "chain", device=device))
    with pytest.raises(ValueError, match="tree: 5 requests"):  # max_requests 2, rounded up to 4
        ring.begin(make_tree([1] * 5, device=device))
    with pytest.raises(ValueError, match="rounds: expected a positive int"):
        PendingRing(NUM_SLOTS, 0, 4, 16, 2, device)
    step = ring.begin(tree)
    with pytest.raises(ValueError, match="out: with ring="):
        tree_verify(*x.args(tree), ring=step.layer(arena), out=tree_verify(*x.args(tree)))
    with pytest.raises(ValueError, match="ring: planned for other trees"):
        other = make_tree([4, 4], "chain", device=device)
        tree_verify(*x.args(other), ring=step.layer(arena))
    with pytest.raises(ValueError, match="ring.results.o: expected a contiguous torch.float32"):
        tree_verify(*x.args(tree), ring=step.layer(ring.results(HEADS, BF16)))
    with pytest.raises(TypeError, match="ring: expected a RingRead"):
        tree_verify(*x.args(tree), ring=step)
    tree_verify(*x.args(tree), ring=step.layer(arena))  # fits: the check is remembered for these buffers
    good = arena.k_scale
    arena.k_scale = good.double()  # a buffer replaced after the check is checked again
    with pytest.raises(ValueError, match="ring.results.k_scale: expected a contiguous torch.float32"):
        tree_verify(*x.args(tree), ring=step.layer(arena))
    arena.k_scale = good
    small = PendingRing(4, 2, 4, 16, 2, device)
    with pytest.raises(ValueError, match="ring: built for 4 slots"):
        tree_verify(*x.args(tree), ring=small.begin(tree).layer(small.results(HEADS, F32)))
    with pytest.raises(ValueError, match="accepted: has an entry out of range"):
        ring.end(step, x.state_indices, torch.tensor([4, 0], device=device), validate=True)
    with pytest.raises(ValueError, match="accepted: expected an int32 or int64 tensor of shape"):
        ring.end(step, x.state_indices, torch.tensor([0.0, 1.0], device=device))
    # a write round must see every slot with pending tokens (a leaver's are flushed or dropped first)
    ring.end(step, x.state_indices, torch.tensor([3, 3], device=device))
    ring.end(ring.begin(tree), x.state_indices, torch.tensor([3, 3], device=device))
    step = ring.begin(tree)
    assert step.write
    with pytest.raises(ValueError, match="a slot with pending tokens is missing from a write round"):
        ring.end(step, x.state_indices[:1].repeat(2), torch.tensor([0, 0], device=device), validate=True)


def test_every_round_position_starts_aligned(device):
    """The verify's kept binaries are keyed on 16-byte aligned pointers: each round's buffers start aligned whatever
    capacity and max_requests the ring was built with."""
    ring = PendingRing(NUM_SLOTS, 3, 5, capacity=7, max_requests=3, device=device)
    assert (ring.capacity, ring.max_requests) == (16, 4)
    arena = ring.results(HeadShape(hk=1, hv=2, dk=32, dv=32), BF16)
    tree = make_tree([7, 1, 2], device=device)
    for position in range(ring.rounds + 1):
        res = arena.at(position, tree)
        for name in ("o", "u", "log_decay", "k", "k_scale", "committed"):
            assert getattr(res, name).data_ptr() % 16 == 0, (position, name)
