"""The catalogue of malformed inputs: each gets a clear error naming what is wrong; nothing is written.

API calls run against a valid batch with one argument broken; the state pool must be unchanged after
the error. File, environment and command-line cases check that the database file is byte-for-byte
unchanged.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from bole_tune import KernelConfig, TreeBatch, database
from bole_tune.acceptance import load_acceptance
from bole_tune.kernels import tree_commit, tree_verify
from bole_tune.kernels.verify.result import VerifyShape, result_buffers
from bole_tune.shapes import HeadShape
from bole_tune.profiles import ProfileError, load_model
from bole_tune.search_space import SearchSpace
from bole_tune.workloads import make_inputs, make_tree


@pytest.fixture
def batch():
    tree = make_tree([5, 3], seed=1)
    x = make_inputs(tree, 2, 4, 32, 32, torch.float32, "cpu", seed=1)
    return tree, x


def replace(x, **changes):
    args = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, state=x.state, state_indices=x.state_indices)
    args.update(changes)
    return args


def nan_at(t, value=float("nan")):
    t = t.clone()
    t.view(-1)[0] = value
    return t


VERIFY_CASES = {
    "q-2d": (lambda t, x: replace(x, q=x.q[:, 0]), ValueError, "q: expected a 3-D tensor"),
    "q-rows": (lambda t, x: replace(x, q=x.q[:-1]), ValueError, "q: has 7 rows but the tree has 8 nodes"),
    "k-shape": (lambda t, x: replace(x, k=x.k[:, :1]), ValueError, "k: expected shape"),
    "v-rows": (lambda t, x: replace(x, v=x.v[:-1]), ValueError, "v: has 7 rows"),
    "heads-not-multiple": (lambda t, x: replace(x, v=x.v[:, :3], g=x.g[:, :3], beta=x.beta[:, :3],
                                                state=x.state[:, :3]), ValueError, "multiple of key heads"),
    "g-shape": (lambda t, x: replace(x, g=x.g[:, :2]), ValueError, "g: expected shape"),
    "beta-shape": (lambda t, x: replace(x, beta=x.beta[:-1]), ValueError, "beta: expected shape"),
    "state-shape": (lambda t, x: replace(x, state=x.state[:, :, :16]), ValueError, "state: expected shape"),
    "slots-shape": (lambda t, x: replace(x, state_indices=x.state_indices[:1]), ValueError, "state_indices: expected shape"),
    "head-size": (lambda t, x: replace(x, q=torch.randn(8, 2, 48), k=torch.randn(8, 2, 48),
                                       state=torch.zeros(5, 4, 32, 48)), ValueError, "dk=48 is not supported"),
    "q-int": (lambda t, x: replace(x, q=x.q.to(torch.int32)), TypeError, "q: dtype torch.int32"),
    "k-dtype": (lambda t, x: replace(x, k=x.k.half()), TypeError, "k: dtype torch.float16 differs"),
    "g-float64": (lambda t, x: replace(x, g=x.g.double()), TypeError, "g: dtype torch.float64"),
    "state-bf16": (lambda t, x: replace(x, state=x.state.bfloat16()), TypeError, "state: dtype"),
    "slots-float": (lambda t, x: replace(x, state_indices=x.state_indices.float()), TypeError, "state_indices: dtype"),
    "device": (lambda t, x: replace(x, k=x.k.to("meta")), ValueError, "k: on device meta"),
    "not-a-tensor": (lambda t, x: replace(x, q=x.q.tolist()), TypeError, "q: expected a torch.Tensor"),
    "g-nan": (lambda t, x: replace(x, g=nan_at(x.g)), ValueError, "g: contains NaN or \\+inf"),
    "q-nan": (lambda t, x: replace(x, q=nan_at(x.q)), ValueError, "q: contains NaN or inf"),
    "v-inf": (lambda t, x: replace(x, v=nan_at(x.v, float("inf"))), ValueError, "v: contains NaN or inf"),
    "beta-inf": (lambda t, x: replace(x, beta=nan_at(x.beta, float("inf"))), ValueError, "beta: contains NaN or inf"),
    "g-positive": (lambda t, x: replace(x, g=nan_at(x.g, 0.5)), ValueError, "g: has positive entries"),
    "beta-above-1": (lambda t, x: replace(x, beta=nan_at(x.beta, 1.5)), ValueError, "beta: has entries outside"),
    "slot-negative": (lambda t, x: replace(x, state_indices=torch.tensor([-1, 0], dtype=torch.int32)), ValueError,
                      "negative slot index"),
    "slot-too-large": (lambda t, x: replace(x, state_indices=torch.tensor([0, 5], dtype=torch.int32)), ValueError,
                       "slot index >= num_slots=5"),
    "slot-repeated": (lambda t, x: replace(x, state_indices=torch.tensor([2, 2], dtype=torch.int32)), ValueError,
                      "names a slot twice"),
    "state-strided": (lambda t, x: replace(x, state=x.state.transpose(2, 3)), ValueError,
                      "last \\(dk\\) dimension must be contiguous"),
    # the kernels read the slots as a row: a strided view was read wrongly before (silently)
    "slots-strided": (lambda t, x: replace(x, state_indices=torch.tensor([1, 9, 3, 9], dtype=torch.int32)[::2]),
                      ValueError, "state_indices: must be contiguous"),
    "scale-nan": (lambda t, x: dict(replace(x), scale=float("nan")), ValueError, "scale: expected a positive"),
    "scale-bool": (lambda t, x: dict(replace(x), scale=True), ValueError, "scale: expected a positive"),
}


# checked on the device: only when asked (validate=True or BOLE_TUNE_VALIDATE=1), never by default
VALUE_CASES = ("g-nan", "q-nan", "v-inf", "beta-inf", "g-positive", "beta-above-1", "slot-negative", "slot-too-large", "slot-repeated")


@pytest.mark.parametrize("case", list(VERIFY_CASES), ids=list(VERIFY_CASES))
def test_tree_verify_refuses(batch, case):
    tree, x = batch
    make, error, message = VERIFY_CASES[case]
    before = x.state.clone()
    args = make(tree, x)
    with pytest.raises(error, match=message):
        tree_verify(tree=tree, validate=True if case in VALUE_CASES else None, **args)
    assert torch.equal(x.state, before)


def test_the_quick_checks_accept_exactly_what_the_named_checks_accept(batch):
    """The checks run first as one chain of comparisons (`_verify_shape`); it must refuse every input the one-by-one
    checks refuse (else a bad input would pass unnamed) and give their shape for a good one."""
    from bole_tune.kernels.verify.checks import _explained_verify_shape, _verify_shape

    tree, x = batch
    for case, (make, _, _) in VERIFY_CASES.items():
        if case in VALUE_CASES:
            continue
        args = make(tree, x)
        args.setdefault("scale", None)
        assert _verify_shape(tree=tree, **args) is None, f"{case}: the quick checks let it through"
    for scale in (None, 0.5, 2):
        good = dict(replace(x), scale=scale)
        assert _verify_shape(tree=tree, **good) in (None, _explained_verify_shape(tree=tree, **good))
    assert _verify_shape(tree=tree, **replace(x), scale=None) == _explained_verify_shape(tree=tree, **replace(x),
                                                                                           scale=None)


@pytest.mark.parametrize("case", ["g-nan", "slot-repeated"])
def test_value_checks_run_when_asked_and_only_then(batch, case, monkeypatch):
    """The default call does no device-to-host copy, so a bad value passes; BOLE_TUNE_VALIDATE=1 checks
    every call of the process; validate=False wins over the environment."""
    tree, x = batch
    make, error, message = VERIFY_CASES[case]
    args = make(tree, x)
    tree_verify(tree=tree, **args)
    monkeypatch.setenv("BOLE_TUNE_VALIDATE", "1")
    with pytest.raises(error, match=message):
        tree_verify(tree=tree, **args)
    tree_verify(tree=tree, validate=False, **args)


OPTION_CASES = {
    "scale-negative": (dict(scale=-1.0), ValueError, "scale: expected a positive finite number"),
    "scale-nan": (dict(scale=float("nan")), ValueError, "scale: expected a positive finite number"),
    "config-type": (dict(config=(64, 32, 4, 2)), TypeError, "config: expected a KernelConfig"),
    "config-tiles": (dict(config=KernelConfig(64, 64)), ValueError, "config: tiles b_k=64, b_v=64 must divide dk=32"),
    "tree-type": (dict(tree=[[-1, 0]]), TypeError, "tree: expected a TreeBatch"),
    "variant-name": (dict(variant="fast"), ValueError, "variant: expected one of"),
}


@pytest.mark.parametrize("case", list(OPTION_CASES), ids=list(OPTION_CASES))
def test_tree_verify_refuses_options(batch, case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # reach the launcher's config checks on the CPU
    tree, x = batch
    kwargs, error, message = OPTION_CASES[case]
    with pytest.raises(error, match=message):
        tree_verify(**{"tree": tree, **replace(x), **kwargs})


def test_out_buffer_of_the_wrong_shape(batch):
    tree, x = batch
    wrong = result_buffers(VerifyShape(heads=HeadShape(hk=2, hv=4, dk=32, dv=16), num_nodes=8, num_requests=2,
                                       num_slots=5, scale=1.0), torch.float32, "cpu", tree, None)
    with pytest.raises(ValueError, match="out.o: expected a contiguous"):
        tree_verify(*x.args(tree), out=wrong)


TREE_CASES = {
    "forward-parent": ([[-1, 2, 0]], ValueError, "parent 2 does not precede its child 1"),
    "parent-minus-2": ([[-1, -2]], ValueError, "parent -2 is out of range"),
    "self-parent": ([[-1, 1]], ValueError, "does not precede its child 1"),
    "empty-request": ([[-1], []], ValueError, "request 1 has no nodes"),
    "empty-batch": ([], ValueError, "the batch is empty"),
    "float-parent": ([[-1, 0.5]], TypeError, "expected an int"),
    "float-tensor": ([torch.tensor([-1.0, 0.0])], TypeError, "expected a 1-D integer tensor"),
    "not-a-list": (3, TypeError, "expected a list"),
    "bool-tensor-parent": ([[-1, torch.tensor(True)]], TypeError, "expected an int, got tensor\\(True\\)"),
}


@pytest.mark.parametrize("case", list(TREE_CASES), ids=list(TREE_CASES))
def test_tree_batch_refuses(case):
    parents, error, message = TREE_CASES[case]
    with pytest.raises(error, match=message):
        TreeBatch.from_parents(parents)


def test_tree_batch_takes_numpy_parents():
    """NumPy integer arrays (one per request) and integer scalars are parents like lists of ints; other arrays are
    refused by name."""
    np = pytest.importorskip("numpy")
    want = TreeBatch.from_parents([[-1, 0, 1, 0], [-1, -1]])
    for parents in ([np.array([-1, 0, 1, 0]), np.array([-1, -1], dtype=np.int32)],
                    [[np.int64(-1), np.int32(0), np.int16(1), 0], np.array([-1, -1], dtype=np.int8)]):
        tree = TreeBatch.from_parents(parents)
        assert tree._host_parents == want._host_parents and torch.equal(tree.dfs_exit, want.dfs_exit)
    for parents, message in (([np.array([-1.0, 0.0])], "expected a 1-D integer array, got dtype float64"),
                             ([np.array([[-1, 0]])], r"expected a 1-D integer array, got dtype int64 with shape \(1, 2\)"),
                             ([np.array([True, False])], "expected a 1-D integer array, got dtype bool"),
                             ([[-1, np.bool_(True)]], r"parents_per_request\[0\]\[1\]: expected an int"),
                             ([[-1, np.float32(0)]], r"parents_per_request\[0\]\[1\]: expected an int")):
        with pytest.raises(TypeError, match=message):
            TreeBatch.from_parents(parents)


@pytest.mark.parametrize("field, change, error, message", [
    ("offsets", lambda x: x.long(), TypeError, "TreeBatch.offsets: expected a contiguous int32 tensor"),
    ("dfs_exit", lambda x: torch.stack([x, x], 1)[:, 0], TypeError, "TreeBatch.dfs_exit: expected a contiguous int32"),
    ("node_depth", lambda x: x.to("meta"), ValueError, "TreeBatch.node_depth: on meta but offsets are on cpu"),
])
def test_a_hand_built_tree_batch_is_checked(field, change, error, message):
    """The kernels take a tree's tensors as int32 rows on the inputs' device (and a launch is keyed on that):
    a `TreeBatch` built by hand is checked when it is made."""
    tree = TreeBatch.from_parents([[-1, 0, 0], [-1, 0]])
    fields = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree) if f.name != "_cache"}
    fields[field] = change(fields[field])
    with pytest.raises(error, match=message):
        TreeBatch(**fields)


COMMIT_CASES = {
    "accepted-out-of-range": (lambda t, x, r: dict(accepted=torch.tensor([5, 0])), ValueError,
                              "accepted\\[0\\]=5 is out of range for request 0 with 5 nodes"),
    "accepted-below-minus-1": (lambda t, x, r: dict(accepted=torch.tensor([0, -2])), ValueError, "accepted\\[1\\]=-2"),
    "accepted-shape": (lambda t, x, r: dict(accepted=torch.tensor([0])), ValueError, "accepted: expected shape"),
    "accepted-float": (lambda t, x, r: dict(accepted=torch.tensor([0.0, 1.0])), TypeError, "accepted: dtype"),
    "res-type": (lambda t, x, r: dict(res={"o": r.o}), TypeError, "res: expected the TreeVerifyResult"),
    "state-shape": (lambda t, x, r: dict(state=x.state[:, :2]), ValueError, "state: expected shape"),
    "slots-repeated": (lambda t, x, r: dict(state_indices=torch.tensor([1, 1], dtype=torch.int32)), ValueError,
                       "names a slot twice"),
    "accepted-strided": (lambda t, x, r: dict(accepted=torch.tensor([0, 7, 1, 7])[::2]), ValueError,
                         "accepted: must be contiguous"),
    "res-tree-of-other-size": (lambda t, x, r: dict(res=dataclasses.replace(r, tree=make_tree([5, 4], seed=2))),
                               ValueError, "res: its factors have 8 rows \\(u\\) and 8 \\(k\\) but its tree has 9 nodes"),
    "res-tree-none": (lambda t, x, r: dict(res=dataclasses.replace(r, tree=None)), TypeError,
                      "res.tree: expected the TreeBatch"),
    "res-field-device": (lambda t, x, r: dict(res=dataclasses.replace(r, k_scale=r.k_scale.to("meta"))), ValueError,
                         "res.k_scale: on device meta"),
    # the factors the kernel reads, each as tree_verify makes it (before, a strided u was read by its sizes: a wrong
    # state; an fp64 log_decay crashed inside Triton)
    "res-u-strided": (lambda t, x, r: dict(res=dataclasses.replace(r, u=r.u.transpose(1, 2).contiguous()
                                                                   .transpose(1, 2))),
                      ValueError, "res.u: must be contiguous"),
    "res-u-bf16": (lambda t, x, r: dict(res=dataclasses.replace(r, u=r.u.bfloat16())), TypeError,
                   "res.u: dtype torch.bfloat16; expected torch.float32"),
    "res-log-decay-fp64": (lambda t, x, r: dict(res=dataclasses.replace(r, log_decay=r.log_decay.double())), TypeError,
                           "res.log_decay: dtype torch.float64"),
    "res-log-decay-shape": (lambda t, x, r: dict(res=dataclasses.replace(r, log_decay=r.log_decay[:, :2])), ValueError,
                            r"res.log_decay: expected shape \[N, Hv\] = \(8, 4\), got \(8, 2\)"),
    "res-k-scale-missing": (lambda t, x, r: dict(res=dataclasses.replace(r, k_scale=None)), TypeError,
                            "res.k_scale: expected a torch.Tensor"),
    "res-k-float64": (lambda t, x, r: dict(res=dataclasses.replace(r, k=r.k.double())), TypeError,
                      "res.k: dtype torch.float64; expected the inputs' dtype"),
    "res-k-heads": (lambda t, x, r: dict(res=dataclasses.replace(r, k=torch.zeros(8, 3, 32),
                                                                  k_scale=torch.ones(8, 3))),
                    ValueError, "res.k: has 3 key heads; res.u's Hv=4 value heads must be a positive multiple"),
    "res-committed-int64": (lambda t, x, r: dict(res=dataclasses.replace(r, committed=r.committed.long())), TypeError,
                            "res.committed: dtype torch.int64; expected torch.int32"),
}


@pytest.mark.parametrize("case", list(COMMIT_CASES), ids=list(COMMIT_CASES))
def test_tree_commit_refuses(batch, case):
    tree, x = batch
    res = tree_verify(*x.args(tree))
    make, error, message = COMMIT_CASES[case]
    before = x.state.clone()
    args = {"state": x.state, "state_indices": x.state_indices, "res": res, "accepted": torch.tensor([0, 1]),
            **make(tree, x, res)}
    with pytest.raises(error, match=message):
        tree_commit(validate=True if case in ("accepted-out-of-range", "accepted-below-minus-1", "slots-repeated")
                    else None, **args)
    assert torch.equal(x.state, before), "a refused commit wrote the state pool"


def test_the_commit_s_quick_checks_refuse_what_its_named_checks_refuse(batch):
    from bole_tune.kernels.verify.checks import _commit_inputs_hold

    tree, x = batch
    res = tree_verify(*x.args(tree))
    good = {"state": x.state, "state_indices": x.state_indices, "result": res, "accepted": torch.tensor([0, 1])}
    assert _commit_inputs_hold(**good)
    for case, (make, _, _) in COMMIT_CASES.items():
        if case in ("accepted-out-of-range", "accepted-below-minus-1", "slots-repeated"):  # values: on the device
            continue
        args = dict(good, **{("result" if k == "res" else k): v for k, v in make(tree, x, res).items()})
        assert not _commit_inputs_hold(**args), f"{case}: the quick checks let it through"


@pytest.mark.parametrize("path", ["kernel", "fallback"])
@pytest.mark.parametrize("accepted", [[5, 0], [0, 7], [-2, 0], [2**31 - 1, -5]], ids=str)
def test_an_unchecked_accepted_node_out_of_range_leaves_its_slot(device, accepted, path, monkeypatch):
    """Without value checks the commit (the kernel, or the PyTorch fallback off a GPU without the
    interpreter) still never reads past a request's nodes: a request whose accepted node is out of range
    keeps its state, the others commit as usual."""
    if path == "fallback":
        device = "cpu"
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    tree = make_tree([5, 3], seed=1, device=device)
    x = make_inputs(tree, 2, 4, 32, 32, torch.float32, device, seed=1)
    res = tree_verify(*x.args(tree))
    accepted_t = torch.tensor(accepted, device=device)
    good = [r for r, (a, size) in enumerate(zip(accepted, tree.sizes)) if 0 <= a < size]
    expected = x.state.clone()
    if good:  # on a result of its own: a result's paths are committed once
        tree_commit(expected, x.state_indices, tree_verify(*x.args(tree)),
                    torch.where(torch.tensor([r in good for r in range(2)], device=device), accepted_t, -1))
    tree_commit(x.state, x.state_indices, res, accepted_t, validate=False)
    assert torch.equal(x.state, expected)


@pytest.mark.parametrize("kwargs, message", [
    (dict(b_k=48, b_v=32), "KernelConfig.b_k: expected a power of two >= 16"),
    (dict(b_k=32, b_v=8), "KernelConfig.b_v"),
    (dict(b_k=32, b_v=32, num_warps=3), "KernelConfig.num_warps"),
    (dict(b_k=32, b_v=32, num_stages=0), "KernelConfig.num_stages"),
], ids=["b_k", "b_v", "warps", "stages"])
def test_kernel_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig(**kwargs)


GOOD_MODEL = open(os.path.join(os.path.dirname(__file__), "..", "profiles", "models", "qwen3.5-9b.yaml")).read()


@pytest.mark.parametrize("text, message", [
    ("name: [unclosed", "not valid YAML"),
    (GOOD_MODEL + "colour: blue\n", "colour: unknown field"),
    (GOOD_MODEL.replace("num_value_heads: 32", "num_value_heads: many"), "gdn.num_value_heads: expected a positive int"),
    (GOOD_MODEL.replace("num_value_heads: 32", "num_value_heads: 30"), "not a multiple of num_key_heads"),
    (GOOD_MODEL.replace("kind: dense", "kind: sparse"), "ffn.kind: expected 'dense' or 'moe'"),
    ("- a list\n", "expected a mapping at the top level"),
], ids=["yaml", "unknown-field", "bad-int", "heads", "ffn-kind", "not-a-mapping"])
def test_model_profile_errors_name_file_and_field(tmp_path, text, message):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message) as info:
        load_model(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text, message", [
    ("b_k: []\nb_v: [32]\nnum_warps: [4]\nnum_stages: [2]\n", "b_k: the list is empty"),
    ("b_k: [24]\nb_v: [32]\nnum_warps: [4]\nnum_stages: [2]\n", "KernelConfig.b_k"),
    ("b_k: [32]\nb_v: [32]\nnum_warps: [4]\nnum_stages: [2]\nblock_t: [64]\n", "block_t: unknown field"),
], ids=["empty", "not-power-of-two", "unknown"])
def test_search_space_errors(tmp_path, text, message):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message):
        SearchSpace.load(path)


def test_acceptance_model_error(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("name: a\ndepth_acceptance: [1.5]\nalternative_share: [0.1]\n")
    with pytest.raises(ProfileError, match="depth_acceptance\\[0\\]: expected a probability"):
        load_acceptance(str(path))


@pytest.mark.parametrize("variable, value, call, message", [
    ("BOLE_TUNE_LOOKUP", "fastest", lambda: __import__("bole_tune.lookup").lookup.policy(), "BOLE_TUNE_LOOKUP"),
    ("BOLE_TUNE_VALIDATE", "maybe", lambda: __import__("bole_tune.kernels.common").kernels.common.validation_enabled(None),
     "BOLE_TUNE_VALIDATE"),
    ("BOLE_TUNE_HEARTBEAT", "often", lambda: __import__("bole_tune.tuner").tuner.open_storage("sqlite://"),
     "BOLE_TUNE_HEARTBEAT"),
], ids=["lookup", "validate", "heartbeat"])
def test_bad_environment_variables(monkeypatch, variable, value, call, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("url, message", [("studies.db", "is not a storage URL"), ("nosuchdb://host/x", "cannot open")],
                         ids=["no-scheme", "unknown-dialect"])
def test_bad_storage_urls(url, message):
    from bole_tune.tuner import open_storage
    with pytest.raises(ValueError, match=message):
        open_storage(url)


@pytest.fixture
def db_file(tmp_path):
    from test_database import KEY, entry
    path = tmp_path / "replay-gpu.yaml"
    database.update(path, configs={KEY.text: entry()})
    return path


@pytest.mark.parametrize("args, message", [
    (["tune", "--workers", "0", "--replay", "REC"], "--workers"),
    (["tune", "--record", "out.json", "--replay", "REC"], "--record: only with --exhaustive"),
    (["tune", "--trials", "0", "--replay", "REC"], "--trials"),
    (["step", "--context", "0"], "--context"),
    (["budget", "--gpu", "replay-gpu", "--model", "qwen3.5-9b"], "no step curve"),
    (["lookup", "--hv", "0", "--hk", "16", "--dk", "128", "--dv", "128", "--tree-size", "64", "--batch", "1"], "--hv"),
], ids=["workers", "record", "trials", "context", "budget-no-curve", "lookup-heads"])
def test_cli_refuses_and_leaves_the_database_alone(tmp_path, db_file, args, message):
    from test_tuner import write_recording
    before = db_file.read_bytes()
    args = [str(write_recording(tmp_path / "rec.json")) if a == "REC" else a for a in args]
    env = {**os.environ}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-m", "bole_tune.cli", *args, "--db-dir", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and message in result.stderr + result.stdout
    assert db_file.read_bytes() == before, "a refused command changed the database"


def test_unknown_schema_and_truncated_database(db_file):
    text = db_file.read_text()
    hand_edited = "".join(text.splitlines(keepends=True)[1:])  # a hand edit drops the digest line, as it says
    db_file.write_text(hand_edited.replace("schema_version: 1", "schema_version: 3"))
    with pytest.raises(database.DatabaseError, match="reads versions \\[1\\]"):
        database.load(db_file)
    db_file.write_text(text[: len(text) // 3] + "\n  - {")
    with pytest.raises(database.DatabaseError, match="replay-gpu.yaml"):
        database.load(db_file)


def test_commit_of_all_layers_refuses(batch):
    from bole_tune.kernels import LayerResults, tree_commit_layers

    tree, x = batch
    results = LayerResults.empty(2, tree, HeadShape(hk=2, hv=4, dk=32, dv=32), torch.float32, "cpu")
    states = torch.stack([x.state, x.state.clone()])
    accepted = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"states: expected shape \[L=2"):
        tree_commit_layers(states[:1], x.state_indices, results, tree, accepted)
    with pytest.raises(TypeError, match="results: expected LayerResults"):
        tree_commit_layers(states, x.state_indices, results.layer(0, tree), tree, accepted)
    with pytest.raises(ValueError, match="accepted: expected shape"):
        tree_commit_layers(states, x.state_indices, results, tree, accepted[:1])
    with pytest.raises(ValueError, match="accepted\\[0\\]=9 is out of range"):
        tree_commit_layers(states, x.state_indices, results, tree, torch.tensor([9, 0]), validate=True)


LAYERS_CASES = {  # what the all-layer commit's named checks refuse: (change, error, message)
    "states-4d": (lambda s, r: dict(states=s[0]), ValueError, r"states: expected shape \[L=2"),
    "states-fp16": (lambda s, r: dict(states=s.half()), TypeError, "state: dtype torch.float16"),
    "states-dk-strided": (lambda s, r: dict(states=s.transpose(3, 4)), ValueError,
                          r"state: the last \(dk\) dimension must be contiguous"),
    "states-slots-only": (lambda s, r: dict(states=s[:, :, :2]), ValueError, "state: expected shape"),
    "u-layer-strided": (lambda s, r: dict(results=dataclasses.replace(r, u=r.u.transpose(2, 3).contiguous()
                                                                          .transpose(2, 3))),
                        ValueError, "results.u: each layer must be contiguous"),
    "committed-1d": (lambda s, r: dict(results=dataclasses.replace(r, committed=r.committed[0])), ValueError,
                     "res.committed: expected shape"),
    "committed-strided": (lambda s, r: dict(results=dataclasses.replace(
        r, committed=torch.zeros(2, 2 * r.committed.shape[1], dtype=torch.int32)[:, ::2])), ValueError,
        "results.committed: each layer must be contiguous"),
    "k-scale-device": (lambda s, r: dict(results=dataclasses.replace(r, k_scale=r.k_scale.to("meta"))), ValueError,
                       "res.k_scale: on device meta"),
    "results-type": (lambda s, r: dict(results=r.layer(0)), TypeError, "results: expected LayerResults"),
    "tree-of-other-size": (lambda s, r: dict(tree=make_tree([5, 4], seed=2)), ValueError,
                           "tree: has 9 nodes but results hold 8 rows a layer"),
    "states-list": (lambda s, r: dict(states=[s]), TypeError, "states: expected"),
    "accepted-shape": (lambda s, r: dict(accepted=torch.tensor([0])), ValueError, "accepted: expected shape"),
    "accepted-float": (lambda s, r: dict(accepted=torch.tensor([0.0, 1.0])), TypeError, "accepted: dtype"),
    "slots-strided": (lambda s, r: dict(state_indices=torch.tensor([0, 9, 1, 9], dtype=torch.int32)[::2]),
                      ValueError, "state_indices: must be contiguous"),
    "u-bf16": (lambda s, r: dict(results=dataclasses.replace(r, u=r.u.bfloat16())), TypeError,
               "res.u: dtype torch.bfloat16; expected torch.float32"),
    "log-decay-fp16": (lambda s, r: dict(results=dataclasses.replace(r, log_decay=r.log_decay.half())), TypeError,
                       "res.log_decay: dtype torch.float16"),
    "k-int": (lambda s, r: dict(results=dataclasses.replace(r, k=r.k.int())), TypeError, "res.k: dtype torch.int32"),
    "k-heads": (lambda s, r: dict(results=dataclasses.replace(r, k=torch.zeros(2, 8, 3, 32),
                                                              k_scale=torch.ones(2, 8, 3))),
                ValueError, "res.k: has 3 key heads"),
    "committed-int64": (lambda s, r: dict(results=dataclasses.replace(r, committed=r.committed.long())), TypeError,
                        "res.committed: dtype torch.int64"),
}


@pytest.mark.parametrize("case", list(LAYERS_CASES), ids=list(LAYERS_CASES))
def test_the_all_layer_commit_s_quick_checks_refuse_what_its_named_checks_refuse(batch, case):
    """`tree_commit_layers` skips its named checks where one chain of comparisons on the stacked tensors holds
    (`_layers_hold`): that chain must let through what is good and nothing the named checks refuse."""
    from bole_tune.kernels import LayerResults, tree_commit_layers
    from bole_tune.kernels.verify.tree_commit import _layers_hold

    tree, x = batch
    results = LayerResults.empty(2, tree, HeadShape(hk=2, hv=4, dk=32, dv=32), torch.float32, "cpu")
    for layer in range(2):
        tree_verify(*x.args(tree), out=results.layer(layer))
    states = torch.stack([x.state, x.state.clone()])
    good = {"states": states, "state_indices": x.state_indices, "results": results, "tree": tree,
            "accepted": torch.tensor([0, 1])}
    assert _layers_hold(**good), "the quick checks refuse good inputs: every call takes the slow path"
    change, error, message = LAYERS_CASES[case]
    args = dict(good, **change(states, results))
    assert not _layers_hold(**args), f"{case}: the quick checks let it through"
    before = states.clone()
    with pytest.raises(error, match=message):
        tree_commit_layers(**args)
    assert torch.equal(states, before), "a refused commit wrote the pools"


BETWEEN_ROUNDS_CASES = {
    "tree": (dict(tree=None), TypeError, "tree: expected the previous round's TreeBatch"),
    "num-slots-zero": (dict(num_slots=0), ValueError, "num_slots: expected a positive int"),
    "num-slots-float": (dict(num_slots=8.0), ValueError, "num_slots: expected a positive int"),
    "accepted-shape": (dict(accepted=torch.tensor([1])), ValueError, r"accepted: expected shape \[2\]"),
    "accepted-float": (dict(accepted=torch.tensor([1.0, 0.0])), TypeError, "accepted: dtype torch.float32"),
    "slots-float": (dict(state_indices=torch.tensor([1.0, 2.0])), TypeError, "state_indices: dtype"),
    "slots-list": (dict(state_indices=[1, 2]), TypeError, "state_indices: expected an int32 or int64 tensor"),
    "next-2d": (dict(next_state_indices=torch.tensor([[1, 2]])), ValueError, r"next_state_indices: expected shape 1-D"),
    "next-device": (dict(next_state_indices=torch.tensor([1, 2], device="meta")), ValueError,
                    "next_state_indices: on device meta"),
    # values: checked when asked
    "slot-too-large": (dict(state_indices=torch.tensor([1, 8]), validate=True), ValueError,
                       "state_indices: has a slot index >= num_slots=8"),
    "slot-repeated": (dict(state_indices=torch.tensor([3, 3]), validate=True), ValueError,
                      "state_indices: names a slot twice"),
    "next-negative": (dict(next_state_indices=torch.tensor([2, -1, 1]), validate=True), ValueError,
                      "next_state_indices: has a negative slot index"),
    "accepted-out-of-range": (dict(accepted=torch.tensor([5, 0]), validate=True), ValueError,
                              "accepted: has an entry out of range"),
}


@pytest.mark.parametrize("case", sorted(BETWEEN_ROUNDS_CASES))
def test_between_rounds_refuses(case):
    from bole_tune.kernels import PendingPaths

    tree = TreeBatch.from_parents([[-1, 0, 0], [-1, 0]])
    args = dict(tree=tree, accepted=torch.tensor([2, 1]), state_indices=torch.tensor([1, 2]),
                next_state_indices=torch.tensor([2, 5, 1]), num_slots=8)
    changes, error, message = BETWEEN_ROUNDS_CASES[case]
    with pytest.raises(error, match=message):
        PendingPaths.between_rounds(**{**args, **changes})


@pytest.mark.parametrize("triton_path", [False, True])
def test_between_rounds_pairs_slots_out_of_range_with_nothing(triton_path, device, monkeypatch):
    """Unchecked, a slot out of range in either round pairs with nothing (no index outside the tables is used): a
    next-round request on one has nothing pending; a previous request on one is left out, never the request of the
    slot it would wrap onto. The map against a dictionary of the slots in range (the Triton path on the session's
    device: the GPU's, or the CPU's under the interpreter; the torch path on CPU tensors without it)."""
    from bole_tune.kernels import PendingPaths

    if not triton_path:
        device = "cpu"
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    tree = TreeBatch.from_parents([[-1, 0], [-1], [-1, 0, 1], [-1, 0]], device=device)
    prev = torch.tensor([5, 9, -2, 2], dtype=torch.int32, device=device)  # 8 slots: 9 and -2 out of range
    following = torch.tensor([2, 5, 11, 0, 9, -2, 7], dtype=torch.int32, device=device)
    paths = PendingPaths.between_rounds(tree, torch.tensor([1, 0, 2, 1], device=device), prev, following, 8)
    owner = {s: r for r, s in enumerate(prev.tolist()) if 0 <= s < 8}
    assert paths.request_map.tolist() == [owner.get(s, -1) for s in following.tolist()] == [3, 0, -1, -1, -1, -1, -1]
    rows = paths.path_rows.tolist()
    assert rows[0][:3] == [6, 7, -1] and rows[1][:3] == [0, 1, -1]  # request 3's path (rows 6, 7), request 0's
    assert all(r == [-1] * len(r) for r in rows[2:])


def test_ring_drop_flush_and_results_refuse():
    from bole_tune.kernels import PendingRing

    heads = HeadShape(hk=1, hv=2, dk=16, dv=16)
    ring = PendingRing(6, 2, 4, 32, 4, "cpu")
    arena = ring.results(heads, torch.float32)
    pool = torch.zeros(6, 2, 16, 16)
    with pytest.raises(TypeError, match="slots: dtype torch.float32"):
        ring.drop(torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"slots: expected shape 1-D"):
        ring.drop(torch.tensor([[1]]))
    with pytest.raises(ValueError, match=r"slots: has a slot index out of range \[0, 6\)"):
        ring.drop(torch.tensor([2, 6]), validate=True)
    with pytest.raises(ValueError, match=r"slots: has a slot index out of range"):
        ring.flush(torch.tensor([-1]), [pool], [arena], validate=True)
    with pytest.raises(ValueError, match=r"states\[0\]: expected a float32 pool \[num_slots=6, Hv=2"):
        ring.flush(torch.tensor([1]), [pool[:, :1]], [arena])
    with pytest.raises(ValueError, match=r"states\[0\]: expected a float32 pool"):
        ring.flush(torch.tensor([1]), [pool.double()], [arena])
    with pytest.raises(TypeError, match=r"results\[0\]: expected a RingResults"):
        ring.flush(torch.tensor([1]), [pool], [pool])
    with pytest.raises(ValueError, match="states, results: one per layer"):
        ring.flush(torch.tensor([1]), [pool, pool], [arena])
    with pytest.raises(TypeError, match="dtype: torch.int32 is not an input dtype"):
        ring.results(heads, torch.int32)
    with pytest.raises(TypeError, match="heads: expected a HeadShape"):
        ring.results((1, 2, 16, 16), torch.float32)
    ring.drop(torch.tensor([0, 5]), validate=True)  # in range: accepted
    ring.flush(torch.tensor([1], dtype=torch.int32), [pool], [arena], validate=True)


def test_layer_results_refuse():
    from bole_tune.kernels import LayerResults

    tree = TreeBatch.from_parents([[-1, 0], [-1]])
    heads = HeadShape(hk=1, hv=2, dk=16, dv=16)
    with pytest.raises(ValueError, match="num_layers: expected a positive int, got 0"):
        LayerResults.empty(0, tree, heads, torch.float32, "cpu")
    with pytest.raises(TypeError, match="dtype: torch.int8"):
        LayerResults.empty(2, tree, heads, torch.int8, "cpu")
    with pytest.raises(TypeError, match="tree: expected a TreeBatch"):
        LayerResults.empty(2, [[-1, 0], [-1]], heads, torch.float32, "cpu")
    results = LayerResults.empty(2, tree, heads, torch.float32, "cpu")
    with pytest.raises(IndexError, match=r"index: expected a layer in \[0, 2\), got 2"):
        results.layer(2)
    with pytest.raises(IndexError, match=r"got -1"):
        results.layer(-1)
    with pytest.raises(TypeError, match="index: expected an int"):
        results.layer(1.0)
    assert results.layer(torch.tensor(1).item()).u.data_ptr() == results.u[1].data_ptr()


def test_a_folded_verify_refuses_paths_of_other_trees():
    """The previous result's rows are indexed by its paths: paths worked out on other trees (this round's instead of
    the last one's, the commonest slip) would fold in other nodes' factors. Trees of other sizes, or of the same sizes
    and other parents, are refused on the host; trees built on the device (no host parents) by their parents when
    the values are checked."""
    from bole_tune.kernels import PendingCommit, PendingPaths

    tree = TreeBatch.from_parents([[-1, 0, 1, 1], [-1, 0]])
    x = make_inputs(tree, 1, 2, 16, 16, torch.float32, "cpu", seed=3)
    res = tree_verify(*x.args(tree))
    accepted, slots = torch.tensor([2, 1]), x.state_indices

    def fold(paths_tree, validate=None):
        paths = PendingPaths.between_rounds(paths_tree, accepted, slots, slots, x.state.shape[0])
        return tree_verify(*x.args(tree), pending=PendingCommit(paths, res), validate=validate)

    before = x.state.clone()
    with pytest.raises(ValueError, match=r"other trees than pending.paths.tree .*sizes \[4, 2\] and depth 2 against "
                                         r"\[3, 3\]"):
        fold(TreeBatch.from_parents([[-1, 0, 1], [-1, 0, 1]]))
    with pytest.raises(ValueError, match="the same sizes, other parents"):
        fold(TreeBatch.from_parents([[-1, 0, 0, 1], [-1, 0]]))
    device_built = dataclasses.replace(TreeBatch.from_parents([[-1, 0, 0, 1], [-1, 0]]), _host_parents=(),
                                       _host_depths=())
    with pytest.raises(ValueError, match="the same sizes, other parents"):
        fold(device_built, validate=True)
    assert torch.equal(x.state, before)  # refused before anything was written
    fold(TreeBatch.from_parents([[-1, 0, 1, 1], [-1, 0]]))  # the same trees, built again: accepted
