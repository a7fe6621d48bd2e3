"""The command line behind ``python -m fla`` (and the ``fla`` console script).

One module per subcommand: :mod:`.train`, :mod:`.generate`, :mod:`.bench`; with
:mod:`.data` (corpus, byte tokenizer, sampler), :mod:`.models` (name -> config),
:mod:`.distributed` (torchrun + FSDP2) and :mod:`.plot` (PNG figures). Each subcommand
module has ``add_parser(subparsers)`` and ``run(args) -> exit code``.

A :class:`CLIError` raised anywhere below ``run`` is a usage error: ``fla.__main__``
prints it argparse-style (``python -m fla train: error: ...``) and exits with code 2,
without a traceback.
"""
from __future__ import annotations


class CLIError(Exception):
    """A usage error (bad option, missing checkpoint, ...): printed, exit code 2."""


def choose_device(requested: str) -> str:
    """'cuda' or 'cpu' for ``--device auto|cpu|cuda``; CLIError for cuda without CUDA."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device is available on this machine "
                       "(torch.cuda.is_available() is False); use --device cpu")
    return requested
