"""Shared test fixtures: tiny random Hugging Face checkpoints, the reference our model is checked against.

    def test_x(hf_checkpoint):
        folder, hf_model = hf_checkpoint(dict(model_type="llama", hidden_size=64, ...), max_shard_size="40KB")
        model, tok = load_pretrained(str(folder))

`transformers` is imported lazily, so test files that do not use these fixtures never pay for it.
"""

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

# tests import the flat top-level modules (model.py, masks.py, ...) from the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# no test may touch the network; huggingface_hub reads this when first imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.15) -> torch.nn.Module:
    """Overwrite every parameter with values that make a missing piece visible: HF's own init sets biases to 0
    and norm weights to 1, which a model that forgot the bias or the norm would reproduce exactly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)       # norm weights in [0.5, 1.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def build_hf_checkpoint(folder: Path, config: dict, seed: int = 0, max_shard_size=None, std: float = 0.15):
    """Build a random HF *ForCausalLM from a config.json-style dict (model_type required), save it with
    save_pretrained (sharded when max_shard_size is small) plus our byte-level tokenizer.json into `folder`.
    Returns (folder, hf_model): the model is the fp32 eval-mode reference, eager attention."""
    import transformers

    from model import byte_tokenizer

    # a deep copy: transformers writes into the nested rope dict it is given (adds rope_theta), which would
    # change the test module's config constants for every later test
    cfg = transformers.AutoConfig.for_model(**copy.deepcopy(config))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomize_(hf, seed, std).eval()
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(folder, **kwargs)
    byte_tokenizer().save(str(folder / "tokenizer.json"))  # ids 0..255 bytes, 256 bos, 257 eos, 258 pad
    return folder, hf


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory fixture: hf_checkpoint(config_dict, seed=0, max_shard_size=None) -> (folder, hf_model)."""
    def make(config: dict, **kwargs):
        return build_hf_checkpoint(tmp_path_factory.mktemp(config["model_type"]), config, **kwargs)
    return make
