"""Each piece of the fused block alone, against autograd, in float64: the
outputs of a block of steps, each step's input gradient (later steps
first, as the block runs them) and the weights' gradients once per block,
from the equation written beside its code (loop/operators.py,
attention.py, memory_windows.py, mixing.py, fused_layer.py). A failure names the piece and the gradient. The
whole block against the reference loop: test_fused_loop.py."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fairseq.modules import gelu as fairseq_gelu
from fairseq.modules.fairseq_dropout import FairseqDropout
from helpers import tiny_translation_model
from torch import nn

from fairseq_feedback.loop.fused_block import encoder_reads
from fairseq_feedback.loop.fused_layer import DropoutMasks, FusedLayer, weighted
from fairseq_feedback.loop.attention import Attention, per_row
from fairseq_feedback.loop.memory_windows import MemoryWindows
from fairseq_feedback.loop.mixing import Mixing
from fairseq_feedback.loop.operators import GroupedLinear, Linear, Norm, residual, residual_grad
from fairseq_feedback.modules.memory_view import MemoryView

STEPS, ROWS, EMBED, HEADS, HEAD_DIM = 4, 3, 8, 2, 3
F64 = torch.float64


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def randn(*shape, grad=False):
    return torch.randn(*shape, dtype=F64, requires_grad=grad)


def assert_same(got, expected, what):
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11, msg=lambda message: f"{what}\n{message}")


def autograd_of(outputs, output_grads, inputs, retain_graph=False):
    """The gradients of `inputs` (None: none) from those of `outputs`, by autograd."""
    grads = iter(torch.autograd.grad(outputs, [x for x in inputs if x is not None], output_grads,
                                     retain_graph=retain_graph))
    return [None if x is None else next(grads) for x in inputs]


@torch.no_grad()  # as in the block's Function
def by_step(piece_step, grads):
    """The piece's backward at each step, later steps first; returned by step."""
    backwards = {t: piece_step(grads[t], t) for t in reversed(range(len(grads)))}
    return [backwards[t] for t in range(len(grads))]


def check_against_autograd(name, piece, module, xs, ys, expected, grads, residuals=None, weight_names=("dW", "db")):
    """A piece with a weight and a bias against autograd on `expected`: its outputs, its input gradients step
    by step (plus a residual's gradient where `residuals` give one) and its weight gradients once per block."""
    residuals = residuals or [None] * len(xs)
    for t in range(len(xs)):
        assert_same(ys[t], expected[t].detach(), f"{name}: y at step {t}")
    input_grads = by_step(lambda g, t: piece.backward(g, t) if residuals[t] is None else
                          piece.backward(g, t, residuals[t]), grads)
    *x_grads, weight, bias = autograd_of(expected, grads, [*xs, module.weight, module.bias])
    for t in range(len(xs)):
        assert_same(input_grads[t], x_grads[t] if residuals[t] is None else x_grads[t] + residuals[t],
                    f"{name}: g_x at step {t}")
    with torch.no_grad():
        got_weight, got_bias = piece.weight_grads()
    assert_same(got_weight, weight, f"{name}: {weight_names[0]}")
    assert_same(got_bias, bias, f"{name}: {weight_names[1]}")


# --- a linear layer, a layer norm, a residual with dropout --------------------------------------------------


@pytest.mark.parametrize("residual_grads", [False, True], ids=["alone", "adding a residual's gradient"])
@pytest.mark.parametrize("scale", [1.0, HEAD_DIM**-0.5], ids=["unscaled", "scaled as attention's queries"])
def test_linear(scale, residual_grads):
    """y = s (x W^T + b);  g_x = s g_y W (+ r);  dW = s G^T X,  db = s sum G."""
    module = nn.Linear(EMBED, 5).to(F64)
    piece = Linear(module, STEPS, recording=True, scale=scale)
    xs = [randn(ROWS, EMBED, grad=True) for _ in range(STEPS)]
    with torch.no_grad():  # as in the block's Function
        ys = [piece(x, t) for t, x in enumerate(xs)]
    expected = [scale * module(x) for x in xs]
    grads = [randn(ROWS, 5) for _ in range(STEPS)]
    residuals = [randn(ROWS, EMBED) for _ in range(STEPS)] if residual_grads else None
    check_against_autograd("Linear", piece, module, xs, ys, expected, grads, residuals)


def test_grouped_linear():
    """y_g = x_g W_g^T + b_g, a slice of the weight per group of rows;
    g_x_g = g_y_g W_g;  dW_g = G_g^T X_g,  db_g = sum G_g once per block."""
    groups, features = 3, 5
    module = nn.Linear(EMBED, groups * features).to(F64)
    piece = GroupedLinear(module, STEPS, recording=True, groups=groups)
    xs = [randn(groups * ROWS, EMBED, grad=True) for _ in range(STEPS)]
    with torch.no_grad():
        ys = [piece(x, t) for t, x in enumerate(xs)]
    weights, biases = module.weight.view(groups, features, EMBED), module.bias.view(groups, features)
    expected = [torch.cat([F.linear(rows, weights[g], biases[g]) for g, rows in enumerate(x.view(groups, ROWS, EMBED))])
                for x in xs]
    grads = [randn(groups * ROWS, features) for _ in range(STEPS)]
    check_against_autograd("GroupedLinear", piece, module, xs, ys, expected, grads)


def test_norm():
    """y = gamma xhat + beta;  g_x = (gx - mean(gx) - xhat mean(gx xhat)) / sigma;  dgamma, dbeta once."""
    module = nn.LayerNorm(EMBED).to(F64)
    nn.init.normal_(module.weight)
    nn.init.normal_(module.bias)
    piece = Norm(module, STEPS, recording=True)
    xs = [randn(ROWS, EMBED, grad=True) for _ in range(STEPS)]
    with torch.no_grad():
        ys = [piece(x, t) for t, x in enumerate(xs)]
    expected = [module(x) for x in xs]
    grads = [randn(ROWS, EMBED) for _ in range(STEPS)]
    check_against_autograd("Norm", piece, module, xs, ys, expected, grads, weight_names=("dgamma", "dbeta"))


@pytest.mark.parametrize("dropout", [False, True], ids=["no dropout", "dropout"])
def test_residual_with_dropout(dropout):
    """y = x + d * f;  g_x = g_y,  g_f = d * g_y."""
    x, f = randn(ROWS, EMBED, grad=True), randn(ROWS, EMBED, grad=True)
    mask = torch.empty(ROWS, EMBED, dtype=F64).bernoulli_(0.7).div_(0.7) if dropout else None
    expected = x + (f if mask is None else mask * f)
    assert_same(residual(x.detach(), f.detach(), mask), expected.detach(), "residual: y")
    grad = randn(ROWS, EMBED)
    x_grad, f_grad = autograd_of(expected, grad, [x, f])
    assert_same(grad, x_grad, "residual: g_x")
    assert_same(grad if mask is None else residual_grad(grad, mask), f_grad, "residual: g_f")


# --- attention ------------------------------------------------------------------------------------------


def attention_module():
    """What Attention reads of fairseq's attention modules."""
    return SimpleNamespace(q_proj=nn.Linear(EMBED, HEADS * HEAD_DIM).to(F64),
                           out_proj=nn.Linear(HEADS * HEAD_DIM, EMBED).to(F64), num_heads=HEADS, head_dim=HEAD_DIM)


def attention_by_autograd(module, x, keys, values, bias, groups=1, mask=None):
    """(d * softmax(q K^T + B)) V between the projections, as plain tensor operators:
    x [rows, embed]; keys, values [sequences, heads, slots, head_dim];
    bias broadcasting to [sequences, heads, groups, slots]; the dropout mask d
    as many elements as the scores, or None."""
    sequences = keys.size(0)
    q = module.q_proj(x).view(sequences, groups, HEADS, HEAD_DIM).transpose(1, 2) * HEAD_DIM**-0.5
    scores = q @ keys.transpose(-1, -2)
    if bias is not None:
        scores = scores + bias
    weights = scores.softmax(-1)
    attended = (weights if mask is None else weights * mask.reshape(weights.shape)) @ values
    return module.out_proj(attended.transpose(1, 2).reshape(len(x), HEADS * HEAD_DIM))


MEMORY_CASES = {
    "span shorter than the memory": dict(initial=3, span=4),
    "span longer than the memory": dict(initial=1, span=10),
    "relative positions": dict(initial=3, span=4, positions=True),
    "adaptive span's bias": dict(initial=1, span=10, span_bias=True),
    "relative positions, adaptive span's bias": dict(initial=3, span=4, positions=True, span_bias=True),
    "weights computed again in the backward": dict(initial=3, span=4, keep_probs=False, span_bias=True),
    "dropout of the weights": dict(initial=3, span=4, positions=True, dropout=True),
    "dropout, weights computed again": dict(initial=1, span=10, keep_probs=False, span_bias=True, dropout=True),
}


def dropout_masks(*shape, keep=0.8):
    """Dropout's masks, scaled by 1 / keep."""
    return torch.empty(*shape, dtype=F64).bernoulli_(keep).div_(keep)


@pytest.mark.parametrize("case", MEMORY_CASES.values(), ids=MEMORY_CASES.keys())
def test_attention_over_the_memory(case):
    """Each step reads the last `span` slots before its own (MemoryWindows),
    their keys plus the relative positions p, its weights dropped by d;
    g_K, g_V, g_p and g_B added in place step by step; g_q through q_proj,
    whose dW comes once per block."""
    initial, span = case["initial"], case["span"]
    module = attention_module()
    piece = Attention(module, STEPS, recording=True, keep_probs=case.get("keep_probs", True))
    slots = randn(2, ROWS, HEADS, initial + STEPS, HEAD_DIM, grad=True)  # one key plane and one value plane
    positions = randn(span, HEAD_DIM, grad=True) if case.get("positions") else None
    span_bias = randn(HEADS, 1, span, grad=True) if case.get("span_bias") else None
    bias = per_row(None if span_bias is None else span_bias.detach(), ROWS)
    xs = [randn(ROWS, EMBED, grad=True) for _ in range(STEPS)]
    # the block's masks, [rows * heads, 1, slots read at most], a step's the last slots it reads
    masks = dropout_masks(STEPS, ROWS * HEADS, 1, min(span, initial + STEPS - 1)) if case.get("dropout") else None

    def mask(t):
        return None if masks is None else masks[t][..., -min(span, initial + t):]

    def read(t):
        """Step t's window: keys (with positions), values and bias, as autograd sees them."""
        window = slots[:, :, :, max(0, initial + t - span): initial + t]
        keys, read_slots = window[0], window.size(3)
        keys = keys if positions is None else keys + positions[-read_slots:]
        return keys, window[1], None if span_bias is None else span_bias[..., -read_slots:]

    windows = MemoryWindows(slots.detach(), None, initial, span, HEADS, None if positions is None else positions.detach())
    ys = []
    with torch.no_grad():
        for t, x in enumerate(xs):
            planes = windows.planes(t)
            keys = windows.keys(planes)
            step_bias = None if bias is None else bias[..., -planes[0].size(1):]
            ys.append(piece(piece.q_proj(x, t), t, keys[0], planes[1], step_bias, 1, mask(t)))
    expected = [attention_by_autograd(module, x, *read(t), mask=mask(t)) for t, x in enumerate(xs)]
    for t in range(STEPS):
        assert_same(ys[t], expected[t].detach(), f"Attention: output at step {t}")

    grads = [randn(ROWS, EMBED) for _ in range(STEPS)]
    slot_grads = torch.zeros_like(slots)
    position_grads = None if positions is None else torch.zeros_like(positions)
    bias_grads = None if span_bias is None else torch.zeros_like(span_bias)
    windows = MemoryWindows(slots.detach(), slot_grads, initial, span, HEADS,
                            None if positions is None else positions.detach(), position_grads)

    def step_backward(grad, t):
        planes = windows.planes(t)
        keys = windows.keys(planes)
        plane_grads, key_grads, overwrite = windows.grads(t)
        read_slots = planes[0].size(1)
        queries = piece.backward(grad, t, keys[0], planes[1], None if bias is None else bias[..., -read_slots:],
                                 key_grads[0], plane_grads[1],
                                 None if bias_grads is None else bias_grads[..., -read_slots:], overwrite[0])
        overwrite[0] = False
        windows.finish_key_grads(plane_grads, key_grads, overwrite)
        return piece.q_proj.backward(queries, t)

    input_grads = by_step(step_backward, grads)
    parameters = [module.q_proj.weight, module.q_proj.bias, module.out_proj.weight, module.out_proj.bias]
    *x_grads, slots_grad, positions_grad, span_bias_grad, q_w, q_b, out_w, out_b = autograd_of(
        expected, grads, [*xs, slots, positions, span_bias, *parameters])
    for t in range(STEPS):
        assert_same(input_grads[t], x_grads[t], f"Attention: g_x (through g_q) at step {t}")
    assert_same(slot_grads[0], slots_grad[0], "Attention: g_K, the memory's keys")
    assert_same(slot_grads[1], slots_grad[1], "Attention: g_V, the memory's values")
    if positions is not None:
        assert_same(position_grads, positions_grad, "Attention: g_p, the relative positions")
    if span_bias is not None:
        assert_same(bias_grads, span_bias_grad, "Attention: g_B, the adaptive span's bias")
    with torch.no_grad():
        weight_grads = [*piece.q_proj.weight_grads(), *piece.out_proj.weight_grads()]
    for got, expected_grad, name in zip(weight_grads,
                                        [q_w, q_b, out_w, out_b], ["q_proj dW", "q_proj db", "out_proj dW",
                                                                   "out_proj db"]):
        assert_same(got, expected_grad, f"Attention: {name}")


@pytest.mark.parametrize("groups, dropout", [(1, False), (3, False), (1, True)],
                         ids=["a row per sentence", "beam rows: 3 per sentence", "dropout of the weights"])
def test_attention_over_the_encoder(groups, dropout):
    """Keys and values that every step reads, of `sequences` sentences,
    each read by `groups` consecutive rows (beam hypotheses) behind a
    padding mask, the weights dropped by d: g_K = sum_t g_S,t^T q_t and
    g_V = sum_t (d_t * P_t)^T g_a,t once per block."""
    sequences, src_len = 2, 5
    module = attention_module()
    piece = Attention(module, STEPS, recording=True)
    keys, values = randn(sequences, HEADS, src_len, HEAD_DIM, grad=True), randn(sequences, HEADS, src_len, HEAD_DIM,
                                                                                grad=True)
    padding = torch.zeros(sequences, 1, 1, src_len, dtype=F64)
    padding[0, ..., :2] = float("-inf")
    (read,) = encoder_reads([(keys.detach(), values.detach())], padding, sequences * groups)
    assert read[3] == groups
    xs = [randn(sequences * groups, EMBED, grad=True) for _ in range(STEPS)]
    masks = dropout_masks(STEPS, sequences * groups * HEADS, src_len) if dropout else [None] * STEPS
    with torch.no_grad():
        ys = [piece(piece.q_proj(x, t), t, *read, masks[t]) for t, x in enumerate(xs)]
    expected = [attention_by_autograd(module, x, keys, values, padding, groups, masks[t]) for t, x in enumerate(xs)]
    for t in range(STEPS):
        assert_same(ys[t], expected[t].detach(), f"Attention ({groups} rows per sentence): output at step {t}")
    grads = [randn(sequences * groups, EMBED) for _ in range(STEPS)]
    input_grads = by_step(lambda g, t: piece.q_proj.backward(piece.backward(g, t, *read[:2]), t), grads)
    key_grads, value_grads = torch.empty_like(read[0]), torch.empty_like(read[1])
    with torch.no_grad():
        piece.key_value_grads(key_grads, value_grads)
    *x_grads, keys_grad, values_grad = autograd_of(expected, grads, [*xs, keys, values])
    for t in range(STEPS):
        assert_same(input_grads[t], x_grads[t], f"Attention ({groups} rows per sentence): g_x at step {t}")
    assert_same(key_grads.view_as(keys), keys_grad, f"Attention ({groups} rows per sentence): g_K, once per block")
    assert_same(value_grads.view_as(values), values_grad,
                f"Attention ({groups} rows per sentence): g_V, once per block")


# --- eq. 1 -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 3], ids=["one memory", "a memory per layer (recurrent)"])
def test_eq_1_mixing(count):
    """m_t^j = sum_l w_jl x_t^l, w_j = softmax(theta_j);  g_x_t^l += sum_j w_jl g_m_t^j;
    g_w_jl = sum_t <x_t^l, g_m_t^j>, then softmax's Jacobian by autograd."""
    layers = 3
    states, theta = randn(layers + 1, STEPS, ROWS, EMBED, grad=True), randn(count, layers + 1, grad=True)
    weights = theta.softmax(-1)
    mixing = Mixing(weights.detach(), states.detach())
    memories = torch.empty(STEPS, count * ROWS, EMBED, dtype=F64)  # a memory's rows one after another
    for t in range(STEPS):
        mixing(t, memories[t])
    expected = torch.einsum("jl,ltre->tjre", weights, states).reshape(memories.shape)
    assert_same(memories, expected.detach(), "eq. 1: m_t")
    memory_grads, own_grads = randn(STEPS, count * ROWS, EMBED), randn(layers + 1, STEPS, ROWS, EMBED)
    state_grads = torch.empty_like(own_grads)
    for t in reversed(range(STEPS)):
        mixing.memory_grads.keep(t, memory_grads[t])
        for layer in range(layers + 1):  # the top layer's outputs may get no gradient of their own
            own = None if layer == layers else own_grads[layer, t]
            state_grads[layer, t] = mixing.add_share(own, memory_grads[t], layer)
    own_grads[layers] = 0
    states_grad, weights_grad, theta_grad = autograd_of([expected, states], [memory_grads, own_grads],
                                                        [states, weights, theta], retain_graph=True)
    assert_same(state_grads, states_grad, "eq. 1: g_x_t^l")
    mixing_weights_grad = mixing.weight_grads()
    assert_same(mixing_weights_grad, weights_grad, "eq. 1: g_w")
    (through_softmax,) = autograd_of(weights, mixing_weights_grad, [theta])
    assert_same(through_softmax, theta_grad, "eq. 1: g_theta through softmax's Jacobian")


# --- a layer: its sublayers pre- or post-norm, residuals with dropout ---------------------------------------

LAYERS = {
    "post-norm": [],
    "pre-norm": ["--decoder-normalize-before"],
    "pre-norm, gelu": ["--decoder-normalize-before", "--activation-fn", "gelu"],
    "post-norm, no feed-forward": ["--no-feed-forward"],
}


class ReplayedDropout(FairseqDropout):
    """A layer's dropout, multiplying by given masks (as many elements as
    its input, viewed as it), in the order the layer asks for them."""

    def __init__(self, masks):
        super().__init__(p=0.5)  # a rate that drops: the masks are the dropout
        self.masks = iter(masks)

    def forward(self, x, inplace=False):
        return x * next(self.masks).reshape(x.shape)


@pytest.mark.parametrize("dropout", [False, True], ids=["no dropout", "dropout"])
@pytest.mark.parametrize("first", [False, True], ids=["a layer", "the first layer (queries once per block)"])
@pytest.mark.parametrize("kind", LAYERS)
def test_layer(kind, first, dropout):
    """FusedLayer over a block of steps against MemoryDecoderLayer.forward_memory,
    both reading the same memory (with an adaptive span's bias) and encoder
    output, with the same dropout masks (of the residual branches, the
    feed-forward hidden layer and both attentions' weights): each step's
    output, g_x, the memory's and the encoder's g_K, g_V, g_B, and every
    weight's gradient."""
    model, _ = tiny_translation_model(*LAYERS[kind], layers=1)
    layer = model.decoder.layers[0].to(F64).train()
    for norm in (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm):
        if norm is not None:
            nn.init.normal_(norm.weight)
            nn.init.normal_(norm.bias)
    embed, heads, head_dim = layer.embed_dim, layer.self_attn.num_heads, layer.self_attn.head_dim
    name = f"FusedLayer ({kind}{', first' if first else ''}{', dropout' if dropout else ''})"
    piece = FusedLayer(layer, STEPS, recording=True, first=first)
    sublayers = len(piece.sublayers)
    sequences, src_len, slots = ROWS, 5, 1 + STEPS
    masks = DropoutMasks()
    if dropout:  # a step reads 1 + t slots: its memory attention's mask, the last of them
        masks = DropoutMasks(dropout_masks(STEPS, sublayers, ROWS, embed, keep=0.7),
                             None if layer.fc1 is None else dropout_masks(STEPS, ROWS, layer.fc1.out_features),
                             dropout_masks(STEPS, ROWS * heads, 1, slots, keep=0.9),
                             dropout_masks(STEPS, ROWS * heads, src_len, keep=0.6))
    memory = randn(2, ROWS, heads, slots, head_dim, grad=True)
    span_bias = randn(heads, 1, slots, grad=True)
    encoder = randn(2, sequences, heads, src_len, head_dim, grad=True)
    padding = torch.zeros(sequences, 1, 1, src_len, dtype=F64)
    padding[0, ..., :2] = float("-inf")
    (encoder_read,) = encoder_reads([tuple(encoder.detach())], padding, ROWS)
    bias = per_row(span_bias.detach(), ROWS)
    xs = randn(STEPS, ROWS, embed, grad=True)

    def masks_at(t):
        at_t = DropoutMasks(*(None if m is None else m[t] for m in masks))
        return at_t if at_t.attention is None else at_t._replace(attention=at_t.attention[..., -1 - t:])

    def memory_read(planes, t):
        return planes[0][:, :, : 1 + t].flatten(0, 1), planes[1][:, :, : 1 + t].flatten(0, 1), bias[..., -1 - t:]

    with torch.no_grad():  # as in the block's Function
        if first:
            piece.project_block_queries(xs)
        ys = [piece(x, t, memory_read(memory, t), encoder_read, masks_at(t)) for t, x in enumerate(xs)]

    if layer.activation_fn is fairseq_gelu:  # it computes in float32: in float64, exact as the fused layer's
        layer.activation_fn = F.gelu
    if dropout:  # the reference layer's dropout: the same masks, in the order it asks for them
        layer.dropout_module = ReplayedDropout(masks.residual.flatten(0, 1))
        if masks.activation is not None:
            layer.activation_dropout_module = ReplayedDropout(masks.activation)
        layer.self_attn.dropout_module = ReplayedDropout(masks_at(t).attention for t in range(STEPS))
        layer.encoder_attn.dropout_module = ReplayedDropout(masks.encoder_attention)
    else:
        layer.eval()
    expected = [layer.forward_memory(x, MemoryView(memory[0, :, :, : 1 + t], memory[1, :, :, : 1 + t],
                                                   span_bias[..., -1 - t:]), tuple(encoder), padding)
                for t, x in enumerate(xs)]
    for t in range(STEPS):
        assert_same(ys[t], expected[t].detach(), f"{name}: output at step {t}")

    grads = randn(STEPS, ROWS, embed)
    memory_grads, span_bias_grads = torch.zeros_like(memory), torch.zeros_like(span_bias)
    input_grads, encoder_grads = torch.empty_like(grads), torch.empty_like(encoder)
    with torch.no_grad():
        for t in reversed(range(STEPS)):
            read_grads = (*memory_read(memory_grads, t)[:2], span_bias_grads[..., -1 - t:], False)
            input_grads[t] = piece.backward(grads[t], t, memory_read(memory, t), read_grads, encoder_read[:2],
                                            masks_at(t))
        if first:
            piece.block_queries_backward(input_grads)
        piece.encoder_attn.key_value_grads(*(g.view(-1, src_len, head_dim) for g in encoder_grads.unbind()))
        got = [g for weighted_piece in weighted(piece) for g in weighted_piece.weight_grads()]
    modules = weighted(layer)
    names = {module: module_name for module_name, module in layer.named_modules()}
    parameters = [p for module in modules for p in (module.weight, module.bias)]
    xs_grad, memory_grad, span_bias_grad, encoder_grad, *parameter_grads = autograd_of(
        expected, list(grads), [xs, memory, span_bias, encoder, *parameters])
    for t in range(STEPS):
        assert_same(input_grads[t], xs_grad[t], f"{name}: g_x at step {t}")
    assert_same(memory_grads[0], memory_grad[0], f"{name}: the memory's g_K")
    assert_same(memory_grads[1], memory_grad[1], f"{name}: the memory's g_V")
    assert_same(span_bias_grads, span_bias_grad, f"{name}: the adaptive span's g_B")
    assert_same(encoder_grads[0], encoder_grad[0], f"{name}: the encoder's g_K")
    assert_same(encoder_grads[1], encoder_grad[1], f"{name}: the encoder's g_V")
    for i, module in enumerate(modules):
        for j, kind in enumerate(("weight", "bias")):
            assert_same(got[2 * i + j], parameter_grads[2 * i + j], f"{name}: gradient of {names[module]}.{kind}")
