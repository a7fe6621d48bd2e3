"""``python -m fla generate --checkpoint DIR --prompt "..."``: stream text from a trained
model, one token at a time through the model's recurrent cache.

``DIR`` is a training output directory (``runs/gated_deltanet``) or a checkpoint
directory (``runs/gated_deltanet/checkpoint``, or any ``save_pretrained`` directory of an
fla model with the byte vocabulary). Greedy by default; ``--temperature`` > 0 samples,
``--top-k`` keeps the k likeliest tokens.
"""
from __future__ import annotations

import argparse
import sys

from fla.cli import CLIError, choose_device


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="stream text from a checkpoint",
                       description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="training output directory or checkpoint directory")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=300, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; > 0: sample from softmax(logits / temperature)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: fresh)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    return p


def stream(model, tokenizer, prompt: str, max_new_tokens: int, *, temperature: float = 0.0,
           top_k: int = 0, seed: int | None = None, write=None) -> list[int]:
    """Generate ``max_new_tokens`` tokens after ``prompt``, calling ``write(text)`` as
    each complete character arrives. The prompt runs once (chunked kernels), then one
    token per step with ``past_key_values`` (the recurrent state)."""
    import torch

    from fla.cli.data import IncrementalDecoder

    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt) or [tokenizer.bos_token_id]
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    decoder = IncrementalDecoder()
    out: list[int] = []
    write = write or (lambda s: None)
    x = torch.tensor([ids], device=device)
    cache = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            result = model(input_ids=x, past_key_values=cache, use_cache=True,
                           logits_to_keep=1)
            cache = result.past_key_values
            logits = result.logits[0, -1].float()
            logits[tokenizer.vocab_size:] = float("-inf")   # the padded, never-seen ids
            if temperature <= 0:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k > 0:
                    kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits[logits < kth] = float("-inf")
                probs = torch.softmax(logits, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=gen))
            if token == tokenizer.eos_token_id:
                break
            out.append(token)
            write(decoder.feed(token))
            x = torch.tensor([[token]], device=device)
    write(decoder.flush())
    return out


def run(args) -> int:
    if args.max_new_tokens < 0:
        raise CLIError(f"--max-new-tokens: expected >= 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise CLIError(f"--temperature: expected >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise CLIError(f"--top-k: expected >= 0, got {args.top_k}")
    from fla.cli.data import ByteTokenizer
    from fla.cli.train import find_checkpoint, load_model, quiet_transformers, read_config

    quiet_transformers()
    device = choose_device(args.device)
    ckpt = find_checkpoint(args.checkpoint)
    config = read_config(ckpt)
    tokenizer = ByteTokenizer()
    if config.vocab_size != tokenizer.model_vocab_size:
        raise CLIError(f"{str(ckpt)!r}: vocab_size {config.vocab_size} is not the byte "
                       f"vocabulary of `fla train` ({tokenizer.model_vocab_size}); this "
                       f"command generates with the byte tokenizer only")
    config.fuse_cross_entropy = False
    model = load_model(ckpt, config).to(device).eval()
    if device == "cuda":
        model = model.to(dtype=__import__("torch").bfloat16)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    stream(model, tokenizer, args.prompt, args.max_new_tokens, temperature=args.temperature,
           top_k=args.top_k, seed=args.seed,
           write=lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    sys.stdout.write("\n")
    return 0
