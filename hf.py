"""
Reading Hugging Face checkpoints: the tokenizer wrapper (special ids resolved as HF resolves them), a folder or hub
id resolved to local files, and strict safetensors loading (single or sharded; every missing, unexpected or wrongly
shaped tensor named), whole or one tensor at a time (tensor_reader: an FSDP rank's slices). Also the config.json of
each paper model, for benchmarks at their shapes without a download. model.py builds the Transformer these fill
(load_pretrained).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids, each resolved once, here. bos_id may be None (Qwen has no BOS):
    start_id, what a sequence starts with, is then EOS; pad_id falls back to eos_id; eos_ids keeps every stop id a
    checkpoint lists (eos_id is the first)."""

    def __init__(self, tk: HFTokenizer, bos_id: int | None, eos_id: int | None, pad_id: int | None = None,
                 eos_ids: list[int] | None = None):
        self.tk = tk
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = eos_id if pad_id is None else pad_id
        self.start_id = eos_id if bos_id is None else bos_id
        self.eos_ids = eos_ids or ([] if eos_id is None else [eos_id])
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)

    def cut_at_eos(self, ids: list) -> list:
        """ids up to (not including) the first stop id."""
        stop = set(self.eos_ids)
        return next((ids[:i] for i, t in enumerate(ids) if t in stop), ids)

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Tokenizer":
        """Special ids as HF resolves them: generation_config.json, then config.json (a multimodal config's
        text_config after its top level, as HF's generation config reads the text model's), then
        tokenizer_config.json."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").exists():
            raise FileNotFoundError(f"no tokenizer.json in {folder} (only fast tokenizers load; write one with "
                                    f"transformers' AutoTokenizer.from_pretrained(...).save_pretrained)")
        tk = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        config = read_json(folder / "config.json")
        configs = [read_json(folder / "generation_config.json"), config, config.get("text_config") or {}]
        tok_cfg = read_json(folder / "tokenizer_config.json")

        def special(kind):  # -> list of ids (eos may be a list), [] if none is declared
            # the generation config wins, as in HF's generate(); tokenizer_config.json names tokens, not ids
            for c in configs:
                if c.get(f"{kind}_token_id") is not None:
                    v = c[f"{kind}_token_id"]
                    return v if isinstance(v, list) else [v]
            tok = tok_cfg.get(f"{kind}_token")
            tok = tok.get("content") if isinstance(tok, dict) else tok  # older files store an AddedToken dict
            return [] if tok is None or tk.token_to_id(tok) is None else [tk.token_to_id(tok)]

        bos, eos, pad = special("bos"), special("eos"), special("pad")
        return cls(tk, bos[0] if bos else None, eos[0] if eos else None, pad[0] if pad else None, eos)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        # add_special_tokens=False: some tokenizer.json files carry a post-processor that would add BOS/EOS
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if bos:
            if self.bos_id is None:
                raise ValueError("this tokenizer has no BOS token; call encode(text) without bos=True")
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
        return self.tk.decode(ids, skip_special_tokens=True)


def byte_tokenizer() -> HFTokenizer:
    """256 byte tokens (id = byte value) + <|bos|> 256, <|eos|> 257, <|pad|> 258: round-trips any UTF-8."""
    # byte-level BPE shows byte b as a printable character (GPT-2's bytes_to_unicode); no merges = one token per byte
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char_of = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tk = HFTokenizer(models.BPE(vocab={char_of[b]: b for b in range(256)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>"])
    return tk


LLAMA_3_2_1B_CONFIG = dict(  # meta-llama/Llama-3.2-1B(-Instruct) config.json (AOC's model): shapes without a download
    model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192))

QWEN3_4B_CONFIG = dict(  # Qwen/Qwen3-4B config.json (CompLLM's model): shapes without a download
    model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=40960, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)

GEMMA_3_4B_CONFIG = dict(  # google/gemma-3-4b-it's text_config (CompLLM's other model), with HF Gemma3TextConfig's
    # defaults written out (the hub file names only hidden/intermediate size, layers, rope_scaling and sliding_window):
    # 5 local layers (window 1024, RoPE base 10k) per global one (RoPE base 1M, linear x8)
    model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=dict(rope_type="linear", factor=8.0),
    rope_local_base_freq=10000.0, sliding_window=1024, sliding_window_pattern=6, query_pre_attn_scalar=256,
    max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)

LLAMA_2_7B_CONFIG = dict(  # meta-llama/Llama-2-7b-hf config.json (ICAE's and GMSA's model): 6,738,415,616 parameters
    model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

LLAMA_3_8B_CONFIG = dict(  # meta-llama/Meta-Llama-3-8B config.json (500xCompressor's, and PIC's decoder, -Instruct:
    # the same shapes): 8,030,261,248 parameters
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def resolve(name_or_path: str) -> Path:
    """A local folder as is; an 'org/name' hub id through huggingface_hub (config, safetensors, tokenizer only)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    # anything that is not shaped like "org/name" cannot be a hub id: report the missing folder right away
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", name_or_path):
        raise FileNotFoundError(f"model directory not found: {name_or_path} (pass an existing folder with "
                                f"config.json + *.safetensors, a hub id like 'HuggingFaceTB/SmolLM2-135M', or 'tiny')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError
    # huggingface_hub reads HF_HUB_OFFLINE once, at import; honour it when set later (tests, notebooks) too
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        local = snapshot_download(name_or_path, local_files_only=offline, allow_patterns=[
            "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    except LocalEntryNotFoundError:
        raise OSError(f"cannot fetch {name_or_path!r}: the Hugging Face hub is unreachable (offline or no "
                      f"network) and it is not cached; pass a local directory with config.json + *.safetensors "
                      f"instead") from None
    return Path(local)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: the shards model.safetensors.index.json names, or model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted({folder / f for f in read_json(index)["weight_map"].values()})
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    raise FileNotFoundError(f"no safetensors weights in {folder} (expected model.safetensors or "
                            f"model.safetensors.index.json; re-save .bin checkpoints with save_pretrained)")


def tensor_reader(folder: Path, dtype, device, prefix: str = ""):
    """read(name) -> the one tensor `name` (prefix stripped, as load_weights names it) of a model folder's weights, in
    `dtype` on `device`, as load_weights loads it: its file is opened for that tensor alone and closed again (no
    mapping of the whole file stays), so a process that reads tensor after tensor holds one at a time."""
    where = {}
    for f in weight_files(folder):
        with safe_open(f, framework="pt") as sf:
            where |= {k.removeprefix(prefix): (f, k) for k in sf.keys()}

    def read(name):
        f, key = where[name]
        with safe_open(f, framework="pt", device=str(device)) as sf:
            return sf.get_tensor(key).to(dtype)
    return read


def load_weights(model, folder: Path, dtype, device, prefix: str = ""):
    """Strict: check every name and shape in the file headers first (nothing loaded yet), then load shard by
    shard with assign=True, so each tensor exists once, already in `dtype` on `device`. prefix: stripped from the
    file's names (a multimodal Gemma 3's "language_model."). On the meta device (train.py --fsdp builds there, and
    each rank reads its slices after sharding: tensor_reader) the names and shapes are checked and nothing is read."""
    files = weight_files(folder)
    cfg = model.config
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del expected["lm_head.weight"]  # tied: the embedding serves as lm_head

    # the norms of the second sub-block, dropped with it (mlp="none"); Gemma's post_attention_layernorm belongs to
    # the attention sub-block (see Block)
    mlp_norms = (".pre_feedforward_layernorm.", ".post_feedforward_layernorm.") if cfg.gemma else \
        (".post_attention_layernorm.",)

    def ignorable(name):  # in the file, deliberately not loaded
        return ("rotary_emb.inv_freq" in name                                # old Llama files saved the RoPE buffer
                or name == "lm_head.weight"                                  # a tied copy some checkpoints store
                or (cfg.mlp != "swiglu" and ".mlp." in name)                 # AOC: the MLPs are dropped
                or (cfg.mlp == "none" and any(n in name for n in mlp_norms))
                or (prefix and name.startswith(("vision_tower.", "multi_modal_projector."))))  # Gemma 3's vision

    found = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            found |= {k.removeprefix(prefix): tuple(sf.get_slice(k).get_shape()) for k in sf.keys()}
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(k for k in found.keys() - expected.keys() if not ignorable(k))
    wrong = [f"{k} {found[k]} (model wants {expected[k]})" for k in sorted(expected.keys() & found.keys())
             if found[k] != expected[k]]
    if missing or unexpected or wrong:
        problems = [f"{what}: {', '.join(names[:8])}{f' ... ({len(names) - 8} more)' if len(names) > 8 else ''}"
                    for what, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
                    if names]
        raise ValueError(f"checkpoint {folder} does not fit a {cfg.arch} model with mlp={cfg.mlp!r}: "
                         + "; ".join(problems) + " (check config.json matches the weights)")
    if torch.device(device).type == "meta":
        model.to(dtype)
        return
    for f in files:
        with safe_open(f, framework="pt", device=str(device)) as sf:
            shard = {k.removeprefix(prefix): sf.get_tensor(k).to(dtype) for k in sf.keys()
                     if k.removeprefix(prefix) in expected}
        model.load_state_dict(shard, strict=False, assign=True)  # strict was checked above, across all shards
