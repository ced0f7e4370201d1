"""`FastLauncher`: a launch reuses a kept binary only when Triton would have specialised it the same way.

Triton's own launch path is stood in for by a recording kernel (no GPU here); the GPU tests run the real one
(every tree_verify / tree_commit call after the first goes through the kept binary there).
"""

from types import SimpleNamespace

import pytest
import torch

from bole_tune.kernels.launcher import FastLauncher


def param(constexpr=False, no_spec=False, no_align=False):
    return SimpleNamespace(is_constexpr=constexpr, do_not_specialize=no_spec, do_not_specialize_on_alignment=no_align)


class Compiled:
    """What Triton's path returns: a compiled kernel with its C launcher."""

    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "function", "metadata"

    def run(self, *args):
        self.log.append(("fast", args))


class Kernel:
    """A jit function of four parameters: x_ptr (tensor), stride (specialised int), epoch (not specialised), N
    (a constant)."""

    params = [param(), param(), param(no_spec=True), param(constexpr=True)]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.log.append(("triton", grid, args, meta))
            return Compiled(self.log)
        return launch


@pytest.fixture
def launcher(monkeypatch):
    fast = FastLauncher(Kernel())
    monkeypatch.setattr(FastLauncher, "device", staticmethod(lambda: 0))
    monkeypatch.setattr(FastLauncher, "stream", staticmethod(lambda device: 7))
    return fast


def paths(launcher):
    return [entry[0] for entry in launcher.fn.log]


def test_the_second_launch_of_a_specialisation_goes_straight_to_the_binary(launcher):
    x = torch.zeros(64)
    launcher((4,), x, 32, 1, N=8, num_warps=4)
    launcher((4, 2), x, 32, 2, N=8, num_warps=4)
    assert paths(launcher) == ["triton", "fast"]
    _, args = launcher.fn.log[1]
    # grid padded to three, the stream, the binary, no launch metadata or hooks, the arguments, None for N
    assert args == (4, 2, 1, 7, "function", "metadata", None, None, None, x, 32, 2, None)


def test_a_tensor_descriptor_is_keyed_by_its_dtype_and_block(launcher):
    """A host tensor descriptor (the TMA commit's pool) is passed to the binary as it is (Triton's C launcher
    encodes it); a descriptor of another dtype or block goes through Triton's path (another binary)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.zeros(64 * 16)

    def desc(block, base=x):
        return TensorDescriptor(base, [64, 16], [16, 1], block)

    first = desc([16, 16])
    launcher((4,), first, 32, 1, N=8)
    launcher((4,), desc([16, 16], torch.zeros(64 * 16)), 32, 1, N=8)  # another pool, the same type: kept binary
    launcher((4,), desc([32, 16]), 32, 1, N=8)
    launcher((4,), desc([16, 16], torch.zeros(64 * 16, dtype=torch.float16)), 32, 1, N=8)
    assert paths(launcher) == ["triton", "fast", "triton", "triton"]
    assert launcher.fn.log[1][1][9] is not first and isinstance(launcher.fn.log[1][1][9], TensorDescriptor)


@pytest.mark.parametrize("change", ["misaligned view", "dtype", "stride 1", "stride not a multiple of 16",
                                    "epoch past int32", "constant", "option"])
def test_a_launch_triton_would_specialise_differently_goes_through_triton(launcher, change):
    x = torch.zeros(64)
    launcher((4,), x, 32, 5, N=8, num_warps=4)
    args, meta = [x, 32, 6], {"N": 8, "num_warps": 4}
    if change == "misaligned view":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float64)
    elif change == "stride 1":
        args[1] = 1
    elif change == "stride not a multiple of 16":
        args[1] = 24
    elif change == "epoch past int32":
        args[2] = 1 << 31
    elif change == "constant":
        meta["N"] = 16
    else:
        meta["num_warps"] = 8
    launcher((4,), *args, **meta)
    assert paths(launcher) == ["triton", "triton"], change
    launcher((4,), *args, **meta)  # now kept as well
    assert paths(launcher) == ["triton", "triton", "fast"]


def test_launch_hooks_and_constants_among_the_arguments_keep_triton_s_path(launcher, monkeypatch):
    from triton import knobs

    x = torch.zeros(64)
    launcher((4,), x, 32, 5, 8)  # N given positionally: never kept
    launcher((4,), x, 32, 5, 8)
    assert paths(launcher) == ["triton", "triton"]
    launcher((4,), x, 32, 5, N=8)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launcher((4,), x, 32, 5, N=8)  # a profiler's hook wants Triton's launch metadata
    assert paths(launcher) == ["triton", "triton", "triton", "triton"]


def test_a_caller_keyed_launch_skips_the_argument_key_and_the_keywords_once_kept(launcher, monkeypatch):
    """`launch_keyed`: the first launch under a key goes through Triton with the tensors (their arguments and
    keywords built), later ones straight to the kept binary with the fast arguments (tensors as their addresses),
    without asking for either; no key (a caller that cannot vouch for the specialisation, such as a misaligned
    tensor) takes the argument-keyed path with the tensors every time."""
    x = torch.zeros(64)
    asked = []

    def meta():
        asked.append("meta")
        return {"N": 8, "num_warps": 4}

    def args(*values):
        def build():
            asked.append("args")
            return (x, *values)
        return build

    launcher.launch_keyed(("k", 32), (4,), (x.data_ptr(), 32, 5), args(32, 5), meta)
    launcher.launch_keyed(("k", 32), (4, 2), (x.data_ptr(), 32, 6), args(32, 6), meta)
    assert paths(launcher) == ["triton", "fast"] and asked == ["args", "meta"]
    _, fast = launcher.fn.log[1]
    assert fast == (4, 2, 1, 7, "function", "metadata", None, None, None, x.data_ptr(), 32, 6, None)
    launcher.launch_keyed(("k", 24), (4,), (x.data_ptr(), 24, 5), args(24, 5), meta)  # another key: Triton
    assert paths(launcher) == ["triton", "fast", "triton"] and asked.count("meta") == 2
    launcher.launch_keyed(None, (4,), (x.data_ptr(), 32, 5), args(32, 5), meta)  # unkeyed: by the tensors
    assert paths(launcher)[-1] == "fast" and launcher.fn.log[-1][1][9] is x
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launcher.launch_keyed(("k", 32), (4,), (x.data_ptr(), 32, 5), args(32, 5), meta)  # a profiler's hook
    assert paths(launcher)[-1] == "triton"
    launcher.clear()
    assert not launcher.by_caller_key and not launcher.compiled


def test_a_kept_binary_is_called_through_its_c_launcher_when_it_needs_no_scratch():
    from bole_tune.kernels.launcher import _direct_launch

    calls = []

    class Run:
        global_scratch_size, profile_scratch_size, launch_cooperative_grid, launch_pdl = 0, 0, False, True

        def launch(self, *args):
            calls.append(args)

    kernel = SimpleNamespace(run=Run())
    launch, cooperative, pdl = _direct_launch(kernel)
    assert (cooperative, pdl) == (False, True)
    launch(1, 2)
    assert calls == [(1, 2)]
    kernel.run.global_scratch_size = 64  # scratch memory: the wrapper allocates it, so it runs
    assert _direct_launch(kernel) is None
    assert _direct_launch(SimpleNamespace(run=lambda *a: None)) is None  # another launcher: its own call


def test_the_misalignment_key_names_each_misaligned_pointer():
    """`misaligned`: None where all are aligned; else which are not, so two launches misaligned in different tensors
    (Triton compiles each its own way) never share a key."""
    from bole_tune.kernels.launcher import misaligned

    def key(*pointers):
        bits = 0
        for p in pointers:
            bits |= p
        return misaligned(pointers, bits)

    assert key(0x1000, 0x2010, 0x30) is None
    assert key(0x1004, 0x2010, 0x30) == (True, False, False)
    assert key(0x1000, 0x2012, 0x30) == (False, True, False)
    assert key(0x1004, 0x2010, 0x30) != key(0x1000, 0x2012, 0x30)


def test_the_interpreter_runs_triton_s_path():
    class Interpreted:  # no params: what TRITON_INTERPRET=1 gives
        def __init__(self):
            self.calls = 0

        def __getitem__(self, grid):
            def launch(*args, **meta):
                self.calls += 1
            return launch

    fn = Interpreted()
    fast = FastLauncher(fn)
    fast((1,), 1, 2)
    fast((1,), 1, 2)
    fast.launch_keyed(("key",), (1,), (1, 2), lambda: (1, 2), dict)
    assert fn.calls == 3 and not fast.compiled and not fast.by_caller_key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: Triton's compiled launcher")
def test_kept_binaries_verify_and_commit_exactly_on_the_gpu():
    """The real thing: the second call of each specialisation runs through the kept binary and agrees with the
    float64 reference, and so does a call on a misaligned view (another specialisation, compiled by Triton)."""
    from bole_tune.kernels import tree_commit, tree_verify
    from bole_tune.kernels.reference import verify_reference
    from bole_tune.kernels.verify import run as run_module
    from bole_tune.kernels.verify import tree_commit as commit_module
    from bole_tune.workloads import make_inputs, make_tree
    from helpers import TOLERANCE, assert_close

    tree = make_tree([4, 9], "random", seed=3, device="cuda")
    x = make_inputs(tree, 2, 4, 64, 64, torch.bfloat16, "cuda", seed=3)
    ref = verify_reference(*x.args(tree))
    accepted = torch.tensor([3, 5], device="cuda")
    expected = ref.committed(x.state, x.state_indices, tree, accepted).float()
    for launcher in (run_module.RESIDENT, run_module.FUSED, commit_module.COMMIT):
        launcher.clear()
    for variant in ("resident", "fused"):
        for call in range(3):
            res = tree_verify(*x.args(tree), variant=variant)
            assert_close(res.o, ref.o, TOLERANCE[torch.bfloat16], f"{variant} call {call}")
        launcher = run_module.RESIDENT if variant == "resident" else run_module.FUSED
        assert launcher.compiled, f"{variant}: nothing kept"
    kept = len(run_module.RESIDENT.compiled)
    wide = torch.zeros(x.q.numel() + 1, dtype=x.q.dtype, device="cuda")
    q = wide[1:].view_as(x.q)  # 2 bytes past a 16-byte boundary
    q.copy_(x.q)
    keyed = len(run_module.RESIDENT.by_caller_key)
    for call in range(2):  # the second through the kept binary, keyed by the caller with q's misalignment
        res = tree_verify(q, *x.args(tree)[1:], variant="resident")
        assert_close(res.o, ref.o, TOLERANCE[torch.bfloat16], f"misaligned q, call {call}")
    assert len(run_module.RESIDENT.compiled) == kept + 1
    assert len(run_module.RESIDENT.by_caller_key) == keyed + 1, "a misaligned launch is keyed by the caller too"
    keyed = len(run_module.RESIDENT.by_caller_key)
    assert keyed >= 2, "the verify's launches are keyed by the caller"
    wide = torch.zeros(x.q.shape[0], x.q.shape[1], 2 * x.q.shape[2], dtype=x.q.dtype, device="cuda")
    q = wide[:, :, :x.q.shape[2]]  # aligned, but every row strided as in a fused projection
    q.copy_(x.q)
    for call in range(2):
        res = tree_verify(q, *x.args(tree)[1:], variant="resident")
        assert_close(res.o, ref.o, TOLERANCE[torch.bfloat16], f"strided q, call {call}")
    assert len(run_module.RESIDENT.by_caller_key) == keyed + 1, "other strides: another key"
    for call in range(2):
        pool = x.state.clone()
        tree_commit(pool, x.state_indices, tree_verify(*x.args(tree)), accepted)
        assert_close(pool, expected, TOLERANCE[torch.float32], f"commit call {call}")
    assert len(commit_module.COMMIT.compiled) == 1



def test_the_argument_key_takes_gluon_s_tensor_descriptor():
    """Gluon's host TensorDescriptor is not Triton's class: the key must still take it as a descriptor (its dtype,
    block and layout), not as a plain value it cannot hash (the Gluon verify failed its self-check on that)."""
    gluon = pytest.importorskip("bole_tune.kernels.verify.gluon")
    if gluon.gluon is None:
        pytest.skip(f"no Gluon in this Triton: {gluon.GLUON_IMPORT_ERROR}")
    from bole_tune.kernels.launcher import FastLauncher

    launcher = FastLauncher(gluon.gluon_verify_kernel)
    pool = torch.zeros(2, 4, 128, 128)
    a, b = gluon._pool_descriptor(pool, 32, 64), gluon._pool_descriptor(pool, 64, 64)
    key_a, key_b = launcher.key((a,), {}), launcher.key((b,), {})
    assert hash(key_a) != hash(key_b) and key_a != key_b  # another block: another binary
    assert key_a[1][0] == "tensordesc" and key_a[1][1] == torch.float32 and tuple(key_a[1][2]) == (64, 32)


class Warmed(Kernel):
    """A jit function with Triton's ``warmup`` (compile without launching): its compiled PTX is ``ptx``."""

    def __init__(self, ptx):
        super().__init__()
        self.ptx = ptx

    def warmup(self, *args, grid, **meta):
        self.log.append(("warmup", grid, args, meta))
        return SimpleNamespace(asm={"ptx": self.ptx}, metadata=SimpleNamespace(target=SimpleNamespace(
            backend="cuda", arch=100)))


def test_a_launch_compiled_to_a_trap_is_refused_before_it_runs(monkeypatch):
    """Triton 3.6 compiles some launches for sm_100 to a bare ``trap;`` (the fused verify with fp32 inputs and 64-row
    blocks): the first launch of a specialisation is compiled and looked at before it runs, and such a binary is
    refused with an error instead of aborting the device context; a sound one runs, and is looked at once."""
    monkeypatch.setattr(FastLauncher, "device", staticmethod(lambda: 0))
    monkeypatch.setattr(FastLauncher, "stream", staticmethod(lambda device: 7))
    x = torch.zeros(64)
    trapped = FastLauncher(Warmed(".entry k()\n{\n\ttrap;\n\tret;\n}\n"))
    with pytest.raises(RuntimeError, match="compiled this launch for cuda arch 100 to a trap"):
        trapped((4,), x, 32, 1, N=8)
    assert [entry[0] for entry in trapped.fn.log] == ["warmup"]  # never launched
    with pytest.raises(RuntimeError, match="to a trap"):  # nothing kept: refused again
        trapped.launch_keyed(("key",), (4,), (0, 32, 1), lambda: (x, 32, 1), lambda: dict(N=8))
    sound = FastLauncher(Warmed(".entry k()\n{\n\t// no trap here: trapped; is a name\n\tret;\n}\n"))
    sound((4,), x, 32, 1, N=8)
    sound((4,), x, 32, 2, N=8)
    assert [entry[0] for entry in sound.fn.log] == ["warmup", "triton", "fast"]
