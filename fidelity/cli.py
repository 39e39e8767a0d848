"""The ``fidelity`` command line. Bad inputs end in one clear line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fidelity import __version__
from fidelity.config import ConfigError, ModelConfig

EXAMPLES = """examples:
  fidelity                                   oracle on the embedded tiny checkpoint, 1024-token prompt
  fidelity oracle --prompt-len 4096 --decode 32 --dtype fp64
  fidelity synth --preset tiny --seed 1 --out ckpt/ --layout deepseek
  fidelity oracle --checkpoint ckpt/         any checkpoint: deepseek, official or transformers layout
  fidelity inspect ckpt/                     validate a checkpoint and list what it holds
  fidelity config --preset flash --spelling hf
"""

SYNTH_LIMIT_BYTES = 4 << 30


class UsageError(Exception):
    """A user error reported as one line, exit code 2."""


def _load(args) -> tuple[object, str]:
    from fidelity.checkpoint import load_checkpoint
    from fidelity.synthesize import synthesize

    if args.checkpoint:
        return load_checkpoint(args.checkpoint), f"checkpoint {args.checkpoint}"
    cfg = ModelConfig.preset(args.preset)
    _check_synth_size(cfg, args.preset)
    return synthesize(cfg, seed=args.seed), f"preset '{args.preset}' (synthetic, seed {args.seed})"


def _check_synth_size(cfg: ModelConfig, name: str) -> None:
    from fidelity.checkpoint import expected_tensors

    n = sum(int(torch.Size(spec.shape).numel()) for spec in expected_tensors(cfg).values())
    if 4 * n > SYNTH_LIMIT_BYTES:
        raise UsageError(f"preset '{name}' has {n / 1e9:.1f}e9 parameters ({4 * n / 2**30:.0f} GiB in fp32): "
                         "synthesize only width-reduced configs (e.g. --preset tiny) on a CPU")


def cmd_oracle(args) -> int:
    from fidelity.oracle_run import default_prompt, format_summary, run_oracle

    ckpt, what = _load(args)
    cfg = ckpt.config
    if args.prompt_file:
        prompt = _read_prompt(args.prompt_file, cfg.vocab_size)
    else:
        if args.prompt_len < 1:
            raise UsageError(f"--prompt-len: expected >= 1, found {args.prompt_len}")
        prompt = default_prompt(cfg.vocab_size, args.prompt_len, args.seed)
    if args.decode < 0:
        raise UsageError(f"--decode: expected >= 0, found {args.decode}")
    dtype = {"fp32": torch.float32, "fp64": torch.float64}[args.dtype]

    def progress(k: int, n: int) -> None:
        if sys.stderr.isatty():
            print(f"\rdecode {k}/{n}", end="" if k < n else "\n", file=sys.stderr, flush=True)

    summary = run_oracle(ckpt, prompt, args.decode, dtype, progress)
    print(format_summary(summary, f"dsv4-fidelity {__version__}: oracle on {what}"))
    return 0


def _read_prompt(path: str, vocab: int) -> torch.Tensor:
    """A prompt file holds token ids separated by whitespace or commas (or a JSON list)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise UsageError(f"--prompt-file: cannot read {path}: {err.strerror}") from None
    try:
        ids = [int(t) for t in text.replace(",", " ").replace("[", " ").replace("]", " ").split()]
    except ValueError:
        raise UsageError(f"--prompt-file {path}: expected integer token ids, found non-integer text") from None
    if not ids:
        raise UsageError(f"--prompt-file {path}: expected at least one token id, found none")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise UsageError(f"--prompt-file {path}: expected token ids in [0, {vocab}), found {bad[:5]}")
    return torch.tensor(ids, dtype=torch.long)


def cmd_synth(args) -> int:
    from fidelity.checkpoint import save_checkpoint
    from fidelity.synthesize import synthesize

    cfg = ModelConfig.preset(args.preset)
    _check_synth_size(cfg, args.preset)
    save_checkpoint(synthesize(cfg, seed=args.seed), args.out, layout=args.layout, overwrite=args.overwrite)
    print(f"wrote {args.layout} checkpoint of preset '{args.preset}' (seed {args.seed}) to {args.out}")
    return 0


def cmd_inspect(args) -> int:
    from fidelity.checkpoint import load_checkpoint

    ckpt = load_checkpoint(args.checkpoint)
    cfg = ckpt.config
    formats: dict[str, int] = {}
    for name in ckpt.names():
        fmt = ckpt.stored(name).fmt
        formats[fmt] = formats.get(fmt, 0) + 1
    print(f"{args.checkpoint}: layout {ckpt.layout}, {len(ckpt.names())} tensors "
          + ", ".join(f"{k} {v}" for k, v in sorted(formats.items())))
    print(f"layers {cfg.n_layers}: " + " ".join(cfg.layer_kinds) + f"; hash layers {cfg.n_hash_layers}")
    print(f"dim {cfg.dim}, heads {cfg.n_heads}x{cfg.head_dim}, experts {cfg.n_routed_experts} top-"
          f"{cfg.n_activated_experts}, vocab {cfg.vocab_size}")
    if ckpt.ignored:
        print(f"ignored {len(ckpt.ignored)} tensor(s) (e.g. MTP): {ckpt.ignored[:3]}")
    return 0


def cmd_config(args) -> int:
    cfg = ModelConfig.from_file(args.file) if args.file else ModelConfig.preset(args.preset)
    d = cfg.to_hf_dict() if args.spelling == "hf" else cfg.to_official_dict()
    print(json.dumps(d, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fidelity", description="Differential testing of DeepSeek-V4 decoders.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"dsv4-fidelity {__version__}")
    sub = p.add_subparsers(dest="command")

    o = sub.add_parser("oracle", help="run the FP32/FP64 oracle and summarise it per layer",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = o.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="checkpoint directory (config.json + *.safetensors)")
    src.add_argument("--preset", default="tiny", help="synthesize this preset instead (default: tiny)")
    o.add_argument("--seed", type=int, default=0, help="synthetic weights and default prompt seed")
    o.add_argument("--prompt-len", type=int, default=1024)
    o.add_argument("--prompt-file", help="token ids (whitespace/comma separated) instead of a random prompt")
    o.add_argument("--decode", type=int, default=16, help="greedy decode steps after the prompt")
    o.add_argument("--dtype", choices=("fp32", "fp64"), default="fp32")
    o.set_defaults(func=cmd_oracle)

    s = sub.add_parser("synth", help="write a deterministic synthetic checkpoint")
    s.add_argument("--preset", default="tiny")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True)
    s.add_argument("--layout", choices=("deepseek", "official", "transformers"), default="deepseek")
    s.add_argument("--overwrite", action="store_true")
    s.set_defaults(func=cmd_synth)

    i = sub.add_parser("inspect", help="validate a checkpoint and summarise it")
    i.add_argument("checkpoint")
    i.set_defaults(func=cmd_inspect)

    c = sub.add_parser("config", help="print a preset's or a file's config in either spelling")
    c.add_argument("--preset", default="tiny")
    c.add_argument("--file", help="config.json to parse instead of a preset")
    c.add_argument("--spelling", choices=("official", "hf"), default="official")
    c.set_defaults(func=cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    from fidelity.checkpoint import CheckpointError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["oracle", *(argv or [])])
    try:
        return args.func(args)
    except (UsageError, ConfigError, CheckpointError) as err:
        print(f"fidelity: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
