"""The feedback decoder computes the paper's equations, the same way in
training, in step-by-step decoding and in beam search."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DEPTHS, batch, tiny_translation_model
from fairseq.sequence_generator import SequenceGenerator, SequenceGeneratorWithAlignment

VARIANTS = {
    "shared kv, post-norm": [],
    "per-layer kv": ["--per-layer-kv"],
    "pre-norm": ["--decoder-normalize-before"],
    "per-layer kv, pre-norm": ["--per-layer-kv", "--decoder-normalize-before"],
    "relative positions": ["--relative-positions"],
    "adaptive span": ["--adaptive-span", "--adaptive-span-ramp", "2", "--relative-positions"],
    "persistent vectors, all-attention": ["--persistent-vectors", "3", "--no-feed-forward"],
    "top-layer memory": ["--memory-composition", "top"],
    "layer-1 memory, per-layer kv": ["--memory-composition", "layer:1", "--per-layer-kv"],
    "average memory": ["--memory-composition", "average", "--decoder-normalize-before"],
    "recurrent memory": ["--memory-composition", "recurrent"],
    "recurrent memory, per-layer kv, pre-norm": ["--memory-composition", "recurrent", "--per-layer-kv",
                                                 "--decoder-normalize-before"],
}


def train_spans(model, seed=0):
    """Adaptive spans that differ per head and reach less than --memory-span."""
    g = torch.Generator().manual_seed(seed)
    for layer in model.decoder.layers:
        if layer.self_attn.span_mask is not None:
            mask = layer.self_attn.span_mask
            mask.span_fraction.data = torch.rand(mask.span_fraction.shape, generator=g) * 0.5 / mask.max_span * 8
SPANS = {"span shorter than target": 3, "span longer than target": 16}
BASELINE = {"transformer baseline": ["--no-feedback", "--relative-positions"]}


def teacher_forced(model, src, src_lengths, prev):
    logits, _ = model(src, src_lengths, prev)
    return model.get_normalized_probs((logits, None), log_probs=True)


def incremental(model, encoder_out, prev, state=None):
    state = {} if state is None else state
    steps = []
    for t in range(prev.size(1)):
        logits, _ = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
        steps.append(model.get_normalized_probs((logits, None), log_probs=True))
    return torch.cat(steps, dim=1), state


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("span", SPANS.values(), ids=SPANS.keys())
@pytest.mark.parametrize("flags", [*VARIANTS.values(), *BASELINE.values()], ids=[*VARIANTS, *BASELINE])
def test_incremental_decoding_equals_teacher_forcing(flags, span, depth):
    model, d = tiny_translation_model("--memory-span", str(span), *flags, layers=depth)
    train_spans(model)
    model.eval()
    src, src_lengths, prev = batch(d)
    expected = teacher_forced(model, src, src_lengths, prev)
    got, _ = incremental(model, model.encoder(src, src_lengths), prev)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("flags", [*VARIANTS.values(), *BASELINE.values()], ids=[*VARIANTS, *BASELINE])
def test_reorder_follows_hypotheses_when_the_batch_shrinks(flags, depth):
    """Reordering mid-sentence, while dropping rows as beam search does when a
    sentence finishes, continues each kept row's own history."""
    model, d = tiny_translation_model("--memory-span", "4", *flags, layers=depth)
    train_spans(model)
    model.eval()
    src, src_lengths, prev = batch(d, rows=4)
    encoder_out = model.encoder(src, src_lengths)
    _, state = incremental(model, encoder_out, prev[:, :3])
    new_order = torch.tensor([2, 0, 2])  # drop row 1 and 3, duplicate row 2
    model.decoder.reorder_incremental_state_scripting(state, new_order)
    encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
    prev = prev[new_order]
    steps = []
    for t in range(3, prev.size(1)):
        logits, _ = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
        steps.append(model.get_normalized_probs((logits, None), log_probs=True))
    expected = teacher_forced(model, src[new_order], src_lengths[new_order], prev)[:, 3:]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("flags", [[], ["--per-layer-kv", "--decoder-normalize-before"]], ids=["shared", "per-layer"])
def test_beam_search_scores_equal_teacher_forced_scores(flags):
    model, d = tiny_translation_model("--memory-span", "5", *flags)
    model.eval()
    # a strong bias towards EOS after a few tokens makes sentences finish at
    # different steps, so the beam's batch shrinks while decoding
    model.decoder.output_projection.weight.data[d.eos()] *= 4
    src, src_lengths, _ = batch(d, rows=4)
    generator = SequenceGenerator([model], d, beam_size=5, max_len_b=12)
    hypos = generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": src_lengths}})
    lengths = {len(h[0]["tokens"]) for h in hypos}
    assert len(lengths) > 1, "all sentences ended together; the shrinking batch went untested"
    assert_scored_as_teacher_forced(model, d, src, src_lengths, hypos)


def assert_scored_as_teacher_forced(model, d, src, src_lengths, hypos):
    """Every hypothesis's positional scores are those of its tokens fed to the model teacher-forced."""
    for i, nbest in enumerate(hypos):
        for hypo in nbest:
            tokens = hypo["tokens"]
            prev = torch.cat([tokens.new_tensor([d.eos()]), tokens[:-1]]).unsqueeze(0)
            lprobs = teacher_forced(model, src[i : i + 1], src_lengths[i : i + 1], prev)[0]
            scores = lprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(hypo["positional_scores"], scores, atol=1e-4, rtol=0)


def reference_log_probs(model, src, src_lengths, prev, alignment=(None, None)):
    """Section 3.3 written plainly, with torch.cat, reusing only the model's
    parameters: m_t = sum_l c_l x_t^l, with c = softmax(w) (eq. 1), or the
    average, or one layer; layer l at step t attends to [m_{t-span}, ...,
    m_{t-1}] (m_{-1} = 0) through k = W_k m, v = W_v m, plus its persistent
    vectors; an adaptive span scales the attention weights by its soft mask.
    The recurrent memory (Figure 5): layer l (counted from 0, its output
    x^{l+1}) attends to a memory of its own, m^l_t = sum_{j <= l+1}
    softmax(w^l)_j x_t^j, its keys and values from its own projection
    (per-layer kv) or the shared one.
    Also the encoder attention's weights of the layer `alignment` names
    (layer, heads), averaged over its first heads: [rows, steps, src_len]."""
    dec = model.decoder
    encoder_out = model.encoder(src, src_lengths)
    enc, enc_pad = encoder_out["encoder_out"][0], encoder_out["encoder_padding_mask"][0]
    rows, steps = prev.shape
    x0 = dec.embed(prev, dec.embed_positions(prev))
    mem = dec.memory
    heads, head_dim, pre_norm = mem.num_heads, mem.head_dim, dec.cfg.decoder.normalize_before
    L = len(dec.layers)
    composition = dec.cfg.memory_composition
    recurrent = composition == "recurrent"
    if composition == "weighted":
        c = torch.softmax(mem.layer_weights, dim=0)[None]
    elif composition == "average":
        c = torch.full((1, L + 1), 1 / (L + 1))
    elif recurrent:  # a row per layer's memory
        c = torch.stack([F.pad(torch.softmax(mem.layer_weights[l, : l + 2], 0), (0, L - l - 1)) for l in range(L)])
    else:
        c = torch.zeros(1, L + 1)
        c[0, L if composition == "top" else int(composition.split(":")[1])] = 1

    def attention(q, k, v, bias, persistent=None, mask=None):  # q [B, H, dh]; k, v [B, H, N, dh]
        scores = torch.einsum("bhd,bhnd->bhn", q, k) / math.sqrt(head_dim) + bias
        weights = torch.softmax(scores, -1)
        if mask is not None:  # Sukhbaatar et al. 2019: scale by the soft mask, renormalise
            weights = weights * mask
            weights = weights / weights.sum(-1, keepdim=True)
        if persistent is not None:  # all-attention: one softmax over memory and persistent scores
            pk, pv = persistent
            scores_p = torch.einsum("bhd,hnd->bhn", q, pk) / math.sqrt(head_dim)
            joint = torch.softmax(torch.cat([scores_p, scores + (mask.log() if mask is not None else 0)], -1), -1)
            n = pk.size(1)
            return (torch.einsum("bhn,hnd->bhd", joint[..., :n], pv)
                    + torch.einsum("bhn,bhnd->bhd", joint[..., n:], v)).reshape(rows, -1)
        return torch.einsum("bhn,bhnd->bhd", weights, v).reshape(rows, -1)

    def sublayer(h, norm, f):
        out = h + f(norm(h) if pre_norm else h)
        return out if pre_norm else norm(out)

    def keys_values(window, l):  # what layer l reads of the memories in `window` [N, memories, B, D]: [B, H, N, dh]
        memory = window[:, l if recurrent else 0]
        weight, bias, pair = mem.kv_proj.weight, mem.kv_proj.bias, 2 * heads * head_dim
        if recurrent and not mem.shared_kv:  # layer l's projection of layer l's memory
            weight, bias = weight[pair * l: pair * (l + 1)], bias[pair * l: pair * (l + 1)]
        kv = F.linear(mem.layer_norm(memory) if pre_norm else memory, weight, bias)
        kv = kv.view(len(window), rows, -1, heads, head_dim).permute(2, 1, 3, 0, 4)  # [planes, B, H, N, dh]
        plane = 0 if mem.shared_kv or recurrent else 2 * l
        return kv[plane], kv[plane + 1]

    span = dec.current_span()
    memories = torch.zeros(1, len(c), rows, dec.embed_dim)  # m_{-1}
    outputs, aligned = [], []
    aligned_layer, aligned_heads = alignment
    aligned_layer = L - 1 if aligned_layer is None else aligned_layer
    for t in range(steps):
        window = memories[-span:]
        position_bias = 0.0
        h, states = x0[t], [x0[t]]
        for l, layer in enumerate(dec.layers):
            keys, values = keys_values(window, l)
            attn = layer.self_attn
            if dec.key_positions is not None:
                q = attn.q_proj(layer.self_attn_layer_norm(h) if pre_norm else h).view(rows, heads, head_dim)
                position_bias = q @ dec.key_positions[-len(window):].t() / math.sqrt(head_dim)
            mask = None
            if attn.span_mask is not None:
                distance = torch.arange(len(window) - 1, -1, -1.0)
                z = attn.span_mask.span_fraction[:, None] * attn.span_mask.max_span
                mask = ((z - distance) / attn.span_mask.ramp + 1).clamp(0, 1)[None]
            persistent = None
            if attn.persistent_keys is not None:
                n = attn.persistent_keys.size(1)
                persistent = (attn.persistent_keys * math.sqrt(head_dim), attn.persistent_values * math.sqrt(n))
            h = sublayer(h, layer.self_attn_layer_norm, lambda x: attn.out_proj(
                attention(attn.q_proj(x).view(rows, heads, head_dim), keys, values, position_bias, persistent,
                          mask)))
            ea = layer.encoder_attn
            ek = ea.k_proj(enc).view(-1, rows, ea.num_heads, ea.head_dim).permute(1, 2, 0, 3)
            ev = ea.v_proj(enc).view(-1, rows, ea.num_heads, ea.head_dim).permute(1, 2, 0, 3)
            pad_bias = enc_pad[:, None, :].float() * -1e9
            if l == aligned_layer:
                q = ea.q_proj(layer.encoder_attn_layer_norm(h) if pre_norm else h).view(rows, ea.num_heads, -1)
                weights = torch.softmax(torch.einsum("bhd,bhnd->bhn", q, ek) / math.sqrt(ea.head_dim) + pad_bias, -1)
                aligned.append(weights[:, :aligned_heads].mean(1))
            h = sublayer(h, layer.encoder_attn_layer_norm, lambda x: ea.out_proj(
                attention(ea.q_proj(x).view(rows, ea.num_heads, ea.head_dim), ek, ev, pad_bias)))
            if layer.fc1 is not None:
                h = sublayer(h, layer.final_layer_norm, lambda x: layer.fc2(F.relu(layer.fc1(x))))
            states.append(h)
        outputs.append(h)
        m_t = torch.einsum("jl,lbd->jbd", c, torch.stack(states))  # eq. 1 for each memory
        memories = torch.cat([memories, m_t.unsqueeze(0)])
    x = torch.stack(outputs)
    if dec.layer_norm is not None:
        x = dec.layer_norm(x)
    return F.log_softmax(dec.output_layer(x.transpose(0, 1)), dim=-1), torch.stack(aligned, 1)


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("span", SPANS.values(), ids=SPANS.keys())
@pytest.mark.parametrize("flags", VARIANTS.values(), ids=VARIANTS.keys())
def test_gradients_equal_a_plain_reference(flags, span, depth):
    model, d = tiny_translation_model("--memory-span", str(span), "--dropout", "0", *flags, layers=depth)
    train_spans(model)
    model.train()  # the training path, with dropout 0 so that it is deterministic
    src, src_lengths, prev = batch(d)
    # train the layer weights away from uniform so every term of eq. 1 matters
    if model.decoder.memory.layer_weights is not None:
        torch.nn.init.normal_(model.decoder.memory.layer_weights)
    target = torch.randint(d.nspecial, len(d), prev.shape)

    def gradients(log_probs):
        model.zero_grad()
        F.nll_loss(log_probs.view(-1, log_probs.size(-1)), target.view(-1)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got_lp = teacher_forced(model, src, src_lengths, prev)
    got = gradients(got_lp)
    expected_lp, _ = reference_log_probs(model, src, src_lengths, prev)
    expected = gradients(expected_lp)
    torch.testing.assert_close(got_lp, expected_lp, atol=1e-5, rtol=0)
    assert got.keys() == expected.keys()
    assert "decoder.memory.kv_proj.weight" in got
    assert ("decoder.memory.layer_weights" in got) == (model.decoder.cfg.memory_composition in ("weighted",
                                                                                               "recurrent"))
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)


ALIGNED = {"the top layer, all heads": (None, None), "layer 0, its first head": (0, 1)}


@pytest.mark.parametrize("depth", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("flags", [[], *(VARIANTS[v] for v in ("per-layer kv, pre-norm", "adaptive span",
                                                               "persistent vectors, all-attention"))],
                         ids=["shared kv, post-norm", "per-layer kv, pre-norm", "adaptive span", "persistent vectors"])
def test_decoding_returns_the_alignment_layers_encoder_attention_averaged_over_heads(flags, depth):
    """What fairseq-generate --print-alignment prints, as fairseq's transformer returns it: at each step the
    encoder attention of the alignment layer (the top unless named), averaged over heads (all unless named),
    equal to a plain reference's, whether the step runs eagerly or as a captured graph (emulated: captured at
    the second step, replayed after)."""
    model, d = tiny_translation_model("--memory-span", "4", *flags, layers=depth)
    train_spans(model)
    model.eval()
    src, src_lengths, prev = batch(d)
    encoder_out = model.encoder(src, src_lengths)
    for name, alignment in ALIGNED.items():
        _, expected = reference_log_probs(model, src, src_lengths, prev, alignment)
        for graphs in ("off", "emulate"):
            model.decoder.use_cuda_graphs(graphs)
            state, steps = {}, []
            with torch.no_grad():  # as in a search
                for t in range(prev.size(1)):
                    _, extra = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state,
                                             alignment_layer=alignment[0], alignment_heads=alignment[1])
                    steps.append(extra["attn"][0])
            torch.testing.assert_close(torch.cat(steps, 1), expected, atol=1e-5, rtol=0, msg=f"{name}, {graphs}")
            assert graphs == "off" or model.graph_statistics().captured > 0


def aligned_beam_search(model, d, src, src_lengths, shrinking=True):
    generator = SequenceGeneratorWithAlignment([model], d, beam_size=3, max_len_b=12)
    hypos = generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": src_lengths}})
    assert not shrinking or len({len(h[0]["tokens"]) for h in hypos}) > 1, "the shrinking beam went untested"
    for nbest in hypos:
        for hypo in nbest:  # weights over the source, a pair for each target token but EOS
            torch.testing.assert_close(hypo["attention"].sum(0), torch.ones(hypo["attention"].size(1)))
            assert {t for _, t in hypo["alignment"]} == set(range(len(hypo["tokens"]) - 1))
    return hypos


@pytest.mark.parametrize("flags", [[], ["--per-layer-kv", "--decoder-normalize-before"]], ids=["shared", "per-layer"])
def test_beam_search_alignments_are_the_same_eagerly_and_through_the_graphs(flags):
    """fairseq's SequenceGeneratorWithAlignment (--print-alignment) over a beam whose sentences finish at
    different steps: every hypothesis gets its alignment, and the graphs give eager's."""
    model, d = tiny_translation_model("--memory-span", "5", *flags)
    model.eval()
    model.decoder.output_projection.weight.data[d.eos()] *= 4
    src, src_lengths, _ = batch(d, rows=4)
    model.decoder.use_cuda_graphs("off")
    eager = aligned_beam_search(model, d, src, src_lengths)
    model.decoder.use_cuda_graphs("emulate")
    graphed = aligned_beam_search(model, d, src, src_lengths)
    assert model.graph_statistics().captured > 0
    for a, b in zip((h for nbest in eager for h in nbest), (h for nbest in graphed for h in nbest)):
        assert torch.equal(a["tokens"], b["tokens"]) and a["alignment"] == b["alignment"]
        torch.testing.assert_close(a["attention"], b["attention"], atol=1e-5, rtol=0)


def test_the_transformer_baselines_beam_search_shares_encoder_keys_and_aligns():
    """--no-feedback's beam search, whose hypotheses share their sentence's encoder keys and values (a beam
    over 1 once failed there), gives its teacher-forced scores and its alignments (its sentences end together:
    test_reorder_follows_hypotheses_when_the_batch_shrinks reorders its shrinking batch)."""
    model, d = tiny_translation_model("--memory-span", "5", "--no-feedback")
    model.eval()
    src, src_lengths, _ = batch(d, rows=4)
    assert_scored_as_teacher_forced(model, d, src, src_lengths,
                                    aligned_beam_search(model, d, src, src_lengths, shrinking=False))


def test_layerdrop_trains_and_decodes():
    model, d = tiny_translation_model("--decoder-layerdrop", "0.5")
    src, src_lengths, prev = batch(d)
    model.train()
    teacher_forced(model, src, src_lengths, prev).sum().backward()
    model.eval()
    expected = teacher_forced(model, src, src_lengths, prev)
    got, _ = incremental(model, model.encoder(src, src_lengths), prev)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_beam_hypotheses_share_encoder_keys_but_unrelated_rows_do_not():
    """Beam search stores encoder keys/values once per sentence; a beam size
    left over from an earlier search must not merge rows of other sentences."""
    model, d = tiny_translation_model()
    model.eval()
    model.set_beam_size(2)
    src, src_lengths, prev = batch(d, rows=4)
    expected = teacher_forced(model, src, src_lengths, prev)
    got, state = incremental(model, model.encoder(src, src_lengths), prev)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert encoder_keys_values(state).size(2) == 4

    pairs = torch.arange(2).repeat_interleave(2)  # two hypotheses of each of 2 sentences
    got, state = incremental(model, model.encoder(src[pairs], src_lengths[pairs]), prev[pairs])
    torch.testing.assert_close(got, teacher_forced(model, src[pairs], src_lengths[pairs], prev[pairs]), atol=1e-5, rtol=0)
    assert encoder_keys_values(state).size(2) == 2


def encoder_keys_values(incremental_state):
    (kv,) = [entries["encoder_keys_values"] for entries in incremental_state.values() if "encoder_keys_values" in entries]
    return kv


@pytest.mark.parametrize("flags", [[], ["--adaptive-span", "--relative-positions", "--persistent-vectors", "2"]],
                         ids=["default", "all options"])
@pytest.mark.half_precision
def test_half_precision_trains_and_decodes(flags):
    """What --bf16/--fp16 do on a GPU: the whole model in a 16-bit dtype (run
    here in bfloat16 on the CPU)."""
    model, d = tiny_translation_model(*flags)
    model = model.to(torch.bfloat16)
    src, src_lengths, prev = batch(d)
    model.train()
    teacher_forced(model, src, src_lengths, prev).float().sum().backward()
    assert all(p.grad is None or p.grad.dtype == torch.bfloat16 for p in model.parameters())
    model.eval()
    with torch.no_grad():
        expected = teacher_forced(model, src, src_lengths, prev)
        got, state = incremental(model, model.encoder(src, src_lengths), prev)
        features, _ = model.decoder(prev, model.encoder(src, src_lengths), features_only=True)
    assert features.dtype == torch.bfloat16 and all(  # what is not a count
        t.dtype == torch.bfloat16 for entries in state.values() for t in entries.values() if t.is_floating_point())
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0)  # log-probs: fairseq computes them in float32
