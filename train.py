"""
Train a soft context compressor: one script for every method in compressors.py.

    python train.py --method aoc --mem 4           # CPU, under two minutes: --model tiny's demo (cli.TINY), 4x

It reads in the order it runs, main() last: the settings (cli.py resolves every flag once, each with its source:
the first log line), the processes (parallel.py: torchrun, DDP, FSDP), the run's set-up, the compressor, the
optimizer, the log, the loop (the step: forward and backward over the micro-batches; the held-out check, heldout.py;
checkpoints, checkpoint.py), the step's objective and its losses. The objectives, each named after its paper:

    pretrain   L = α·L_LM + (1 − α)·L_AE on ONE compression of the first p = ⌊|X|/2⌋ tokens of a text X
               (EPL §3.1.1 and App. C; PIC Eq. 6-8 with λ = α = 0.5: TR = AE reconstructs x_1..x_p and EOS,
               TC = LM continues with x_p+1..x_|X| and EOS, as the EPL and PCC code build their targets)
    ae         L_AE alone: regenerate the compressed text (ICAE AE, AOC Eq. 4, GMSA stage 1)
    qa         [memory; [LM]; prompt] -> answer, cross-entropy on the answer and EOS only, the prompt built from
               the preset's template (EPL fine-tuning, PCC/PIC SQuAD, GMSA KEFT)
    distill    CompLLM Eq. (1)-(3): the LLM reading the memory imitates, layer by layer, the LLM reading the
               full context, on answers the frozen LLM generated itself (cached on disk)

Every run can be stopped and continued exactly: a checkpoint (trained tensors, optimizer, RNG states, step, args) is
written as a unit every --save-every steps, at the end, after --stop-after K, and on Ctrl-C / SIGTERM; the batch of
step s is drawn from generators seeded with (seed, s, sample index), so the data position is just the step number.
Out of memory, or a non-finite loss, ends the run with one line and keeps the last good checkpoint. The default
model, `tiny`, is a CPU demo (ours) with settings of its own (cli.TINY); any other model trains with the paper's
recipe. On a GPU with a paper model (bf16 autocast, same flags):

    python train.py --method aoc --mem 16 --model meta-llama/Llama-3.2-1B-Instruct --data corpus/ --steps 20000
    torchrun --nproc_per_node 8 train.py --method icae --layout epl --model meta-llama/Llama-3.2-1B --data pile.jsonl
"""

import math
import os
import signal
import time
from contextlib import ExitStack, contextmanager, nullcontext
from functools import partial

import torch
import torch.nn as nn
from tqdm import tqdm

import checkpoint
import cli
import compressors
import data
import parallel
import plan
from checkpoint import gather_rng_states, is_out_of_memory, latest_checkpoint, save_checkpoint, set_rng_state
from cli import Run, fail
from heldout import first_carrying_step, prepare, run_check
from model import load_pretrained
from runlog import trim_log, write_log

# ---- the compressor ----


def build_compressor(cfg, device, frozen=torch.float32, weights=None, weights_cfg=None):
    """The compressor of `cfg` (cli.py made it, once), as built, before the trained tensors it starts from load
    (main: `weights`, a checkpoint directory whose tensors were saved under `weights_cfg`, or --warm-start's run).
    Trained weights are fp32 (AdamW's master weights), frozen base weights `frozen` (--frozen-dtype,
    Compressor.set_dtypes, before any tensor is loaded: they load unrounded); CUDA runs, and bf16 ones anywhere,
    compute in bf16 through autocast. On the meta device (--fsdp): shapes and dtypes only, nothing read or drawn
    (parallel.materialise fills each rank's slices once sharded)."""
    # --model compresses and decodes; with --decoder, --model is only the compressor (pcc/pic): cfg.model decodes.
    # On the meta device every tensor the build makes is meta, the ones made on the default device too (the MLP bridge)
    with torch.device("meta") if device.type == "meta" else nullcontext():
        decoder, tok = load_pretrained(cfg.model, dtype=frozen, device=device)
        encoder, enc_tok = load_pretrained(cfg.compressor_model, dtype=frozen, device=device) \
            if cfg.compressor_model else (None, None)
        # a KEFT config (GMSA §3.5) freezes encoder + LSA and trains decoder W_q, W_k, W_v from here on (set_stage)
        comp = compressors.Compressor(cfg, decoder, tok, encoder, enc_tok).set_dtypes(frozen)
    # KEFT starts here (not a resumed KEFT run, nor one from --init of a KEFT run): from a stage-1 run's tensors
    if cfg.decoder_train == "keft" and (weights_cfg is None or weights_cfg.decoder_train != "keft"):
        if comp.shares_decoder:   # the LoRA encoder IS the decoder: training its q/k/v would move the encoder too
            fail(f"--stage keft trains the decoder's q/k/v, which {cfg.method}'s LoRA encoder shares")
        if not weights:
            fail("--stage keft starts from a stage-1 (ae) run: pass --init DIR")
    return comp


def warm_start(comp, run_dir):
    """--warm-start RUN (ours): another run's trained tensors, this run's settings (load_trained checks they fit)."""
    try:
        checkpoint.load_trained_from(comp, run_dir)
    except ValueError as e:
        raise ValueError(f"--warm-start {run_dir}: {e} (it must be the same preset with the same --mem, LoRA and "
                         "model)") from None


def compile_models(comp, cuda_graphs: bool = False, backend: str = "inductor"):
    """--compile: torch.compile each model's whole forward (compressors.models: the encoder, the decoder, GMSA's LSA
    blocks), one graph each with no graph break in any preset (tests/test_step.py), so that RoPE, the masks, the norms
    and the blocks fuse together. A forward that runs in another way is another graph of the same model: with LoRA on
    and off (a LoRA encoder IS the decoder), without gradients (CompLLM's teacher), with a mask or none.
    dynamic=True: the graphs take any length, so steps whose lengths change recompile nothing (tested).
    cuda_graphs (ours, --cuda-graphs): static shapes (AOC: every text n tokens) in reduce-overhead mode, each graph
    recorded once as a CUDA graph and replayed with one launch (cli.py allows it only on CUDA, where no length
    varies). backend: the tests count graphs with a backend of their own."""
    for model in compressors.models(comp):   # (a LoRA encoder is the decoder: once)
        model.compile(backend=backend, dynamic=not cuda_graphs, mode="reduce-overhead" if cuda_graphs else None)

# ---- optimizer ----


def make_optimizer(comp, lr, betas, weight_decay, mem_lr, device, capturable: bool = False):
    """AdamW over the trainable tensors. Weight decay on matrices only (nanoGPT): decaying norms, biases or
    the [AE]/[LM] embeddings towards 0 would only fight the model. CompLLM's Adam is weight_decay = 0.
    capturable (--cuda-graphs, CUDA): AdamW's state, its step counts included, stays on the GPU, as CUDA graphs need."""
    params = comp.trainable_parameters()
    # --mem-lr (ours): the memory tokens in a group of their own, at mem_lr / lr times every step's lr
    own = [comp.mem_tokens] if mem_lr is not None and comp.mem_tokens is not None else []
    if mem_lr is not None and not own:
        fail(f"--mem-lr sets the learning rate of learned memory tokens, and {comp.cfg.method} has none "
             f"(source={comp.cfg.source})")
    rest = [p for p in params if all(p is not q for q in own)]
    groups = [dict(params=[p for p in rest if p.dim() >= 2], weight_decay=weight_decay),
              dict(params=[p for p in rest if p.dim() < 2], weight_decay=0.0)]
    if own:
        groups.append(dict(params=own, weight_decay=weight_decay, lr_scale=mem_lr / lr))
    # fused: one kernel for all tensors. On the CPU the per-tensor loop (sqrt, div, lerp, addcdiv per tensor) is a
    # quarter of PCC's step on SmolLM2 (tests/bench_train.py --profile); fused gives the same losses to 1e-6
    # (tests/README.md, "Where a CPU training step goes")
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), fused=device.type in ("cuda", "cpu"),
                             capturable=capturable)

# ---- the log ----


def chunk_warning(comp, sampling) -> list:
    """A warning line (ours) where a text the AE objective trains on ends in a chunk with more memory slots than
    tokens, so it is compressed less than asked: ICAE's [BOS] + 64 tokens at --chunk-len 64 are cut 64 + 1, 32 slots,
    a measured 2x where 4x was asked; a text shorter than --mem gets --mem slots. The run says so in its first lines,
    with the longest such text as the example. ICAE's code counts the [BOS] too, and cuts no 1-token chunk: its
    window of model_max_length tokens holds the [BOS] (training_utils.py, pretrain_tokenize_function), and a context
    of L tokens is cut into ceil(L / (m * rate)) segments of equal length, m slots each (modeling_icae_multi_span.py,
    compute_num_segments and forward): [BOS] + 64 tokens at m 16, rate 4 are 33 + 32 tokens in 32 slots, 2x as
    well. Ours adds the [BOS] to --max-len text tokens, so one chunk is --chunk-len n + 1 (recipes/ladder.sh)."""
    if sampling.objective != "ae":
        return []
    bos = len(comp.context_bos)
    cuts = {n: comp.chunk_slots(n + bos) for n in range(sampling.min_len, sampling.max_len + 1)}
    short = [n for n, cut in cuts.items() if cut and cut[-1][1] > cut[-1][0]]   # the last chunk is the short one
    if not short:
        return []
    n, full = short[-1], comp.chunk_slots(comp.cfg.chunk_len)[0]
    cut = cuts[n]
    slots = sum(m for _, m in cut)
    return [f"warning: {len(short)} of the text lengths {sampling.min_len}-{sampling.max_len} end in a chunk with "
            f"more memory slots than tokens: a {n}-token text{' and its [BOS]' if bos else ''} "
            f"{'is cut into chunks of' if len(cut) > 1 else 'is one chunk of'} "
            f"{' + '.join(str(t) for t, _ in cut)} tokens with {slots} slots, {n / slots:.2f} text tokens per slot "
            f"where a full chunk gives {full[0] / full[1]:.2f}; --cap-mem gives a short chunk as many slots as tokens"
            + (f", --chunk-len {n + bos} keeps it one chunk" if len(cut) > 1 else "")]


def open_log(run: Run, method: str, corpus: data.Corpus, lines: list, changes: str, n_params: int):
    """log.jsonl (a resumed run rewrites the steps after its checkpoint), and the run's first lines: `lines`, every
    setting with its source and what the tiny demo changes (cli.first_lines), then what trains on what; changes: the
    compressor settings --objective changed on this preset ("" for none)."""
    os.makedirs(run.out, exist_ok=True)
    trim_log(os.path.join(run.out, "log.jsonl"), run.start)
    print("\n".join(lines))
    objective = run.sampling.objective
    read = f"{corpus.documents:,} documents" + (f", {corpus.questions:,} QA examples" if corpus.questions else "")
    note = f" (--objective {objective} on {method} also sets: {changes})" if changes else ""
    print(f"{method}: {objective} objective{note} on {read}, {n_params:,} trained parameters, batch "
          f"{run.sampling.batch_size} ({run.accum} x {run.micro} x {run.world}), |X| in [{run.sampling.min_len}, "
          f"{run.sampling.max_len}], lr {run.lr:g}, {run.schedule} after {run.warmup} warmup steps, steps "
          f"{run.start}->{run.steps} on {run.device}")
    return open(os.path.join(run.out, "log.jsonl"), "a")

# ---- the loop ----


def loop(run: Run, comp, step_module, opt, params, corpus: data.Corpus, check, log, write) -> int:
    """The training loop, from the run's start to its end (--steps, or --stop-after K): the step, its log row, the
    held-out check, a checkpoint on schedule (written by `write`, checkpoint.save_checkpoint with the run's record).
    Returns the last step done."""
    # Ctrl-C / SIGTERM: finish the step, save, stop (a second Ctrl-C stops at once)
    stop = {"signal": None}

    def on_signal(signum, frame):
        if stop["signal"] is not None:
            raise KeyboardInterrupt
        stop["signal"] = signal.Signals(signum).name
    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    end = run.end
    bar = tqdm(total=run.steps, initial=run.start, disable=not run.master, desc=comp.cfg.method, dynamic_ncols=True)
    try:
        if check and run.master and run.start == 0:
            held_out(run, comp, check, log, 0)   # at init: what an untrained memory carries
        for step in range(run.start, end):
            t0 = time.time()
            lr = lr_at(step, run.lr, run.warmup, run.steps, run.schedule)   # set by hand: a function of the step
            batches = micro_batches(run, comp, corpus, step)   # this process's share of the step's examples
            row = train_step(run, step_module, opt, params, batches, lr, step, stop)
            dt = time.time() - t0   # the whole step, its examples drawn included
            row.update(dt=dt, tokens_per_s=row["tokens"] / dt)
            if run.master:
                write_log(log, bar, row, run.steps, check and check.last)
            done = step + 1
            if check and run.master and (done % check.every == 0 or done == run.steps):
                held_out(run, comp, check, log, done)
            # save on schedule, at the end of this job, or when asked to stop: never after a bad step (train_step)
            if row["stop"] or done == end or done % run.save_every == 0 or (run.keep_every and
                                                                            done % run.keep_every == 0):
                save_run(run, comp, opt, corpus, done, write)
            if row["stop"]:
                end = done
                if run.master:
                    print(f"\nstopped by a signal after step {done}; continue with --resume {run.out}")
                break
    finally:
        bar.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
        if log:
            log.close()
    return end


def held_out(run: Run, comp, check, log, step: int):
    """The held-out check at `step` (heldout.run_check); one that cannot score ends the run with one line."""
    try:
        # eager under --compile: the check's passes (no gradient, greedy decoding on a growing cache) would each be a
        # graph of its own, compiled for a check that runs every --eval-every steps
        with torch.compiler.set_stance("force_eager"):
            run_check(comp, check, log, step, run.device, run.autocast)
    except ValueError as e:
        fail(e)


def lr_at(step, lr, warmup, steps, schedule):
    """Learning rate of step `step` (0-based): linear warmup to lr, then constant (EPL) or a linear (GMSA) or
    cosine decay to 0 at `steps`. A function of the step alone, so the step is the scheduler's whole state."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    done = (step - warmup) / max(1, steps - warmup)   # 0 -> 1 over the decay
    return lr * ((1 - done) if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * done)))


def train_step(run: Run, step_module, opt, params, batches: list, lr: float, step: int, stop: dict) -> dict:
    """One optimizer step at learning rate `lr`: forward and backward over this process's micro-batches
    (`batches`, micro_batches), clip, step. Returns the step's log row, with "stop" when any process was asked to
    stop (by now)."""
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)   # --mem-lr's group runs at its own peak
    with step_guard(run, step, batches):
        sums = 0.0   # the loss and its parts, added up on the device in fp64 (as Python adds floats): read once
        for m, batch in enumerate(batches):
            # the last micro-batch's backward syncs the step's gradients over the processes (DDP, FSDP); the ones
            # before it only accumulate theirs
            with nullcontext() if m == len(batches) - 1 else parallel.no_gradient_sync(step_module):
                if run.cuda_graphs:   # a new iteration of the CUDA graphs: their replays may overwrite the last one's
                    torch.compiler.cudagraph_mark_step_begin()   # outputs, which nothing reads any more
                with run.autocast:
                    loss, part = step_module(batch)   # TrainStep.forward: the objective's loss (below)
                # each loss is this micro-batch's share of the step's mean (step_normalizers): the gradients of the
                # shares add up to the step's, as if it had been one forward pass. DDP averages the processes'
                # gradients, so each process's share counts `world` times
                (loss * run.world).backward()
            sums = sums + torch.stack([loss.detach(), *part.values()]).double()
            names = list(part)
        grad_norm = parallel.clip_grad_norm(params, run.clip)
        tokens = sum(batch.tokens for batch in batches)
        # the processes' shares add up to the step's loss; every rank then decides alike (one read to the host)
        total, grad_norm, tokens, stopping, *parts = parallel.summed(torch.cat([
            sums[:1], grad_norm.double().view(1), torch.tensor([tokens, stop["signal"] is not None],
                                                                            dtype=torch.float64, device=sums.device),
            sums[1:]]), run.world)
        grad_norm /= run.world   # the same on every rank (the gradients were synced): summed, then the mean
        if not (math.isfinite(total) and math.isfinite(grad_norm)):
            raise FloatingPointError(f"loss {total} / grad-norm {grad_norm} at step {step + 1}")
    opt.step()
    opt.zero_grad(set_to_none=True)
    if run.device.type == "cuda":
        torch.cuda.synchronize()     # the loop's dt measures the step, not just its kernel launches
    return dict(step=step + 1, loss=total, lr=lr, grad_norm=grad_norm, tokens=int(tokens),
                **dict(zip(names, parts)), stop=bool(stopping))


def micro_batches(run: Run, comp, corpus: data.Corpus, step: int) -> list:
    """This process's micro-batches of step `step`: a slice each of the step's examples (data.step_examples), with
    the whole step's normaliser, so that the shares of every micro-batch and process add up to the step's mean."""
    examples = data.step_examples(corpus.tensors, run.sampling, comp, step)
    norm = data.step_normalizers(comp, run.sampling.objective, examples)
    batches = []
    for m in range(run.accum):
        first = (m * run.world + run.rank) * run.micro   # this rank's slice of the step's examples
        batch = data.collate(examples[first:first + run.micro])
        batch.norm = norm
        if run.sampling.objective == "distill":   # the frozen LLM answers first (once per example, cached), eager
            with torch.compiler.set_stance("force_eager"):   # (as the held-out check: greedy decoding, no gradient)
                data.add_teacher_answers(comp, batch, corpus.answers, run.answer_tokens, run.autocast)
        batch.inputs = step_inputs(comp, run.sampling.objective, batch, run.device)
        batches.append(batch)
    return batches


@contextmanager
def step_guard(run: Run, step: int, batches: list):
    """A step that runs out of memory, ends with a non-finite loss or gradient norm (FloatingPointError), or draws a
    batch the settings cannot train on (UnpairedMemory), ends the run with one line, before any optimizer step or
    save: the last checkpoint in --out stays the last good state."""
    kept = f"the last good checkpoint in {run.out} is kept"
    try:
        yield
    except FloatingPointError as e:
        fail(f"{e}: stopping; {kept}")
    except compressors.UnpairedMemory as e:   # a batch --own-other-weight cannot pair (Memory.neighbours)
        fail(f"step {step + 1}: {e}; {kept}")
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        largest = max(batches, key=lambda b: b.tokens)
        fail(f"out of memory at step {step + 1} on {run.device} with a micro-batch of {run.micro} "
             f"({data.batch_shape(largest)}): use --micro-batch {max(1, run.micro // 2)}"
             f"{'' if run.grad_ckpt else ' or --grad-ckpt'}; {kept}")

# ---- the objectives ----
# Each loss is this micro-batch's share of the step's loss: its summed NLL over the step's normaliser batch.norm
# (data.step_normalizers), so that the shares of every micro-batch and process add up to the step's mean.


def step_inputs(comp, objective: str, batch: data.Batch, device) -> dict:
    """What the objective's forward reads that the batch's Python lists decide (ids, positions, masks, where memory is
    read and loss taken: compressors.EncoderInputs, DecoderInputs, DistillInputs), built on the host and moved to
    `device` before the step's first kernel, so that its forward and backward never wait for a copy."""
    if objective == "distill":
        inputs = {"distill": comp.distill_inputs(batch.context, batch.question, batch.answer, batch.prefix,
                                                 batch.dec_context)}
    else:
        context = comp.encoder_inputs(batch.context, batch.ratios)   # ONE compression serves every task
        inputs = {"context": context}
        if objective in ("pretrain", "ae"):   # AE / TR, PIC Eq. (6): x_1..x_p, EOS
            inputs["ae"] = compressors.decoder_inputs(comp, context, "ae", batch.ae)
        if objective == "pretrain":           # LM / TC, PIC Eq. (7): x_p+1.., EOS, after x_p
            inputs["lm"] = compressors.decoder_inputs(comp, context, "lm", batch.lm, last_tokens=batch.last)
        if objective == "qa":                 # the loss on the answer and EOS only
            inputs["qa"] = compressors.decoder_inputs(comp, context, "qa", batch.qa, batch.n_answer, prefix=batch.prefix)
    return {task: compressors.on_device(part, device) for task, part in inputs.items()}


def inputs_of(comp, objective: str, batch: data.Batch) -> dict:
    """batch.inputs (micro_batches builds them before the step), or, for a batch made elsewhere (plan.py's example,
    a test's), built now."""
    return batch.inputs if batch.inputs is not None else step_inputs(comp, objective, batch, comp.device)


class TrainStep(nn.Module):
    """The objective as a module's forward(), so DistributedDataParallel and FSDP can sync what it computes."""

    def __init__(self, comp, objective, lm_weight, own_other_weight=0.0):
        super().__init__()
        self.comp, self.objective, self.lm_weight = comp, objective, lm_weight
        self.own_other_weight = own_other_weight   # --own-other-weight (ours), ae only; 0: off

    def forward(self, batch):
        if self.objective == "pretrain":
            return loss_pretrain(self.comp, batch, self.lm_weight)
        if self.objective == "ae" and self.own_other_weight:
            return loss_ae_own_other(self.comp, batch, self.own_other_weight)
        return {"ae": loss_ae, "qa": loss_qa, "distill": loss_distill}[self.objective](self.comp, batch)


def loss_pretrain(comp, batch: data.Batch, lm_weight):
    """EPL §3.1.1 / PIC Eq. (6)-(8): ONE compression of x_1..x_p serves both tasks."""
    inputs = inputs_of(comp, "pretrain", batch)
    memory = comp.encode(inputs["context"])
    # AE / TR, PIC Eq. (6): x_1..x_p, EOS; LM / TC, PIC Eq. (7): x_p+1.., EOS
    l_ae, _ = comp.loss(memory, inputs["ae"], normalize_by=batch.norm["ae"])
    l_lm, _ = comp.loss(memory, inputs["lm"], normalize_by=batch.norm["lm"])
    return lm_weight * l_lm + (1 - lm_weight) * l_ae, {"ae": l_ae, "lm": l_lm}   # PIC Eq. (8), λ = α = 0.5


def loss_ae(comp, batch: data.Batch):
    """ICAE autoencoding / AOC Eq. (4) / GMSA §3.4 stage 1: regenerate the compressed text from the memory
    (500x/AOC after [BOS], ICAE/GMSA after [AE]: the compressor's ae_token)."""
    inputs = inputs_of(comp, "ae", batch)
    l_ae, _ = comp.loss(comp.encode(inputs["context"]), inputs["ae"], normalize_by=batch.norm["ae"])
    return l_ae, {"ae": l_ae}


def loss_ae_own_other(comp, batch: data.Batch, weight: float):
    """Ours (--own-other-weight W): loss_ae's AE loss plus W x the own/other term (own_vs_other)."""
    inputs = inputs_of(comp, "ae", batch)
    l_ae, term = own_vs_other(comp, comp.encode(inputs["context"]), inputs["ae"], batch.norm)
    return l_ae + weight * term, {"ae": l_ae, "own_vs_other": term}


def own_vs_other(comp, memory, inputs, norm: dict):
    """Ours (--own-other-weight), a lever against the embedding carrier's collapse, where the encoder writes nearly
    one memory for every text (held-out own/other ~1): the AE loss, and beside it

        L_oo = (1/N) Σ_b softplus(ℓ_b(own) − ℓ_b(other)),

    ℓ_b(m) the mean NLL of text b's AE tokens with memory m, its own or its neighbour's (Memory.neighbours: texts
    1-2, 3-4, ... trade memories), N the step's texts. A two-way logistic loss that the decoder tell its own memory
    from another's: log 2 (0.693) when the two are alike, falling to 0 as the own one wins, its push fading as it
    does (a hinge would need a margin, a ratio could push `other` up without end). Each text's term over the whole
    step's count (norm["texts"]), and pairs that a micro-batch of any even size holds whole, so the shares of every
    micro-batch and process add up to the step's value, as the AE loss's do. The AE loss comes from the same pass
    (own's per-token NLL summed over norm["ae"]), so the term costs one more decoder pass, no more encoding."""
    own, row = comp.token_nll(memory, inputs)                 # (N_tok,), (N_tok,): the AE loss's own tokens ...
    other, _ = comp.token_nll(memory.neighbours(), inputs)    # ... each read with the neighbour's memory
    B = inputs.index.shape[0]
    count = torch.zeros(B, device=own.device).index_add_(0, row, torch.ones_like(own))   # each text's tokens (>= 1)
    mean = lambda nll: torch.zeros(B, device=nll.device).index_add(0, row, nll) / count  # (B,) ℓ_b
    return own.sum() / norm["ae"], nn.functional.softplus(mean(own) - mean(other)).sum() / norm["texts"]


def loss_qa(comp, batch: data.Batch):
    """QA fine-tuning (EPL §4, GMSA KEFT Eq. 8): [memory; [LM]; question] -> answer, loss on answer + EOS only."""
    inputs = inputs_of(comp, "qa", batch)
    l_qa, _ = comp.loss(comp.encode(inputs["context"]), inputs["qa"], normalize_by=batch.norm["qa"])
    return l_qa, {"qa": l_qa}


def loss_distill(comp, batch: data.Batch):
    """CompLLM Eq. (1)-(3): Σ_ℓ SmoothL1(H̃_ℓ, H_ℓ) / σ_ℓ over the answer tokens, teacher = the LLM with the
    full context, student = the LLM with the concept embeddings."""
    l, _ = comp.distill(inputs_of(comp, "distill", batch)["distill"], normalize_by=batch.norm["distill"])
    return l, {"distill": l}


# ---- checkpoints ----


def save_run(run: Run, comp, opt, corpus: data.Corpus, done: int, write):
    """A checkpoint of step `done` (every rank hands rank 0 its RNG state; under FSDP every rank writes its shard and
    rank 0 the rest, with `write`: checkpoint.save_checkpoint, the run's record bound to it by main)."""
    rng = gather_rng_states(run.world, run.device)
    if run.master or run.fsdp:
        write(run.out, done, comp, opt, rng=rng, data_key=corpus.key, keep_every=run.keep_every, sharded=run.fsdp,
              master=run.master)
    if run.master and corpus.answers:   # distill: the teacher's answers so far
        data.save_answers(corpus)


def load_corpus(run: Run, comp, path: str | None, cache_dir: str, saved_key: str | None, resume: str | None):
    """The run's corpus (data.load_corpus); a resumed run's must be the one it was trained on: saved_key, the data key
    its checkpoint holds (None: a checkpoint without one, which resumes on any corpus)."""
    try:   # a missing path, a malformed record, data the objective cannot use: one line
        corpus = data.load_corpus(path, run.sampling, comp, cache_dir, run.answer_tokens)
    except (ValueError, OSError) as e:
        fail(e)
    if saved_key not in (None, corpus.key):
        fail(f"cannot resume: {resume} was trained on another corpus than {path or 'the built-in corpus'} is now "
             f"(data key {saved_key}, now {corpus.key}): resume it on the data it was trained on, or start a new run "
             "with another --out")
    return corpus


def restore(run: Run, comp, opt, ckpt: str, state: dict):
    """A resumed run's trained tensors (from a sharded checkpoint; a one-process one's were loaded at the build),
    optimizer moments and step counts, and this rank's RNG where it stood. A sharded checkpoint (DCP) loads resharded,
    whatever number of processes saved it; a one-process one's moments are cut into this rank's shards under FSDP.
    Saved on another number of processes, no rank's saved generator is this rank's: each keeps what a fresh run of
    this size draws (--seed + rank, after the build), and the run says so."""
    try:
        if state.get("sharded"):
            checkpoint.load_sharded(comp, opt, os.path.join(ckpt, checkpoint.SHARDED))
        else:
            optimizer_state = state["optimizer"]
            if run.fsdp:   # the one-process moments, cut into this rank's shards
                optimizer_state = parallel.shard_optimizer_state(opt, optimizer_state)
            opt.load_state_dict(optimizer_state)
    except (ValueError, KeyError) as e:
        fail(f"mismatched checkpoint: its optimizer state does not fit this compressor ({e})")
    rng_states = state["rng"]
    if len(rng_states) == run.world:
        set_rng_state(rng_states[run.rank], run.device)
    elif run.master:
        print(f"saved on {len(rng_states)} process(es), resumed on {run.world}: each process draws from its "
              f"generator as a fresh run of {run.world} would (--seed + rank), not where the saved ones stood")


# ---- main ----


def main(argv=None):
    s = cli.parse_args(argv)   # every setting, resolved once, with its source
    step_of = partial(TrainStep, objective=s.objective, lm_weight=s.lm_weight,   # comp -> the objective as a module
                      own_other_weight=s.own_other_weight)
    if s.plan:   # what the run would need, built on the meta device: nothing is allocated or written
        try:
            return plan.show(s.config, cli.planned(s), step_of, s.shape, s.frozen_dtype)
        except OSError as e:   # a --model that is no local folder
            fail(e)
    if not s.resume and latest_checkpoint(s.out, required=False):
        fail(f"{s.out} already holds a checkpoint: continue it with --resume {s.out}, or pick another --out")
    with ExitStack() as group:
        try:   # torchrun's processes, or this one
            device, rank, world = group.enter_context(parallel.processes(s.device, s.fsdp))
        except ValueError as e:
            fail(e)
        run = cli.place(s, device, rank, world)   # the batch split over the processes, the dtypes, the seed
        # torch's RNG draws the init of memory tokens / LoRA / bridges, from --seed on every process (each draws
        # what rank 0 draws: under FSDP each keeps its slices of it, and DDP's copy of rank 0's weights changes
        # nothing), then LoRA dropout, one stream per process (--seed + rank after the build); the data, GMSA's rates
        # included, has generators of its own (step_examples), so torch's is the only global generator a run draws from
        torch.manual_seed(s.seed)
        if run.start >= run.steps:
            print(f"{s.resume} is already at step {run.start} of {run.steps}: nothing to do (raise --steps)")
            return parallel.leave_rank()
        # the compressor, and the objective as a module, wrapped for the processes. Under --fsdp it is built on the
        # meta device (no storage), sharded, and each rank then fills only its own slices (parallel.materialise): no
        # rank ever holds the whole model
        state = s.resume_state or {}
        # a sharded checkpoint's trained tensors load after the optimizer is made, with its moments (restore)
        weights = None if state.get("sharded") else s.weights
        try:   # a bad model name: one line, not a traceback
            comp = build_compressor(s.config, torch.device("meta") if run.fsdp else device, run.frozen, weights,
                                    s.weights_config)
        except (ValueError, OSError) as e:
            fail(e)
        for model in (comp.encoder, comp.decoder):   # activation checkpointing per block (model.py)
            model.grad_ckpt = run.grad_ckpt
        if s.compile:
            compile_models(comp, s.cuda_graphs)
        step_module = parallel.wrap(comp, step_of(comp), run.fsdp, device, world, bf16=run.bf16)
        try:   # the trained tensors it starts from (--init, a one-process checkpoint, --warm-start), one at a time
            if run.fsdp:   # the base from its files, the trained init drawn from --seed as one process draws it
                parallel.materialise(step_module, comp, device, run.frozen)
            if weights:
                checkpoint.load_trained_from(comp, weights, s.weights_config)
            elif s.warm_start:
                warm_start(comp, s.warm_start)
        except (ValueError, OSError) as e:   # a corrupt checkpoint, one that does not fit: one line
            fail(e)
        if run.rank:   # (rank 0 continues from the build, as a run of one process does)
            torch.manual_seed(run.seed)
        corpus = load_corpus(run, comp, s.data, s.cache_dir, state.get("data"), s.resume)
        params = comp.trainable_parameters()   # what compressors.py leaves trainable for this method and stage
        opt = make_optimizer(comp, s.lr, s.betas, s.weight_decay, s.mem_lr, device, capturable=s.cuda_graphs)
        if state:
            restore(run, comp, opt, s.weights, state)
        lines = cli.first_lines(s.method, s.shown) + chunk_warning(comp, run.sampling)
        log = open_log(run, s.method, corpus, lines, s.changes, sum(p.numel() for p in params)) if run.master else None
        if run.fsdp and s.eval_every > 0 and run.master:   # rank 0 alone would score weights spread over every rank
            print("no held-out check runs under --fsdp: score a checkpoint with evaluate.py --ckpt")
        try:
            check = prepare(comp, run.eval_every, run.sampling.objective, run.sampling.crop, run.sampling.min_len,
                            run.sampling.max_len, run.warmup, s.eval_data, s.eval_n, s.eval_bleu, s.builtin_check,
                            run.out, run.start > 0, run.master) if run.eval_every > 0 else None
        except ValueError as e:
            fail(e)
        end = loop(run, comp, step_module, opt, params, corpus, check, log, partial(save_checkpoint, record=s.record))
        if run.master and check and check.rows:
            print(first_carrying_step(check))
        if run.master and end == run.steps:
            print(f"done: {run.steps} steps; the compressor is in {run.out} (checkpoint.load, evaluate.py --ckpt)")
        elif run.master and end == s.stop_after:
            print(f"stopped after step {end} (--stop-after); continue with --resume {run.out}")
        parallel.leave_rank()   # here, while the model, optimizer and data are still alive


if __name__ == "__main__":
    main()
