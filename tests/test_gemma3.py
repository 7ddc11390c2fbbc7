"""Gemma 3 (gemma3.py, model.py) against transformers (the reference) on tiny random checkpoints saved in HF format and read
by load_pretrained: logits, a KV prefix, greedy generation, the multimodal checkpoint layout, bf16 embeddings, the
config layouts and defaults, the tokenizer and chat template, and train.py on a Gemma folder.

The config makes every Gemma rule visible: a 30-token input runs past the 8-slot window, the layers are local,
local, global, local (so local layers come before and after the global one), the two RoPE bases differ and the
global one is linearly scaled, query_pre_attn_scalar (24) is not head_dim (16), head_dim is not d / H (12), and
sqrt(48) is not exact in bf16. test_each_gemma_rule_moves_the_logits shows that leaving any rule out fails the
parity test by far more than its tolerance.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

import checkpoint
import compressors as C
import presets as P
import masks
from conftest import assert_attention_weights_are_sdpas, randomize_
from hf import Tokenizer, byte_tokenizer
from model import SHAPES, ModelConfig, Transformer, copy_model, load_pretrained

# special ids of the test tokenizer (gemma_tokenizer): the byte tokenizer's <|eos|> and <|pad|>, then Gemma's <bos>
# and chat markers (gemma-3: <bos> 2, <eos> 1, <pad> 0, <start_of_turn> 105, <end_of_turn> 106)
EOS, PAD, BOS, START_OF_TURN, END_OF_TURN = 257, 258, 259, 260, 261
GEMMA = dict(
    model_type="gemma3_text", vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, sliding_window_pattern=3,
    query_pre_attn_scalar=24, rope_theta=1000000.0, rope_local_base_freq=10000.0,
    rope_scaling=dict(rope_type="linear", factor=8.0), max_position_embeddings=512,
    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
W = GEMMA["sliding_window"]
# google/gemma-3-4b-it's config.json as the hub has it (transformers 4.50): its text_config names only five keys,
# Gemma3TextConfig's defaults supply the rest; the vision tower's config is left out here (never read)
HUB_GEMMA_3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16"}

HUB_GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 262144}


def gemma_tokenizer() -> HFTokenizer:
    """The byte-level test tokenizer plus Gemma's <bos> and chat markers, so the chat template (which spells out
    "<bos>") resolves to Gemma's and encodes to these ids."""
    tk = byte_tokenizer()  # bytes 0..255, <|bos|> 256, <|eos|> 257, <|pad|> 258
    tk.add_special_tokens(["<bos>", "<start_of_turn>", "<end_of_turn>"])  # 259, 260, 261
    return tk


def write_gemma_folder_extras(folder: Path):
    """What a real Gemma folder has beside the weights: its tokenizer and a generation config that also stops at
    <end_of_turn> (gemma-3-4b-it: eos_token_id [1, 106])."""
    gemma_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps(
        dict(bos_token_id=BOS, eos_token_id=[EOS, END_OF_TURN], pad_token_id=PAD)))


@pytest.fixture(scope="module")
def gemma(hf_checkpoint, device):
    """(folder, hf Gemma3ForCausalLM, our model), both on `device`."""
    folder, hf = hf_checkpoint(GEMMA)
    write_gemma_folder_extras(folder)
    ours, _ = load_pretrained(str(folder), device=device)
    return folder, hf.to(device), ours


def ids_(device, B=2, T=30, seed=0):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed)).to(device)


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def close(a, b, atol=1e-4):
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


# ---------------------------------------------------------------------------- parity with transformers


def test_checkpoint_exercises_what_it_claims(gemma):
    folder, hf, ours = gemma
    cfg = ours.config
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
    assert tuple(hf.config.layer_types) == cfg.layer_types and ids_("cpu").shape[1] > W
    assert cfg.rope_local_theta != cfg.rope_theta and cfg.rope_scaling == dict(rope_type="linear", factor=8.0)
    assert cfg.query_pre_attn_scalar != cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied, as every Gemma 3
    # the four norms per block, q/k norms, and no weight of the file left out or invented (strict loading)
    assert {n.split(".")[-2] for n in ours.state_dict() if "layers.0." in n and "norm" in n} == {
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
        "q_norm", "k_norm"}
    assert all(torch.equal(p, ours.state_dict()[n]) for n, p in hf.state_dict().items())


def test_logits_match_transformers(gemma, device):
    _, hf, ours = gemma
    ids = ids_(device)
    with torch.no_grad():
        close(ours(ids).logits, hf(ids).logits)
        # soft tokens (a compressor's memory) before the token embeddings: inputs_embeds as HF takes them, unscaled
        memory = torch.randn(2, 5, GEMMA["hidden_size"], generator=torch.Generator().manual_seed(1)).to(device)
        embeds = torch.cat([memory, ours.model.embed_tokens(ids)], dim=1)  # (B, 35, d): past the window too
        close(ours(inputs_embeds=embeds).logits, hf(inputs_embeds=embeds).logits)


def test_each_gemma_rule_moves_the_logits(gemma, device):
    """Each rule, left out of a copy of our model, moves the logits by far more than the parity tolerance (1e-4):
    the parity test above fails for any of them."""
    _, hf, ours = gemma
    ids = ids_(device)
    no_embed_scale = copy_model(ours)
    no_embed_scale.model.embed_tokens.scale = 1.0
    wrong = {
        "no sliding window": copy_model(ours, sliding_window=10_000),
        "local RoPE at the global base": copy_model(ours, rope_local_theta=ours.config.rope_theta),
        "global RoPE without linear scaling": copy_model(ours, rope_scaling=None),
        "scores / sqrt(head_dim)": copy_model(ours, query_pre_attn_scalar=ours.config.head_dim),
        "every layer global": copy_model(ours, layer_types=("full_attention",) * 4),
        "no sqrt(d) embedding scale": no_embed_scale,
    }
    with torch.no_grad():
        ref = hf(ids).logits
        moved = {name: max_diff(model(ids).logits, ref) for name, model in wrong.items()}
    assert all(d > 1e-2 for d in moved.values()), moved


def test_kv_prefix_equals_one_pass(gemma, device):
    """Sliding window vs a K/V prefix (the 500x/AOC carrier): the window counts slots back over the whole sequence,
    prefix included, so a forward given the prefix's K/V equals HF's one pass over prefix and tokens, also for
    queries more than W slots after the prefix (prefix 12 > W, then 18 tokens); and token by token likewise."""
    folder, hf, ours = gemma
    other, _ = load_pretrained(str(folder), device=device)  # the prefix comes from another instance
    ids, P = ids_(device), 12
    with torch.no_grad():
        ref = hf(ids).logits
        prefix = other(ids[:, :P], return_kv=True).kv
        assert prefix[0][0].shape == (2, 2, P, 16)
        close(ours(ids[:, P:], past_kv=prefix).logits, ref[:, P:])
        out, steps = ours(ids[:, :18], return_kv=True), []  # one token at a time: each sees W slots locally
        for t in range(18, 30):
            out = ours(ids[:, t:t + 1], past_kv=out.kv, return_kv=True)
            steps.append(out.logits)
        close(torch.cat(steps, dim=1), ref[:, 18:])


def test_attention_weights_are_what_sdpa_applies(gemma, device):
    """Attention.weights with Gemma's query_pre_attn_scalar scale, local RoPE and the sliding window: each layer's
    weights @ V equal its SDPA output, and a local layer puts no weight W or more slots back."""
    _, _, ours = gemma
    weights = assert_attention_weights_are_sdpas(ours, ids_(device))
    T = weights[0].shape[-1]
    far = ~masks.sliding_window(T, T, W).to(device) & masks.causal(T).to(device)   # causal, but W or more back
    for layer, w in zip(ours.model.layers, weights):
        assert (w[..., far] == 0).all() == layer.sliding


def test_sliding_window_band_number_by_number():
    # queries are the last 3 of 6 slots (3, 4, 5); each sees keys fewer than W = 2 slots back (HF: kv > q - W)
    band = masks.sliding_window(3, 6, 2)
    assert band.int().tolist() == [[0, 0, 1, 1, 1, 1],
                                   [0, 0, 0, 1, 1, 1],
                                   [0, 0, 0, 0, 1, 1]]
    assert (masks.sliding_window(4, 4, 4) | ~masks.causal(4)).all()  # a window as long as the sequence hides nothing


def test_greedy_generation_matches_transformers(gemma, device):
    _, hf, ours = gemma
    ids = ids_(device, T=10)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                      eos_token_id=None, pad_token_id=PAD)[:, ids.shape[1]:]
    assert ref.shape == (2, 16)  # 26 slots: far past the window
    assert torch.equal(ours.generate(ids, max_new_tokens=16), ref)


def test_multimodal_checkpoint_loads_its_text_tower(tmp_path, device):
    """A Gemma3ForConditionalGeneration (model_type gemma3, text_config nested, a tiny SigLIP vision tower) as
    transformers saves it: language_model.model.* / vision_tower.* names; the vision tower is skipped, the text
    tower gives HF's logits for a text-only input."""
    import transformers
    from safetensors import safe_open

    text = {k: v for k, v in GEMMA.items() if k != "rope_scaling"}
    cfg = transformers.Gemma3Config(
        text_config=dict(text, rope_scaling=dict(GEMMA["rope_scaling"])),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4)
    hf = randomize_(transformers.Gemma3ForConditionalGeneration(cfg), seed=3).eval()
    hf.set_attn_implementation("eager")  # the same reference as the other parity tests
    hf.save_pretrained(tmp_path)
    gemma_tokenizer().save(str(tmp_path / "tokenizer.json"))
    # without generation_config.json the special ids come from text_config (the top level has none), as HF's
    # GenerationConfig.from_model_config reads them
    (tmp_path / "generation_config.json").unlink()
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in names        # the hub's layout
    assert any(n.startswith("vision_tower.") for n in names) and json.loads(
        (tmp_path / "config.json").read_text())["model_type"] == "gemma3"
    ours, tok = load_pretrained(str(tmp_path), device=device)
    ids = ids_(device)
    with torch.no_grad():
        close(ours(ids).logits, hf.to(device)(input_ids=ids).logits)
    assert ours.config.layer_types[2] == "full_attention" and (tok.bos_id, tok.eos_id) == (BOS, EOS)


# bf16 logits against transformers' SDPA path: measured on the CPU, 4 weight seeds x 4 inputs, bit for bit equal
# (the same ops in the same order, which no transformers release promises: hence a bound of a few bf16 ulps at
# |logit| < 16, as test_model.py's BF16_LOGIT_ATOL). Its eager path is no bf16 reference for Gemma: it rounds the
# softmax probabilities to bf16 before the value product, and through the sandwich norms that moved the same logits
# by 0.26-0.84 (our SDPA, like HF's, keeps them in fp32).
BF16_LOGIT_ATOL = 0.3


def test_bf16_embeddings_and_logits_round_like_transformers(gemma, device):
    """HF multiplies by sqrt(d) rounded to the embedding dtype: sqrt(48) = 6.928 is 6.9375 in bf16. Ours does too,
    bit for bit; scaling in fp32 and rounding after would not."""
    import transformers

    folder, _, _ = gemma
    ours, _ = load_pretrained(str(folder), dtype=torch.bfloat16, device=device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    ids = ids_(device)
    with torch.no_grad():
        got = ours.model.embed_tokens(ids)
        assert got.dtype == torch.bfloat16 and torch.equal(got, hf.model.embed_tokens(ids))
        fp32_scale = (torch.nn.functional.embedding(ids, ours.model.embed_tokens.weight).float()
                      * math.sqrt(48)).bfloat16()
        assert not torch.equal(got, fp32_scale)
        close(ours(ids).logits.float(), hf(ids).logits.float(), atol=BF16_LOGIT_ATOL)


# ---------------------------------------------------------------------------- config, shapes, errors


def test_config_layouts_and_defaults_agree():
    # transformers v4 layout (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern) and v5's
    # (rope_parameters per layer type, explicit layer_types), as transformers itself writes it, give one config
    import transformers

    ours = ModelConfig.from_hf(GEMMA)
    v5 = transformers.AutoConfig.for_model(**json.loads(json.dumps(GEMMA))).to_dict()
    assert "rope_parameters" in v5 and "rope_theta" not in v5 and ModelConfig.from_hf(v5) == ours
    assert ModelConfig.from_hf(ours.to_hf()) == ours
    assert ModelConfig.from_hf(transformers.AutoConfig.for_model(**ours.to_hf()).to_dict()) == ours
    # the hub's sparse gemma-3-4b-it config: transformers' defaults fill it exactly as ours do, and it is SHAPES'
    hub = ModelConfig.from_hf(HUB_GEMMA_3_4B)
    hf_text = transformers.Gemma3Config(**json.loads(json.dumps(HUB_GEMMA_3_4B))).text_config.to_dict()
    assert hub == ModelConfig.from_hf(hf_text) == ModelConfig.from_hf(SHAPES["gemma-3-4b"])
    assert hub.layer_types.count("full_attention") == 5 and hub.layer_types[5] == "full_attention"  # 5:1, 34 layers
    assert (hub.sliding_window, hub.rope_theta, hub.rope_local_theta, hub.query_pre_attn_scalar) == \
        (1024, 1e6, 1e4, 256)
    # gemma-3-1b-it's config.json (a gemma3_text model, transformers 4.50's v4 layout): read as transformers does
    one_b = ModelConfig.from_hf(HUB_GEMMA_3_1B)
    assert one_b == ModelConfig.from_hf(transformers.AutoConfig.for_model(**json.loads(json.dumps(HUB_GEMMA_3_1B)))
                                        .to_dict())
    assert (one_b.num_key_value_heads, one_b.sliding_window, one_b.rope_scaling, one_b.eos_token_id) == \
        (1, 512, None, 1)


def test_gemma_3_4b_shape_has_the_reports_parameter_count():
    """Built on the meta device (no memory): 3,209M non-embedding parameters, Gemma 3 report Table 1."""
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(SHAPES["gemma-3-4b"]))
    total = sum(p.numel() for p in model.parameters())  # the tied lm_head counted once
    embedding = model.model.embed_tokens.weight.numel()
    assert round((total - embedding) / 1e6) == 3209 and embedding == 262208 * 2560


@pytest.mark.parametrize("change,message", [
    (dict(final_logit_softcapping=30.0), "unsupported final_logit_softcapping=30.0"),
    (dict(attn_logit_softcapping=50.0), "unsupported attn_logit_softcapping=50.0"),
    (dict(hidden_activation="relu"), "unsupported hidden activation 'relu'"),
    (dict(use_bidirectional_attention=True), "unsupported use_bidirectional_attention"),
    (dict(rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e6),
                               sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e4))),
     "unsupported RoPE scaling on the sliding layers"),
])
def test_unsupported_configs_are_one_line_errors(change, message):
    with pytest.raises(ValueError, match=message) as e:
        ModelConfig.from_hf({**GEMMA, **change})
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- the compression methods on Gemma


def test_aoc_and_mlp_free_blocks(gemma, device):
    """AOC Eq. (3) on Gemma's sandwich block, as HF's layer with mlp = nn.Identity(): h += LN_post_ff(LN_pre_ff(h));
    mlp="none" drops the second sub-block (its two norms), Gemma's post_attention_layernorm stays."""
    folder, _, full = gemma
    aoc, _ = load_pretrained(str(folder), mlp="aoc", device=device)
    bare, _ = load_pretrained(str(folder), mlp="none", device=device)
    assert not any(".mlp." in n for n in aoc.state_dict())
    assert not any("feedforward" in n for n in bare.state_dict())
    assert "model.layers.0.post_attention_layernorm.weight" in bare.state_dict()
    ids = ids_(device, T=6)
    with torch.no_grad():
        layer, h = full.model.layers[0], full.model.embed_tokens(ids)
        cos, sin = full.rope(torch.arange(6, device=device)[None], h.dtype, local=True)  # layer 0 is local
        h = h + layer.post_attention_layernorm(layer.self_attn(layer.input_layernorm(h), cos, sin, None)[0])
        close(bare(ids, output_hidden_states=True).hidden_states[1], h, atol=1e-6)
        h = h + layer.post_feedforward_layernorm(layer.pre_feedforward_layernorm(h))
        close(aoc(ids, output_hidden_states=True).hidden_states[1], h, atol=1e-6)


def test_tokenizer_and_chat_template(gemma, device):
    folder, _, ours = gemma
    tok = Tokenizer.from_dir(folder)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.eos_ids) == (BOS, EOS, PAD, [EOS, END_OF_TURN])
    assert tok.encode("hi") == [104, 105] and tok.encode("hi", bos=True) == [BOS, 104, 105]  # BOS only when asked
    comp = C.build("compllm", copy_model(ours), tok)  # CompLLM's preset: template "chat"
    assert comp.template() == P.TEMPLATES["gemma"]
    parts = comp.qa_parts("ctx", "q?")
    assert parts["prefix"][:2] == [BOS, START_OF_TURN] and END_OF_TURN in parts["prompt"]
    assert parts["prompt"][-7:] == [START_OF_TURN, *b"model\n"]  # the model's turn opens after the question


def test_train_compllm_two_steps_on_a_gemma_folder(gemma, tmp_path, device):
    import data as D
    import train

    folder = gemma[0]
    context, question, answer = D.BUILTIN_QA[2]
    (tmp_path / "qa.jsonl").write_text(json.dumps(dict(context=context[:96], question=question, answer=answer)))
    out = tmp_path / "run"
    train.main(["--method", "compllm", "--model", str(folder), "--data", str(tmp_path / "qa.jsonl"), "--lora-r", "4",
                "--lora-alpha", "8", "--batch-size", "2", "--steps", "2", "--answer-tokens", "6", "--out", str(out),
                "--device", str(device)])
    rows = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    comp = checkpoint.load(str(out), device=device)
    assert comp.decoder.config.gemma and comp.template() == P.TEMPLATES["gemma"]


def test_vectors_handed_to_the_decoder_sit_at_the_scale_gemma_reads(gemma, device):
    """Gemma 3 multiplies its embedding rows by sqrt(d) before block 0, so every vector the compressors place among
    the decoder's inputs must be at that scale: AOC's [BOS] after the memory is embed_tokens(bos) (the table row
    times sqrt(d)), EPL's drawn memory tokens take the scaled table's statistics, and --mem-norm rescales to the
    scaled rows' norm (on Gemma the raw table is sqrt(d) times too small: 8x here, 50x on gemma-3-4b)."""
    folder, _, ours = gemma
    tok = Tokenizer.from_dir(folder)
    scale = ours.config.hidden_size ** 0.5
    table = ours.model.embed_tokens.weight.detach()
    comp = C.build("aoc", copy_model(ours), tok)                 # AOC code: the regeneration token is [BOS]
    torch.testing.assert_close(comp.special_embedding("ae").detach(), table[tok.start_id] * scale)
    torch.manual_seed(0)
    drawn = C.draw("embed", 20000, ours).float()                 # EPL code: N(mean, std) of the embedding
    assert abs(drawn.std().item() / (table.float().std().item() * scale) - 1) < 0.02
    drawn = C.draw("hf", 20000, ours).float()                    # PCC code: new table rows N(0, 0.02), as read
    assert abs(drawn.std().item() / (0.02 * scale) - 1) < 0.02
    comp = C.build("icae", copy_model(ours), tok, mem_norm=True)
    memory = comp.compress([tok.encode("some text to compress")])
    target = table.float().norm(dim=-1).mean().item() * scale
    norms = memory.embeds[memory.valid].float().norm(dim=-1)
    assert torch.allclose(norms, torch.full_like(norms, target), rtol=1e-4)


def test_padded_batch_under_the_window_gives_sdpa_no_all_false_row(gemma, device, monkeypatch):
    """masks.with_padding promises no all-False query row (NaN on some kernels, then 0 x NaN reaches real tokens in
    the next layer). The window ANDed on top must keep it: with W = 8 and real lengths 30 and 5 (right padding), the
    short row's pad queries 12..29 see only real keys W or more slots back. Every mask SDPA gets has a key per row."""
    import model as M

    _, _, ours = gemma
    seen, sdpa = [], M.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(M.F, "scaled_dot_product_attention", spy)
    T, lengths = 30, (30, 5)
    valid = torch.tensor([[t < n for t in range(T)] for n in lengths])
    mask = masks.with_padding(masks.causal(T), valid).to(device)
    assert T - lengths[1] > W   # more padding than the window
    with torch.no_grad():
        out = ours(ids_(device, T=T), attn_mask=mask).logits
    local = [m for m, layer in zip(seen, ours.model.layers) if layer.sliding]
    assert len(seen) == len(ours.model.layers) and local
    assert all(m is not None and m.any(dim=-1).all() for m in seen)
    assert torch.isfinite(out).all()
    # the composition itself, in masks: the band is applied, and real queries keep exactly their band
    composed = masks.with_window(mask.cpu(), W)
    assert composed.any(dim=-1).all()
    assert torch.equal(composed[0], (masks.causal(T) & masks.sliding_window(T, T, W)))
