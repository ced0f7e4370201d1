"""Proof against code nobody here wrote: transformers' own Qwen3.5 (``qwen3_5``) classes.

1. `validate_layers`: for random trees over a random prefix, every node's GDN-layer output from our
   tree step (convolution, gates, verification) equals what transformers computes when it runs that
   node's root-to-node path token by token from the same cache; after our commit, our recurrent and
   conv states equal transformers' cache after that path.
2. `validate_generation`: a whole speculative decoding loop (a perturbed copy of the target drafts
   trees; our tree step for the GDN layers; tree-masked attention through transformers' own attention
   modules; greedy acceptance; commit) must produce exactly the tokens of transformers' greedy
   ``generate``.

Both build a small random-weight model from transformers' real classes (float32); head sizes are
arguments, so the same checks run at production head sizes on a GPU. transformers is an optional
dependency (``pip install -e .[validate]``).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import torch

from bole_tune.gdn_layer import GDNLayerParams, gdn_tree_commit, gdn_tree_step
from bole_tune.shapes import HeadShape
from bole_tune.tree import TreeBatch
from bole_tune.workloads import relative_error, tree_parents

TOLERANCE = 2e-3  # float32 model, float32 kernels (fp32 inputs use ~fp32-accurate products on the GPU)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise RuntimeError("transformers is not installed: pip install -e '.[validate]' (or pip install transformers)") from None
    # the recurrent-state cache API the checks read (DynamicCache.get_recurrent_state) came with 5.21
    if not hasattr(transformers, "Qwen3_5ForCausalLM") or not hasattr(transformers.DynamicCache, "get_recurrent_state"):
        raise RuntimeError(f"transformers {transformers.__version__} is too old for bole-tune validate (it reads "
                           "Qwen3.5's recurrent state through DynamicCache.get_recurrent_state): pip install "
                           "'transformers>=5.21'")
    return transformers


@dataclass(frozen=True)
class ModelSize:
    """A small Qwen3.5 text model: 3 GDN layers then 1 attention layer, repeated ``groups`` times."""

    heads: HeadShape = HeadShape(hk=2, hv=4, dk=32, dv=32)
    hidden: int = 64
    groups: int = 1
    vocab: int = 97
    attention_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32

    def config(self):
        t = _transformers()
        layers = 4 * self.groups
        config = t.Qwen3_5TextConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=2 * self.hidden,
            num_hidden_layers=layers, num_attention_heads=self.attention_heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, linear_num_key_heads=self.heads.hk, linear_num_value_heads=self.heads.hv,
            linear_key_head_dim=self.heads.dk, linear_value_head_dim=self.heads.dv, eos_token_id=None,
            pad_token_id=0, bos_token_id=None)
        config._attn_implementation = "eager"
        return config


PRODUCTION = ModelSize(heads=HeadShape(hk=16, hv=32, dk=128, dv=128), hidden=512, vocab=199, attention_heads=4,
                       kv_heads=2, head_dim=64)


def build_model(size: ModelSize, device, seed: int = 0, logit_scale: float = 30.0):
    """transformers' Qwen3_5ForCausalLM with random weights of unit-scale activations.

    Linear weights get std 1/sqrt(fan_in) (activations keep their scale through the layers) and the
    LM head is scaled so logits spread by ``logit_scale``: greedy choices are then far from ties,
    which a float32 reordering could otherwise flip.
    """
    t = _transformers()
    torch.manual_seed(seed)
    model = t.Qwen3_5ForCausalLM(size.config())
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.weight.shape[1] ** -0.5)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.mul_(logit_scale)
    return model.to(device=device, dtype=torch.float32).eval()


def _cache_kwarg(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x); use whichever this version takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _prefill(model, ids: torch.Tensor):
    """Run ``ids`` ``[1, L]`` with a cache; return the cache."""
    out = model(ids, use_cache=True)
    return getattr(out, "cache", None) or out.past_key_values


def _gdn_layers(model):
    return [i for i, layer in enumerate(model.model.layers) if layer.block_type == "linear_attention"]


def _states_of(cache, layer: int, width: int):
    """(recurrent [Hv, dv, dk] in our slot layout, conv [channels, width - 1]) of one cached layer."""
    recurrent = cache.get_recurrent_state(layer)[0].transpose(-1, -2)
    conv = cache.get_conv_state(layer)[0][..., -(width - 1):]
    return recurrent.float().contiguous(), conv.float().contiguous()


@dataclass
class LayerReport:
    trees: int = 0
    nodes: int = 0
    worst_output_error: float = 0.0
    worst_state_error: float = 0.0
    worst_conv_error: float = 0.0
    failures: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def validate_layers(size: ModelSize = ModelSize(), device="cpu", trees: int = 3, tree_size: int = 12,
                    prefix: int = 7, seed: int = 0, tolerance: float = TOLERANCE) -> LayerReport:
    """Our GDN tree step against transformers running each root-to-node path token by token."""
    model = build_model(size, device, seed)
    rng = random.Random(seed)
    report = LayerReport()
    gdn = _gdn_layers(model)
    width = model.model.layers[gdn[0]].linear_attn.conv_kernel_size
    with torch.no_grad():
        for t in range(trees):
            kind = ["random", "chain", "forest"][t % 3]
            parents = tree_parents(tree_size, kind, max_depth=6, rng=rng)
            tokens = torch.tensor([rng.randrange(size.vocab) for _ in parents], device=device)
            prompt = torch.tensor([[rng.randrange(size.vocab) for _ in range(prefix)]], device=device)
            start = _prefill(model, prompt)
            captured, caches = _run_paths(model, start, parents, tokens, gdn)
            tree = TreeBatch.from_parents([parents], device=device)
            accepted = max(range(len(parents)), key=lambda n: (len(tree.path_to(0, n)), n))
            for layer in gdn:
                module = model.model.layers[layer].linear_attn
                x = torch.cat([captured[(layer, n)][0] for n in range(len(parents))])
                y_ref = torch.cat([captured[(layer, n)][1] for n in range(len(parents))])
                state0, conv0 = _states_of(start, layer, width)
                state, conv = state0[None].clone(), conv0[None].clone()
                slots = torch.zeros(1, dtype=torch.int32, device=device)
                y, step = gdn_forward(module, x, state, conv, slots, tree)
                gdn_tree_commit(state, conv, slots, step, torch.tensor([accepted], device=device))
                want_state, want_conv = _states_of(caches[accepted], layer, width)
                errors = (relative_error(y, y_ref), relative_error(state[0], want_state),
                          relative_error(conv[0], want_conv))
                report.worst_output_error = max(report.worst_output_error, errors[0])
                report.worst_state_error = max(report.worst_state_error, errors[1])
                report.worst_conv_error = max(report.worst_conv_error, errors[2])
                if max(errors) > tolerance:
                    report.failures.append(f"tree {t} ({kind}), layer {layer}: output {errors[0]:.2e}, "
                                           f"state {errors[1]:.2e}, conv state {errors[2]:.2e}")
            report.trees += 1
            report.nodes += len(parents)
    return report


def gdn_forward(module, x, state, conv_state, slots, tree, validate=None):
    """A transformers GDN module's forward over a tree, its core through our tree step.

    ``x``: ``[N, hidden]`` the layer's (normed) input at every node. Returns the layer output
    ``[N, hidden]`` and the step result (for the commit).
    """
    step = gdn_tree_step(module.in_proj_qkv(x), module.in_proj_a(x), module.in_proj_b(x),
                         GDNLayerParams.from_transformers(module), state, conv_state, slots, tree, validate=validate)
    n, hv, dv = step.o.shape
    core = module.norm(step.o.reshape(-1, dv).float(), module.in_proj_z(x).reshape(-1, dv))
    return module.out_proj(core.reshape(n, hv * dv)), step


def _run_paths(model, start_cache, parents, tokens, gdn_layers):
    """Run every node's root-to-node path token by token (a node extends its parent's cache).

    Returns the (input, output) of each GDN layer at each node and the cache after each node.
    """
    captured, caches = {}, {}
    current = {}

    def hook(layer):
        def capture(module, args, kwargs, output):
            current[layer] = (kwargs["hidden_states"][0].detach().clone(), output[0].detach().clone())
        return capture

    handles = [model.model.layers[i].linear_attn.register_forward_hook(hook(i), with_kwargs=True) for i in gdn_layers]
    try:
        for n, p in enumerate(parents):
            cache = copy.deepcopy(start_cache if p < 0 else caches[p])
            model(tokens[n].view(1, 1), use_cache=True, **{_cache_kwarg(model): cache})
            for layer in gdn_layers:
                captured[(layer, n)] = current[layer]
            caches[n] = cache
    finally:
        for handle in handles:
            handle.remove()
    return captured, caches


class _AppendCache:
    """What transformers' attention calls ``cache.update`` on: the committed keys and values plus the tree's."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.new_keys = self.new_values = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new_keys, self.new_values = key_states, value_states
        return torch.cat([self.keys, key_states], dim=2), torch.cat([self.values, value_states], dim=2)


class TreeDecoder:
    """The target model run over a proposal tree: our GDN tree steps, transformers' attention with a tree mask."""

    def __init__(self, model, prompt: torch.Tensor):
        self.model = model
        self.device = prompt.device
        self.gdn = _gdn_layers(model)
        self.width = model.model.layers[self.gdn[0]].linear_attn.conv_kernel_size
        self.slots = torch.zeros(1, dtype=torch.int32, device=self.device)
        cache = _prefill(model, prompt[None, :-1])
        self.states, self.convs, self.keys, self.values = {}, {}, {}, {}
        for i, layer in enumerate(model.model.layers):
            if i in self.gdn:
                state, conv = _states_of(cache, i, self.width)
                self.states[i], self.convs[i] = state[None].clone(), conv[None].clone()
            else:
                self.keys[i], self.values[i] = cache.layers[i].keys.clone(), cache.layers[i].values.clone()
        self.position = prompt.shape[0] - 1  # the root (last prompt token) is not yet processed

    def forward(self, tokens: torch.Tensor, parents: list[int]):
        """Logits ``[T, vocab]`` of every tree node; keeps what `commit` needs."""
        m = self.model.model
        tree = TreeBatch.from_parents([parents], device=self.device)
        depths = [len(tree.path_to(0, n)) - 1 for n in range(len(parents))]
        positions = torch.tensor([self.position + d for d in depths], device=self.device)
        h = m.embed_tokens(tokens)[None]
        cos_sin = m.rotary_emb(h, positions.view(1, 1, -1).expand(3, 1, -1))
        committed = next(iter(self.keys.values())).shape[2]
        visible = torch.ones(len(parents), committed + len(parents), dtype=torch.bool, device=self.device)
        visible[:, committed:] = tree.ancestor_mask(0, self.device)
        mask = torch.zeros(visible.shape, device=self.device).masked_fill(~visible, float("-inf"))[None, None]
        self.steps, self.appended = {}, {}
        for i, layer in enumerate(m.layers):
            residual, x = h, layer.input_layernorm(h)
            if i in self.gdn:
                out, self.steps[i] = gdn_forward(layer.linear_attn, x[0], self.states[i], self.convs[i], self.slots,
                                                 tree, validate=False)
                out = out[None]
            else:
                cache = _AppendCache(self.keys[i], self.values[i])
                out, _ = layer.self_attn(hidden_states=x, position_embeddings=cos_sin, attention_mask=mask,
                                         cache=cache)
                self.appended[i] = (cache.new_keys, cache.new_values)
            h = residual + out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.tree = tree
        return self.model.lm_head(m.norm(h))[0]

    def commit(self, path: list[int]) -> None:
        """Keep the accepted path (root first): GDN states by our commit, attention keys by selection."""
        last = torch.tensor([path[-1]], device=self.device)
        for i, step in self.steps.items():
            gdn_tree_commit(self.states[i], self.convs[i], self.slots, step, last, validate=False)
        index = torch.tensor(path, device=self.device)
        for i, (k, v) in self.appended.items():
            self.keys[i] = torch.cat([self.keys[i], k[:, :, index]], dim=2)
            self.values[i] = torch.cat([self.values[i], v[:, :, index]], dim=2)
        self.position += len(path)


def draft_tree(draft_model, context: torch.Tensor, root_token: int, widths=(2, 2, 1)):
    """Tokens and parents of a proposal tree: the root, then per level the draft's top-k children."""
    tokens, parents, frontier = [root_token], [-1], [0]
    paths = {0: [root_token]}
    with torch.no_grad():
        for width in widths:
            nxt = []
            for node in frontier:
                sequence = torch.cat([context, torch.tensor(paths[node], device=context.device)])
                logits = draft_model(sequence[None]).logits[0, -1]
                for token in torch.topk(logits, width).indices.tolist():
                    tokens.append(token)
                    parents.append(node)
                    paths[len(tokens) - 1] = paths[node] + [token]
                    nxt.append(len(tokens) - 1)
            frontier = nxt
    return torch.tensor(tokens, device=context.device), parents


@dataclass
class GenerationReport:
    prompts: int = 0
    tokens: int = 0
    rounds: int = 0
    accepted_drafts: int = 0
    mismatches: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mismatches and self.tokens > 0

    @property
    def mean_accepted(self) -> float:
        return self.accepted_drafts / max(1, self.rounds)


def validate_generation(size: ModelSize = ModelSize(), device="cpu", prompts: int = 3, new_tokens: int = 200,
                        prompt_length: int = 6, seed: int = 0, noise: float = 0.05) -> GenerationReport:
    """Speculative decoding with our tree steps against transformers' greedy ``generate``."""
    target = build_model(size, device, seed)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn_like(p))
    rng = random.Random(seed)
    report = GenerationReport()
    with torch.no_grad():
        for _ in range(prompts):
            prompt = torch.tensor([rng.randrange(size.vocab) for _ in range(prompt_length)], device=device)
            expected = target.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                                       pad_token_id=0)[0, prompt_length:].tolist()
            decoder = TreeDecoder(target, prompt)
            produced, context, root = [], prompt[:-1], int(prompt[-1])
            while len(produced) < new_tokens:
                tokens, parents = draft_tree(draft, context, root)
                logits = decoder.forward(tokens, parents)
                path, node = [0], 0
                while True:
                    choice = int(logits[node].argmax())
                    child = next((c for c, p in enumerate(parents) if p == node and int(tokens[c]) == choice), None)
                    produced.append(choice)
                    if child is None:
                        break
                    path.append(child)
                    node = child
                decoder.commit(path)
                report.rounds += 1
                report.accepted_drafts += len(path) - 1
                context = torch.cat([context, tokens[path]])
                root = produced[-1]
            produced = produced[:new_tokens]
            report.prompts += 1
            report.tokens += len(produced)
            if produced != expected:
                first = next(i for i, (a, b) in enumerate(zip(produced, expected)) if a != b)
                report.mismatches.append(f"prompt {report.prompts}: first difference at token {first}")
    return report
