"""Layers from the parameter tree: paths, stacks of identical members, operators per layer."""

import jax
import jax.numpy as jnp
import pytest

from hlo_tools.graph import Phase
from hlo_tools.hlo_text import Shape
from hlo_tools.layers import layer_report, parameter_layers, path_components
from hlo_tools.lower import argument_paths, lower_to_graph

F32 = jnp.float32


@pytest.mark.parametrize("text,components", [
    ("args[0][0]['blocks'][3]['attn']['kernel'].value",
     ("args", 0, 0, "blocks", 3, "attn", "kernel", "value")),
    ("args[0][0][\\'layers\\'][1][\\'w\\'].value", ("args", 0, 0, "layers", 1, "w", "value")),
    ("[0].params['layers_2']['Dense_0']['kernel']", (0, "params", "layers_2", "Dense_0",
                                                     "kernel")),
    ("a[0].opt_state[0].mu['Block_1']['bias']", ("a", 0, "opt_state", 0, "mu", "Block_1",
                                                 "bias")),
    ("encoder/layer/3/attention/query/kernel", ("encoder", "layer", "3", "attention", "query",
                                                "kernel")),
])
def test_path_components_read_keystr_op_names_and_slash_paths(text, components):
    assert path_components(text) == components


def _layers(leaves, trainable=None, forward_read=None):
    """``parameter_layers`` of ``{path: dims}`` leaves (f32), all weights unless told."""
    paths = [path_components(p) for p in leaves]
    shapes = [Shape("f32", tuple(d)) for d in leaves.values()]
    trainable = [True] * len(paths) if trainable is None else trainable
    forward_read = list(trainable) if forward_read is None else forward_read
    return dict(zip(leaves, parameter_layers(paths, shapes, trainable, forward_read)))


@pytest.mark.parametrize("member", ["['blocks'][{i}]", "['layers_{i}']", "['Block_{i}']",
                                    "['h_{i}']", "/encoder/layer/{i}"])
def test_each_way_of_numbering_blocks_is_a_stack(member):
    leaves = {"args[0]['embed']": (64, 8)}
    for i in range(3):
        leaves[f"args[0]{member.format(i=i)}['w']"] = (8, 8)
        leaves[f"args[0]{member.format(i=i)}['norm']"] = (8,)
    found = _layers(leaves)
    assert found.pop("args[0]['embed']") == -1
    assert sorted(found.values()) == [0, 0, 1, 1, 2, 2]
    assert all(str(layer) in path for path, layer in found.items())


def test_members_of_different_shapes_are_no_layers():
    found = _layers({"['conv_0']['kernel']": (3, 3, 1, 8), "['conv_1']['kernel']": (3, 3, 8, 16),
                     "['head']['kernel']": (16, 10)})
    assert set(found.values()) == {-1}


def test_the_run_of_identical_members_is_the_stack_and_nested_repeats_lose():
    # input and output projections of other shapes around three hidden layers; each hidden
    # layer holds two same-shaped dense layers (a nested family with fewer bytes)
    leaves = {"['linears'][0]['kernel']": (4, 8)}
    for i in (1, 2, 3):
        leaves[f"['linears'][{i}]['dense_0']['kernel']"] = (8, 8)
        leaves[f"['linears'][{i}]['dense_1']['kernel']"] = (8, 8)
    leaves["['linears'][4]['kernel']"] = (8, 2)
    found = _layers(leaves)
    assert found["['linears'][0]['kernel']"] == found["['linears'][4]['kernel']"] == -1
    assert [found[f"['linears'][{i}]['dense_1']['kernel']"] for i in (1, 2, 3)] == [0, 1, 2]


def test_optimizer_state_mirrors_the_stack_and_batches_are_not_weights():
    leaves = {}
    for root in ("[0]['params']", "[0]['opt']['mu']", "[0]['opt']['nu']"):
        for i in range(2):
            leaves[f"{root}['blocks'][{i}]['w']"] = (8, 8)
    leaves["[1][0]"] = (32, 8)          # two same-shaped batch inputs: read, not updated
    leaves["[1][1]"] = (32, 8)
    weights = [path.startswith("[0]['params']") for path in leaves]
    read = [not path.startswith("[0]['opt']") for path in leaves]
    found = _layers(leaves, trainable=weights, forward_read=read)
    for root in ("params", "opt']['mu", "opt']['nu"):
        assert [found[f"[0]['{root}']['blocks'][{i}]['w']"] for i in range(2)] == [0, 1]
    assert found["[1][0]"] == found["[1][1]"] == -1


def _step(scoped: bool, layers: int = 3, returns_loss: bool = False):
    """A residual MLP trained by SGD with momentum, plain jax: params and momentum in dicts.
    Without its loss among the outputs, the head's forward values only serve the backward
    pass."""

    def model(params, x):
        h = x @ params["embed"]
        for i, block in enumerate(params["blocks"]):
            with jax.named_scope(f"layer_{i}") if scoped else _nothing():
                u = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
                h = h + jax.nn.relu((u * block["scale"]) @ block["up"]) @ block["down"]
        return h @ params["head"]

    def step(params, momentum, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model(p, x) - y) ** 2))(params)
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
        new = jax.tree.map(lambda p, m: p - 0.01 * m, params, momentum), momentum
        return (*new, loss) if returns_loss else new

    shapes = {"embed": (4, 16), "head": (16, 2),
              "blocks": [{"scale": (16,), "up": (16, 32), "down": (32, 16)}] * layers}
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, F32), shapes,
                          is_leaf=lambda s: isinstance(s, tuple))
    return lower_to_graph(step, params, params, jax.ShapeDtypeStruct((8, 4), F32),
                          jax.ShapeDtypeStruct((8, 2), F32))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="module", params=[False, True], ids=["loss-dropped", "loss-returned"])
def plain(request):
    return _step(scoped=False, returns_loss=request.param)


def test_argument_paths_name_every_leaf_in_parameter_order():
    paths = argument_paths({"b": [jnp.zeros(2), jnp.zeros(3)]}, jnp.zeros(1))
    assert paths == [("args", 0, "b", 0), ("args", 0, "b", 1), ("args", 1)]


def test_every_phase_of_a_block_lands_in_its_layer(plain):
    report = layer_report(plain)
    assert report.layers == 3 and report.uniform
    for node in plain.nodes:
        if node.opcode == "dot" and node.phase == Phase.FORWARD:
            weight = plain.nodes[node.operands[1]]
            path = path_components(weight.op_name)
            want = path[path.index("blocks") + 1] if "blocks" in path else -1
            assert node.layer == want, (node.name, path)
    for layer in range(3):
        phases = report.nodes[layer]
        assert phases["forward"] and phases["backward"] and phases["optimizer"]
        assert phases["param"] == 6                       # 3 weights and their momenta
    outside = {n.opcode for n in plain.nodes if n.layer < 0 and n.phase == Phase.FORWARD}
    assert "dot" in outside                               # embedding and head
    assert report.fraction_in_layers > 0.7


def test_the_found_layers_are_the_name_scopes_where_both_exist(plain):
    scoped = _step(scoped=True, returns_loss=any(n.is_output and n.phase == Phase.FORWARD
                                                 for n in plain.nodes))
    assert [n.opcode for n in scoped.nodes] == [n.opcode for n in plain.nodes]
    for a, b in zip(plain.nodes, scoped.nodes):
        if a.phase in (Phase.FORWARD, Phase.BACKWARD) and "layer_" in b.op_name:
            assert a.layer == b.layer, (a.name, b.op_name)
    # scopes win: the scoped graph keeps its scope layers, the optimizer outside them
    assert {n.layer for n in scoped.nodes if n.phase == Phase.OPTIMIZER} == {-1}
    assert {n.layer for n in plain.nodes if n.phase == Phase.OPTIMIZER} >= {0, 1, 2}


def test_a_single_block_or_no_numbered_tree_gives_no_layers():
    single = _step(scoped=False, layers=1)
    assert {n.layer for n in single.nodes} == {-1}
    graph = lower_to_graph(lambda w, x: jax.grad(lambda w: jnp.sum(x @ w))(w),
                           jax.ShapeDtypeStruct((4, 4), F32), jax.ShapeDtypeStruct((2, 4), F32))
    assert {n.layer for n in graph.nodes} == {-1}


def test_an_encoders_and_a_decoders_blocks_are_two_stacks():
    leaves = {"['embed']": (64, 8)}
    for stack, extra in (("encoder", {}), ("decoder", {"cross": (8, 8)})):
        for i in range(2):
            for name, dims in {"w": (8, 8), "norm": (8,), **extra}.items():
                leaves[f"['{stack}']['layers'][{i}]['{name}']"] = dims
                # optimizer state of each stack, under the same container name ('layers')
                leaves[f"['mu']['{stack}']['layers'][{i}]['{name}']"] = dims
    weights = [not path.startswith("['mu']") for path in leaves]
    found = _layers(leaves, trainable=weights, forward_read=weights)
    for stack in ("encoder", "decoder"):
        layers = [found[f"['{stack}']['layers'][{i}]['w']"] for i in range(2)]
        assert layers[1] == layers[0] + 1
        assert [found[f"['mu']['{stack}']['layers'][{i}]['w']"] for i in range(2)] == layers
    assert sorted({v for v in found.values()}) == [-1, 0, 1, 2, 3]


def test_a_resnets_stages_are_one_stack_and_the_convs_inside_a_block_none():
    # two identical first-stage blocks; the second stage's first block adds a projection and
    # its convs are wider (one shape: a same-shaped pair with more bytes than a whole
    # first-stage block), its second block has the first stage's paths in its own width
    leaves = {f"['ResNetBlock_{i}']['Conv_{j}']['kernel']": (3, 3, 8, 8)
              for i in range(2) for j in range(2)}
    leaves.update({f"['ResNetBlock_{i}']['Conv_{j}']['kernel']": (3, 3, 32, 32)
                   for i in (2, 3) for j in range(2)})
    leaves["['ResNetBlock_2']['proj']['kernel']"] = (1, 1, 8, 32)
    leaves["['head']['kernel']"] = (32, 10)
    found = _layers(leaves)
    for i in range(4):
        assert found[f"['ResNetBlock_{i}']['Conv_0']['kernel']"] == i
        assert found[f"['ResNetBlock_{i}']['Conv_1']['kernel']"] == i
    assert found["['ResNetBlock_2']['proj']['kernel']"] == 2
    assert found["['head']['kernel']"] == -1


def _encoder_decoder():
    """Two stacks of different blocks, plain jax: every decoder block reads the encoder's
    (normed) output."""

    def norm(h):
        return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)

    def model(params, x, y):
        h = x @ params["embed"]
        for block in params["encoder"]:
            h = h + jax.nn.relu((norm(h) * block["scale"]) @ block["up"]) @ block["down"]
        memory = norm(h)
        g = y @ params["embed"]
        for block in params["decoder"]:
            g = g + jax.nn.relu((norm(g) * block["scale"]) @ block["up"]) @ block["down"]
            g = g + jnp.tanh(memory @ block["cross"]) * g
        return norm(g) @ params["head"]

    def step(params, momentum, x, y, target):
        grads = jax.grad(lambda p: jnp.mean((model(p, x, y) - target) ** 2))(params)
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
        return jax.tree.map(lambda p, m: p - 0.01 * m, params, momentum), momentum

    block = {"scale": (16,), "up": (16, 32), "down": (32, 16)}
    shapes = {"embed": (4, 16), "head": (16, 2), "encoder": [block] * 2,
              "decoder": [{**block, "cross": (16, 16)}] * 3}
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, F32), shapes,
                          is_leaf=lambda s: isinstance(s, tuple))
    data = [jax.ShapeDtypeStruct(s, F32) for s in ((8, 4), (8, 4), (8, 2))]
    return lower_to_graph(step, params, params, *data)


def test_an_encoder_decoder_has_the_layers_of_both_stacks_in_forward_order():
    graph = _encoder_decoder()
    report = layer_report(graph)
    # the printed module need not run the encoder first; the layers do
    assert report.layers == 5
    # the last decoder layer's backward pass lacks one add: the encoder output's gradient sums
    # the three decoder layers' terms in two adds
    assert [report.structure[k] for k in range(4)] == [0, 0, 1, 1]
    assert report.nodes[4]["forward"] == report.nodes[3]["forward"]
    for node in graph.nodes:
        if node.phase == Phase.PARAM and node.layer >= 0:
            path = path_components(node.op_name)
            stack = "encoder" if "encoder" in path else "decoder"
            index = path[path.index(stack) + 1]
            assert node.layer == index + (0 if stack == "encoder" else 2), path
    # the encoder's final norm (its rsqrt) and the decoder's embedding stay outside layers
    rsqrts = [n.layer for n in graph.nodes
              if n.opcode == "rsqrt" and n.phase == Phase.FORWARD]
    assert sorted(rsqrts) == [-1, -1, 0, 1, 2, 3, 4]
    embeds = {n.layer for n in graph.nodes if n.opcode == "dot" and n.phase == Phase.FORWARD
              and "embed" in path_components(graph.nodes[n.operands[1]].op_name)}
    assert embeds == {-1}


def test_blocks_held_in_a_list_that_do_not_run_one_after_another_are_no_layers():
    # experts in a list: each reads the block's input, none reads another's output
    def step(params, x):
        def loss(p):
            return jnp.sum(sum(jax.nn.relu(x @ e["w"]) for e in p["experts"]) ** 2)
        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = {"experts": [{"w": jax.ShapeDtypeStruct((8, 8), F32)}] * 3}
    graph = lower_to_graph(step, params, jax.ShapeDtypeStruct((4, 8), F32))
    assert {n.layer for n in graph.nodes} == {-1}


def test_an_mlps_projections_of_other_widths_stay_out_of_its_stack_of_hidden_layers():
    # Linen's dense_0 ... dense_3 (kernel and bias each): only the two identical hidden
    # layers are a stack; and NNX's Linear layers hold their arrays in a variable's value
    for member, leaf in (("['dense_{i}']", "['{name}']"),
                         ("['linears'][{i}]", "['{name}'].value")):
        widths = [(4, 16), (16, 16), (16, 16), (16, 2)]
        leaves = {}
        for i, (a, b) in enumerate(widths):
            leaves[member.format(i=i) + leaf.format(name="kernel")] = (a, b)
            leaves[member.format(i=i) + leaf.format(name="bias")] = (b,)
        found = _layers(leaves)
        assert [found[member.format(i=i) + leaf.format(name="kernel")]
                for i in range(4)] == [-1, 0, 1, -1]
