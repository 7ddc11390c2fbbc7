"""Shared test fixtures: the device every model runs on, and tiny random Hugging Face checkpoints, the reference
our model is checked against.

    def test_x(hf_checkpoint, device):
        folder, hf_model = hf_checkpoint(dict(model_type="llama", hidden_size=64, ...), max_shard_size="40KB")
        model, tok = load_pretrained(str(folder), device=device)
        hf_model.to(device)

`transformers` is imported lazily, so test files that do not use these fixtures never pay for it.

Running on a GPU: the suite runs on the CPU unless told otherwise (that is what CI runs); with CUDA:

    python -m pytest -q tests                    # CPU, as CI
    python -m pytest -q tests --device cuda      # every model, input, train.py and evaluate.py run on the GPU

`--device cuda` on a machine without CUDA stops at once with a one-line error. Tests that only make sense on
CUDA (bf16 autocast training) skip on the CPU with the reason. On CUDA the fixture turns TF32 off, so fp32
matmuls are fp32 and the CPU tolerances hold, and asks for deterministic kernels (scatter_add_ and index_add_
without atomics), so "a resumed run continues exactly" stays exact. train.py autocasts to bf16 on CUDA and
evaluate.py defaults to bf16 there; the few tests that compare such runs across different kernel shapes say
so and compare within a bf16 tolerance on CUDA only.
"""

import ast
import copy
import inspect
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# tests import the flat top-level modules (model.py, masks.py, ...) from the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# no test may touch the network; huggingface_hub reads this when first imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Real weights: the few tests that need a real pretrained model read a local Hugging Face folder of
# HuggingFaceTB/SmolLM2-135M-Instruct named by SMOLLM2_DIR (no test downloads anything), and skip without one
SMOLLM2 = Path(os.environ.get("SMOLLM2_DIR", "/nonexistent")).expanduser()
needs_smollm2 = pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").is_file(), reason="set SMOLLM2_DIR to a "
                                   "local folder of HuggingFaceTB/SmolLM2-135M-Instruct to run this test")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="torch device the tests build and run models on: cpu "
                     "(default, what CI runs) or cuda")


def pytest_report_header(config):
    # which vector kernels ATen runs (AVX-512 or AVX2 on x86: ATEN_CPU_CAPABILITY picks one), since reduced-precision
    # results round differently on each
    return f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"


# A test whose code names a reduced precision is marked `reduced_precision` at collection, so no test can be left
# out of the second CI step: .ci/run runs them again on AVX2's kernels (ATEN_CPU_CAPABILITY=avx2, and oneDNN's own
# switch ONEDNN_MAX_CPU_ISA=AVX2 for its bf16 matmuls), where bf16 rounds differently than on AVX-512
REDUCED_PRECISION = re.compile(r"bf16|bfloat16|float16|autocast")


def runs_reduced_precision(source, case="", cases=()):
    """Whether a test function (its source) runs reduced-precision arithmetic on the CPU in its case (`case`, its
    parametrization's id, among its function's `cases`): its code names one (its docstring and comments, which
    may speak of CUDA's bf16 autocast, do not count, nor do its asserts: a plan's printed "bfloat16" is checked, not
    computed), and where some of its cases' ids name one, this case's does (FSDP's pcc-bf16, not its fp32 cases)."""
    tree = ast.parse(textwrap.dedent(source)).body[0]
    body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body

    class NoAsserts(ast.NodeTransformer):
        def visit_Assert(self, node):
            return ast.Pass()
    code = "\n".join(ast.unparse(NoAsserts().visit(node)) for node in [*tree.decorator_list, *body])
    if not REDUCED_PRECISION.search(code):
        return False
    return not any(REDUCED_PRECISION.search(c) for c in cases) or bool(REDUCED_PRECISION.search(case))


def pytest_configure(config):
    config.addinivalue_line("markers", "reduced_precision: the test runs bf16 or fp16 arithmetic (marked at collection "
                            "from its code); .ci/run runs these on AVX2 kernels too")
    try:
        device = torch.device(config.getoption("--device"))
    except RuntimeError as e:
        raise pytest.UsageError(f"--device: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device must be cpu or cuda, got {device}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda, but torch.cuda.is_available() is False on this machine: "
                                    "run without --device (CPU)")
        # cuBLAS is deterministic only with a fixed workspace; it reads this when its first handle is made,
        # so it is set here, before any test touches the GPU (the `device` fixture asks for determinism)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers > 1:   # pytest-xdist: the workers share the cores (2 workers x 2 threads on 2 cores would thrash)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    """Marks the reduced-precision tests (REDUCED_PRECISION), then orders the slow ones. Under pytest-xdist (`-n 2`,
    its default --dist load), the SMOKE recipe runs (tests/test_recipes.py, minutes each) start first, dealt longest
    first to the least loaded worker: each at the head of the first batch xdist's load scheduler hands that worker
    (LoadScheduling.schedule: worker k gets items [k c, (k + 1) c) with c = max(2, items per worker // 4)), the rest
    of the batch and the common queue filling in behind. Without it, one batch could hold several of them and one
    worker end the suite alone. Only the order changes: without xdist, or if the scheduler batches otherwise, every
    test still runs."""
    tests = [item for item in items if isinstance(item, pytest.Function)]
    for item in tests:
        cases = [it.callspec.id for it in tests if it.function is item.function and hasattr(it, "callspec")]
        case = item.callspec.id if hasattr(item, "callspec") else ""
        if runs_reduced_precision(inspect.getsource(item.function), case, cases):
            item.add_marker(pytest.mark.reduced_precision)
    workers = getattr(config, "workerinput", {}).get("workercount", 1)   # (a worker's own option.dist reads "no")
    if workers < 2:
        return
    cost = lambda item: item.module.SMOKE_SECONDS[item.callspec.params["paper"]]
    slow = sorted((it for it in items if it.originalname == "test_recipe_runs_end_to_end"), key=cost, reverse=True)
    if not slow:
        return
    bins, loads = [[] for _ in range(workers)], [0] * workers
    for item in slow:
        k = loads.index(min(loads))
        bins[k].append(item)
        loads[k] += cost(item)
    rest = [it for it in items if all(it is not s for s in slow)]
    c = max(2, min(len(items) // workers // 4, getattr(config.option, "maxschedchunk", None) or len(items)))
    ordered = []
    for b in bins:
        take = max(0, c - len(b))
        ordered += b + rest[:take]
        rest = rest[take:]
    items[:] = ordered + rest


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    """The torch.device of `--device` (default cpu). Every test that builds or runs a model puts it here."""
    dev = torch.device(pytestconfig.getoption("--device"))
    if dev.type == "cuda":
        # TF32 rounds fp32 matmul inputs to 10 mantissa bits (~1e-3 relative): the fp32 parity tolerances
        # (1e-4 on logits) are for real fp32, so it is turned off for the whole session
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # deterministic kernels where PyTorch has them (scatter_add_, index_add_: GMSA's group means, the per-row
        # NLL sums), so two runs of the same step agree bit for bit, as on the CPU; warn_only: an op without
        # such a kernel warns instead of failing the test
        torch.use_deterministic_algorithms(True, warn_only=True)
    return dev


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

    from hf import byte_tokenizer

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


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny models on a
    shared CPU run about 30x faster on one thread than on two fighting over two busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_attention_weights_are_sdpas(model, ids, **forward_kwargs):
    """Attention.weights against the attention SDPA ran, in every layer of one forward: weights @ V (each K/V
    head repeated for its H/Hkv query heads) must equal the layer's output before o_proj. Returns the layers'
    weights (B, H, T, T)."""
    seen = []
    hooks = [h for layer in model.model.layers for h in (
        layer.self_attn.register_forward_pre_hook(lambda attn, args: seen.append((attn, *args[:4]))),
        layer.self_attn.o_proj.register_forward_pre_hook(lambda proj, args: seen.append(args[0])))]
    try:
        with torch.no_grad():
            model(ids, **forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for (attn, x, cos, sin, mask), y in zip(seen[0::2], seen[1::2]):
        with torch.no_grad():
            w = attn.weights(x, cos, sin, mask)                                           # (B, H, T, T)
            _, _, v = attn.qkv(x, cos, sin)                                               # (B, Hkv, T, D)
        v = v.repeat_interleave(attn.n_head // attn.n_kv_head, dim=1)                     # (B, H, T, D)
        B, T, _ = x.shape
        torch.testing.assert_close(w.sum(-1), torch.ones_like(w[..., 0]))
        torch.testing.assert_close((w @ v.float()).transpose(1, 2).reshape(B, T, -1), y.float(), atol=1e-5, rtol=0)
        out.append(w)
    return out


# ---- train.py in-process: the fixtures and readers the tests of a run share ----
# (tests/test_train.py, test_settings.py, test_resume.py, test_heldout.py and test_scale.py)

import json  # noqa: E402

import data as D  # noqa: E402

DOC = D.BUILTIN_TEXTS[3][:48]          # 48 bytes = 48 tokens: a one-document corpus
LORA = ["--lora-r", "8", "--lora-alpha", "16"]


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """A steerable tiny model folder, the one-document corpus, a one-triple QA file, an empty file. The model is
    `tiny`'s architecture with weights drawn at std 0.1 (build_tiny's are 0.02, too small for a frozen decoder to
    read a memory: tests/test_train.py)."""
    from safetensors.torch import save_file

    from hf import byte_tokenizer
    from model import TINY_CONFIG, build_tiny
    root = tmp_path_factory.mktemp("train")
    model, _ = build_tiny()
    for seed, name in ((0, "tiny01"), (1, "other01")):      # other01: a second LLM for --decoder
        g = torch.Generator().manual_seed(seed)
        weights = {n: torch.ones_like(p) if "norm" in n else torch.randn(p.shape, generator=g) * 0.1
                   for n, p in model.named_parameters()}      # tied: lm_head is embed_tokens, saved once
        (root / name).mkdir()
        save_file(weights, str(root / name / "model.safetensors"))
        (root / name / "config.json").write_text(json.dumps(TINY_CONFIG))
        byte_tokenizer().save(str(root / name / "tokenizer.json"))
    (root / "doc.txt").write_text(DOC)
    context, question, answer = D.BUILTIN_QA[2]
    (root / "qa.jsonl").write_text(json.dumps(dict(context=context[:96], question=question, answer=answer)) + "\n")
    (root / "empty.txt").write_text("  \n")
    return dict(model=str(root / "tiny01"), other=str(root / "other01"), doc=str(root / "doc.txt"),
                qa=str(root / "qa.jsonl"), empty=str(root / "empty.txt"))


@pytest.fixture
def run_train(device):
    """run_train(argv): train.main on the test device (train.py's own default is CUDA whenever there is one)."""
    import train
    return lambda argv: train.main([*argv, "--device", str(device)])


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, device):
    """A finished two-step tiny AOC run, saved at step 2: copied by the tests that resume or damage it."""
    import train
    out = str(tmp_path_factory.mktemp("finished") / "aoc")
    train.main(["--method", "aoc", "--model", "tiny", "--mem", "4", "--batch-size", "2", "--steps", "2", "--out", out,
                "--device", str(device)])
    return out


def log_rows(out):
    """The training rows of a run's log (runlog.read_log; the held-out checks are eval_rows)."""
    import runlog
    return runlog.read_log(out)[0]


def eval_rows(out):
    """The held-out checks of a run's log, each a row with its step and "eval"."""
    import runlog
    return runlog.read_log(out)[1]


# ---- train.py under torchrun ----

REPO = Path(__file__).resolve().parents[1]
# sitecustomize for torchrun's processes on the CPU: torch.cuda.is_available() says True, as on a machine with a GPU.
# A CPU run (--device cpu) must then still never touch CUDA: its process group's backend and FSDP's mesh follow
# --device, not is_available() (which would have rank 1 ask for cuda:1 on a machine with one GPU); any CUDA call fails
# here, as there is none
FAKE_GPU = "import torch\ntorch.cuda.is_available = lambda: True\n"


def torchrun(flags, n, tmp_path, fake_gpu=True, timeout=300):
    """train.py under `torchrun --standalone --nproc_per_node n` from the repository root: on the CPU (gloo) with
    is_available() patched to True (fake_gpu), or one process on one GPU (nccl). Returns the completed process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if fake_gpu:
        site = Path(tmp_path) / "fake_gpu"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(FAKE_GPU)
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    import subprocess
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                        "train.py", *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p
