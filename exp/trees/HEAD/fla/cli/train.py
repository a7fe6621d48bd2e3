"""``python -m fla train``: train a small language model on the corpus shipped in the
package, one process or ``torchrun --nproc_per_node=N`` (FSDP2).

With no arguments: a tiny Gated DeltaNet (~0.5M parameters) on Shakespeare, byte-level,
sized to finish in a few minutes on a 2-core CPU (the PyTorch path of the ops); on a GPU
the same run uses the Triton kernels, bf16 autocast and the fused cross-entropy.

Output directory (``--out``, default ``runs/<model>``):

* ``checkpoint/``: ``save_pretrained`` files (config.json, model.safetensors) plus
  ``trainer_state.pt`` (optimizer, step, loss history) and ``fla_train.json`` (the
  tokenizer and the run's settings), written atomically (a temporary directory renamed
  into place), at every ``--save-every`` steps, at the end and on Ctrl-C;
* ``loss_curve.png``: training and validation loss (bits per byte) against tokens seen,
  with the unigram baseline;
* ``metrics.jsonl``: one line per logged step and per evaluation.

``--resume`` continues from ``<out>/checkpoint`` (or ``--resume DIR``): same model, same
optimizer state, same data order (each step's batch is a function of the step).

Ctrl-C (SIGINT) or SIGTERM: the current step finishes, a checkpoint is saved and the
process exits with 130; a second Ctrl-C aborts at once.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from fla.cli import CLIError, choose_device

CHECKPOINT = "checkpoint"
TRAINER_STATE = "trainer_state.pt"
RUN_INFO = "fla_train.json"

# The default run (measured on a 2-core CPU: see README, "The main job").
DEFAULTS = dict(model="gated_deltanet", size="tiny", seq_len=128, batch_size=16,
                max_steps=300, lr=3e-3, warmup=30, eval_every=50, eval_batches=8)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a small model on the bundled corpus",
                       description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULTS["model"],
                   help="architecture: gated_deltanet, delta_net, retnet, gla, rwkv6, rwkv7, "
                        "mamba2 or transformer")
    g.add_argument("--size", default=DEFAULTS["size"], choices=("tiny", "small", "340m"),
                   help="preset width/depth (overridden by the three options below)")
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--layers", type=int, default=None, help="number of blocks")
    g.add_argument("--head-dim", type=int, default=None, help="head width")
    g.add_argument("--fuse-linear-ce", action="store_true",
                   help="fuse the head and the loss (never materialise the logits)")
    g = p.add_argument_group("data")
    g.add_argument("--corpus", default=None,
                   help="a text file (plain or .gz) instead of the bundled Shakespeare")
    g.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"], help="tokens per window")
    g.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"],
                   help="global batch (windows per step, over all processes)")
    g.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per step (same global batch, less memory)")
    g.add_argument("--val-fraction", type=float, default=0.04)
    g = p.add_argument_group("optimisation")
    g.add_argument("--max-steps", type=int, default=DEFAULTS["max_steps"])
    g.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="stop (and save) at this step, keeping the --max-steps schedule; "
                        "--resume continues")
    g.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="cosine decay to this fraction of --lr")
    g.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("evaluation, checkpoints, output")
    g.add_argument("--eval-every", type=int, default=DEFAULTS["eval_every"])
    g.add_argument("--eval-batches", type=int, default=DEFAULTS["eval_batches"],
                   help="validation batches per evaluation (0: the whole split)")
    g.add_argument("--save-every", type=int, default=None,
                   help="checkpoint every N steps (default: at each evaluation)")
    g.add_argument("--log-every", type=int, default=None,
                   help="steps between loss logs (default 1 on CPU, 10 on GPU)")
    g.add_argument("--out", default=None, help="output directory (default runs/<model>)")
    g.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                   help="continue from DIR (default <out>/checkpoint)")
    g.add_argument("--no-plot", action="store_true", help="skip loss_curve.png")
    g.add_argument("--sample-tokens", type=int, default=200,
                   help="bytes of text to sample at the end (0: none)")
    g = p.add_argument_group("device")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: all cores but one; "
                        "torch's own default on a GPU)")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="auto: bf16 on CUDA, float32 on CPU")
    return p


# ----------------------------------------------------------------------------- helpers

def _check_args(args) -> None:
    positive = ["seq_len", "batch_size", "grad_accum", "max_steps", "eval_every"]
    for name in positive:
        value = getattr(args, name)
        if value < 1:
            raise CLIError(f"--{name.replace('_', '-')}: expected a positive integer, "
                           f"got {value}")
    for name in ("hidden_size", "layers", "head_dim", "save_every", "log_every", "threads",
                 "stop_at"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')}: expected a positive integer, "
                           f"got {value}")
    if not 0 < args.val_fraction < 0.5:
        raise CLIError(f"--val-fraction: expected a value in (0, 0.5), got {args.val_fraction}")
    if not args.lr > 0:
        raise CLIError(f"--lr: expected a positive value, got {args.lr}")
    if args.warmup < 0 or args.eval_batches < 0 or args.sample_tokens < 0:
        raise CLIError("--warmup, --eval-batches and --sample-tokens must be >= 0")


def _lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    span = max(1, args.max_steps - args.warmup)
    progress = min(1.0, (step - args.warmup) / span)
    floor = args.lr * args.min_lr_ratio
    return floor + (args.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class StopFlag:
    """First SIGINT/SIGTERM: ask the loop to stop after the current step (and save);
    the second SIGINT raises KeyboardInterrupt as usual."""

    def __init__(self, say):
        self.requested = False
        self.say = say
        self._old = {}

    def __enter__(self):
        import threading
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.say(f"\n{signal.Signals(signum).name}: finishing this step, then saving a "
                 f"checkpoint (Ctrl-C again to abort without saving)")

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def quiet_transformers() -> None:
    """No "Loading weights" / "Writing model shards" bars between ours."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def find_checkpoint(path: str | Path) -> Path:
    """The directory holding config.json: ``path`` itself or ``path/checkpoint``.
    CLIError when neither is there."""
    path = Path(path)
    if not path.exists():
        raise CLIError(f"checkpoint directory {str(path)!r} not found")
    if not path.is_dir():
        raise CLIError(f"{str(path)!r} is not a directory (expected a checkpoint "
                       f"directory or a training output directory)")
    for candidate in (path, path / CHECKPOINT):
        if (candidate / "config.json").is_file():
            return candidate
    raise CLIError(f"{str(path)!r} holds no checkpoint: neither {str(path / 'config.json')!r} "
                   f"nor {str(path / CHECKPOINT / 'config.json')!r} exists")


def read_config(ckpt: Path):
    """The checkpoint's config, validated: CLIError for invalid JSON, a missing or
    unknown model_type, or values the config class refuses."""
    from fla.cli import models

    path = ckpt / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"cannot read {str(path)!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise CLIError(f"{str(path)!r} is corrupt: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CLIError(f"{str(path)!r} is corrupt: expected a JSON object, got "
                       f"{type(raw).__name__}")
    model_type = raw.get("model_type")
    if not model_type:
        raise CLIError(f"{str(path)!r} has no 'model_type'")
    try:
        _, config_cls = models.resolve(model_type)
    except models.UnknownModel as exc:
        raise CLIError(f"{str(path)!r}: {exc}") from None
    try:
        return config_cls.from_pretrained(str(ckpt))
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise CLIError(f"{str(path)!r} is not a valid {model_type} config: {exc}") from None


def load_model(ckpt: Path, config):
    """The causal-LM from a checkpoint directory (CLIError when the weights are missing
    or do not fit the config)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(ckpt), config=config)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CLIError(f"cannot load the weights in {str(ckpt)!r}: {msg}") from None


def _fix_architectures(ckpt: Path, name: str) -> None:
    """FSDP2 renames the wrapped class (FSDP<Name>); config.json must name the model."""
    path = ckpt / "config.json"
    data = json.loads(path.read_text())
    if data.get("architectures") != [name]:
        data["architectures"] = [name]
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------- run

def run(args) -> int:
    import torch

    _check_args(args)
    from fla.cli import data, distributed, models
    quiet_transformers()

    device_kind = choose_device(args.device)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device_kind == "cuda" else "float32"
    if dtype == "bfloat16" and device_kind != "cuda":
        raise CLIError("--dtype bfloat16 is a CUDA option (bf16 autocast of the Triton "
                       "kernels); on the CPU train in float32 (--dtype float32)")
    if args.fuse_linear_ce and device_kind != "cuda":
        raise CLIError("--fuse-linear-ce is a CUDA option (a Triton kernel); on the CPU "
                       "leave it off")
    bf16 = dtype == "bfloat16"

    # Resolve the model name before anything slow, so that a typo fails at once.
    resume_dir = None
    model_type = config_cls = None
    out = Path(args.out) if args.out else None
    if args.resume is not None:
        if args.resume == "" and out is None:
            out = Path("runs") / models.ALIASES.get(args.model, args.model)
        resume_dir = find_checkpoint(args.resume if args.resume else out)
        if out is None:     # --resume DIR: keep writing where that run wrote
            out = resume_dir.parent if resume_dir.name == CHECKPOINT else resume_dir
    else:
        try:
            model_type, config_cls = models.resolve(args.model)
        except models.UnknownModel as exc:
            raise CLIError(f"--model: {exc}") from None
        out = out or Path("runs") / model_type

    if args.threads:
        torch.set_num_threads(args.threads)
    elif device_kind == "cpu":
        # One core left free: on a 2-core machine two busy OpenMP threads stall each
        # other (and anything else running) for far less than a 2x gain at these sizes.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    d = distributed.setup(device_kind)
    try:
        return _train(args, d, device_kind, bf16, out, resume_dir, model_type, config_cls)
    finally:
        d.close()


def _train(args, d, device_kind, bf16, out, resume_dir, model_type, config_cls) -> int:
    import torch

    from fla.cli import data, distributed, models

    say = (lambda *a, **k: print(*a, **k, flush=True)) if d.main else (lambda *a, **k: None)
    device = distributed.device_for(d, device_kind)
    tokenizer = data.ByteTokenizer()
    torch.manual_seed(args.seed)

    # ---- model
    state = None
    if resume_dir is not None:
        config = read_config(resume_dir)
        if getattr(config, "vocab_size", None) != tokenizer.model_vocab_size:
            raise CLIError(f"{str(resume_dir)!r}: vocab_size {config.vocab_size} is not the "
                           f"byte vocabulary ({tokenizer.model_vocab_size}): not a "
                           f"checkpoint of `fla train`")
        state_path = resume_dir / TRAINER_STATE
        if not state_path.is_file():
            raise CLIError(f"{str(resume_dir)!r} has no {TRAINER_STATE}: it cannot be "
                           f"resumed (it can still be used by `generate`)")
        try:
            state = torch.load(state_path, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure: corrupt file
            raise CLIError(f"cannot read {str(state_path)!r}: {exc}") from None
        model = load_model(resume_dir, config)
        model_type = config.model_type
        say(f"resuming {model_type} from {resume_dir} at step {state['step']}")
    else:
        size = models.SIZES[args.size]
        hidden = args.hidden_size or size.hidden_size
        layers = args.layers or size.num_hidden_layers
        head_dim = args.head_dim or size.head_dim
        try:
            config = models.build_config(
                config_cls, model_type, vocab_size=tokenizer.model_vocab_size,
                hidden_size=hidden, num_hidden_layers=layers, head_dim=head_dim,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                fuse_cross_entropy=device_kind == "cuda",
                fuse_linear_cross_entropy=args.fuse_linear_ce,
                max_position_embeddings=max(2048, args.seq_len),
                intermediate_size=size.intermediate_size if args.hidden_size is None else None)
        except (ValueError, TypeError) as exc:
            raise CLIError(f"cannot build a {model_type} of hidden size {hidden}, "
                           f"{layers} layers, head width {head_dim}: {exc}") from None
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_config(config)
    config.fuse_cross_entropy = device_kind == "cuda"
    n_params = sum(p.numel() for p in model.parameters())
    model.to(device)
    causal_lm_name = type(model).__name__

    # ---- data
    try:
        corpus = data.read_corpus(args.corpus)
        splits = data.split(corpus, args.val_fraction, args.seq_len)
        sampler = data.WindowSampler(splits.train, args.seq_len, args.batch_size,
                                     args.seed, d.rank, d.world)
    except (data.CorpusError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    local_batch = args.batch_size // d.world
    if local_batch % args.grad_accum:
        raise CLIError(f"--grad-accum {args.grad_accum} does not divide the per-process "
                       f"batch {local_batch}")
    val = data.eval_batches(splits.val, args.seq_len, args.batch_size, args.eval_batches,
                            d.rank, d.world)
    baseline = splits.unigram_bits_per_byte()

    # ---- parallelism, precision, optimiser
    if d.launched:
        distributed.shard(model, d)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device_kind == "cuda")
    step, tokens, history = 0, 0, []
    if state is not None:
        distributed.load_optimizer_state(model, optimizer, state["optimizer"], d)
        step, tokens, history = state["step"], state["tokens"], state["history"]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if bf16
                else torch.autocast(device_kind, enabled=False))
    tokens_per_step = args.batch_size * args.seq_len
    log_every = args.log_every or (1 if device_kind == "cpu" else 10)
    save_every = args.save_every or args.eval_every

    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        if resume_dir is None and (out / CHECKPOINT).exists():
            say(f"note: {out / CHECKPOINT} exists and will be replaced (use --resume to "
                f"continue it)")
        if resume_dir is None:
            (out / "metrics.jsonl").unlink(missing_ok=True)
    where = (f"{d.world} processes, FSDP2 ({d.backend})" if d.launched else
             f"{device_kind}" + (f" ({torch.cuda.get_device_name(device)})"
                                 if device_kind == "cuda" else f", {torch.get_num_threads()} threads"))
    say(f"{model_type}: {n_params / 1e6:.2f}M parameters, hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layers | {where} | "
        f"{'bf16' if bf16 else 'float32'}{', Triton kernels' if device_kind == 'cuda' else ', PyTorch path'}")
    say(f"data: {len(splits.train) / 1e6:.2f}M training bytes, {len(splits.val) / 1e3:.0f}k "
        f"validation bytes; batch {args.batch_size} x {args.seq_len} tokens; "
        f"{args.max_steps} steps ({args.max_steps * tokens_per_step / 1e6:.2f}M tokens, "
        f"{sampler.epoch_of(args.max_steps):.2f} epochs); unigram baseline "
        f"{baseline:.2f} bits/byte")

    def log_row(row: dict) -> None:
        history.append(row)
        if d.main:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    def evaluate() -> float:
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)
        with torch.no_grad(), autocast:
            for x in val:
                x = x.to(device)
                total[0] += model(input_ids=x, labels=x).loss.double()
                total[1] += 1
        model.train()
        d.all_reduce_sum(total)
        return float(total[0] / total[1])

    def save(reason: str) -> Path:
        msd = distributed.model_state(model, d)
        osd = distributed.optimizer_state(model, optimizer, d)
        final = out / CHECKPOINT
        if d.main:
            tmp = out / (CHECKPOINT + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            model.save_pretrained(str(tmp), state_dict=msd)
            _fix_architectures(tmp, causal_lm_name)
            torch.save({"optimizer": osd, "step": step, "tokens": tokens,
                        "history": history}, tmp / TRAINER_STATE)
            info = {"tokenizer": tokenizer.to_dict(), "step": step, "tokens": tokens,
                    "reason": reason, "model": model_type,
                    "args": {k: v for k, v in vars(args).items() if k != "func"}}
            (tmp / RUN_INFO).write_text(json.dumps(info, indent=2) + "\n")
            old = out / (CHECKPOINT + ".old")
            shutil.rmtree(old, ignore_errors=True)
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        d.barrier()
        return final

    def plot() -> Path | None:
        if args.no_plot or not d.main:
            return None
        try:
            from fla.cli.plot import loss_curve
        except ImportError:
            say("note: matplotlib is not installed: no loss_curve.png")
            return None
        return loss_curve(history, out / "loss_curve.png", baseline_bits=baseline,
                          title=f"{model_type}, {n_params / 1e6:.2f}M parameters, "
                                f"{args.seq_len}-byte windows")

    # ---- the loop
    from tqdm.auto import tqdm

    interrupted = False
    last_val = None
    run_start = time.perf_counter()
    run_tokens0 = tokens
    model.train()
    with StopFlag(say if d.main else (lambda *_: None)) as stop:
        bar = tqdm(total=args.max_steps, initial=step, disable=not d.main, unit="step",
                   dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
        window = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, steps
        t_last, tok_last = time.perf_counter(), tokens
        end = min(args.max_steps, args.stop_at or args.max_steps)
        while step < end:
            lr = _lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = sampler.batch(step).to(device, non_blocking=True)
            for micro in batch.chunk(args.grad_accum):
                with autocast:
                    loss = model(input_ids=micro, labels=micro).loss / args.grad_accum
                loss.backward()
                window[0] += loss.detach().double()
            distributed.clip_grad_norm(model, args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += tokens_per_step
            window[1] += 1
            bar.update(1)
            # Ranks agree on stopping at the log steps (a collective); alone, at once.
            if step % log_every == 0 or step == end or \
                    (stop.requested and not d.launched):
                flag = torch.tensor([float(stop.requested)], dtype=torch.float64,
                                    device=device)
                stats = d.all_reduce_sum(torch.cat([window, flag]))
                avg = float(stats[0] / stats[1])
                now = time.perf_counter()
                tok_s = (tokens - tok_last) / max(now - t_last, 1e-9)
                t_last, tok_last = now, tokens
                log_row({"step": step, "tokens": tokens, "loss": avg, "lr": lr,
                         "tok_per_s": tok_s})
                bar.set_postfix_str(f"loss {avg:.3f} ({avg / math.log(2):.2f} bits/byte), "
                                    f"{tok_s:,.0f} tok/s", refresh=False)
                window.zero_()
                if stats[2] > 0:
                    interrupted = True
                    break
            if step % args.eval_every == 0 or step == end:
                last_val = evaluate()
                log_row({"step": step, "tokens": tokens, "val_loss": last_val})
                bar.write(f"step {step}: validation loss {last_val:.3f} "
                          f"({data.bits_per_byte(last_val):.2f} bits/byte; unigram "
                          f"{baseline:.2f})") if d.main else None
                t_last = time.perf_counter()
            if step % save_every == 0 and step < end:
                save("periodic")
                t_last = time.perf_counter()
        bar.close()
        elapsed = time.perf_counter() - run_start
        if interrupted:
            path = save("interrupted")
            plot()
            say(f"interrupted at step {step}: checkpoint saved in {path}\n"
                f"resume with: python -m fla train --out {out} --resume")
            return 130
        path = save("final")
    png = plot()
    if last_val is None:
        last_val = evaluate()
    bpb = data.bits_per_byte(last_val)
    trained = tokens - run_tokens0
    say(f"\ntrained to step {step} in {elapsed:.0f} s ({trained / max(elapsed, 1e-9):,.0f} "
        f"tokens/s over {trained / 1e6:.2f}M tokens)")
    verdict = (f"{100 * (1 - bpb / baseline):.0f}% below it" if bpb < baseline
               else "not below it yet")
    say(f"final validation loss: {last_val:.3f} nats/token = {bpb:.2f} bits/byte; unigram "
        f"baseline {baseline:.2f} bits/byte: {verdict}")
    say(f"checkpoint: {path}" + (f"\nloss curve: {png}" if png else ""))
    if args.sample_tokens and not d.launched:
        from fla.cli.generate import stream
        prompt = "ROMEO:\n"
        say(f"\nsample ({args.sample_tokens} bytes, temperature 0.8, prompt {prompt!r}):")
        model.eval()
        with autocast:
            stream(model, tokenizer, prompt, args.sample_tokens, temperature=0.8, top_k=0,
                   seed=args.seed, write=lambda s: print(s, end="", flush=True))
        print(flush=True)
    say(f"\nnext: python -m fla generate --checkpoint {out} --prompt \"ROMEO:\"")
    return 0
