"""`mirror-mlx`: argument parsing; each subcommand calls one function of the package."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import MirrorError


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="target: a .gguf file, an mlx-lm folder, a Hugging Face repo id, "
                        "or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto",
                   help="auto (float32 on the CPU, quantized as stored on a GPU), float32, "
                        "float16, bfloat16 or quantized")
    p.add_argument("--context", type=int, default=None,
                   help="KV cache length in tokens (default: the model's context)")


def _decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="ar", choices=("ar", "sd", "mirror"),
                   help="ar: target only; sd: vanilla speculative; mirror: Mirror-SD")
    p.add_argument("--draft", default=None,
                   help="draft: a distilled draft folder, a llama model spec, 'self:N' (the "
                        "target's first N layers) or 'default'")
    p.add_argument("--gamma", type=int, default=5, help="drafted tokens per step")
    p.add_argument("--kappa", type=int, default=8, help="early-exit top-k per position")
    p.add_argument("--exit-layer", type=int, default=None,
                   help="layer whose output feeds the early exit (default: the exit head's, "
                        "else 5/6 of the depth)")
    p.add_argument("--exit-head", default=None,
                   help="trained exit head file, 'none' (raw logit lens) or 'default'")
    p.add_argument("--branch-budget", type=int, default=4,
                   help="branches rolled out beside the target's suffix per step")
    p.add_argument("--branch-source", default="union", choices=("exit", "draft", "union"),
                   help="where branch tokens come from")


def _generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text appears (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mirror-mlx",
        description="Lossless speculative decoding (Mirror-SD) with MLX and Core ML.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate a reply to one prompt")
    _model_args(p)
    _decoding_args(p)
    _generation_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", default=None, help="system message (with the chat template)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="feed the prompt as raw text")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object: {"text", "token_ids", "stats"}')

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    _model_args(p)
    _decoding_args(p)
    _generation_args(p)
    p.add_argument("--system", default=None, help="system message")

    sub.add_parser("doctor", help="show the platform, MLX device, BLAS, Core ML and cache")

    p = sub.add_parser("download", help="fetch a model into the cache (default: the default model)")
    p.add_argument("--model", default=None)
    return parser


def _sampling(args):
    from .decode.sampling import SamplingParams

    return SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, seed=args.seed)


def _engine(args, quiet: bool = False):
    from .api import Engine

    return Engine(args.model, mode=args.mode, draft=args.draft, dtype=args.dtype,
                  context=args.context, gamma=args.gamma, kappa=args.kappa,
                  exit_layer=args.exit_layer, exit_head=args.exit_head,
                  branch_budget=args.branch_budget, branch_source=args.branch_source,
                  quiet=quiet)


def cmd_generate(args) -> None:
    sampling = _sampling(args)
    with _engine(args, quiet=args.json) as engine:
        _print_generation(engine, args, sampling)


def _print_generation(engine, args, sampling) -> None:
    if args.no_chat_template:
        prompt = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt.append({"role": "user", "content": args.prompt})
    stream = engine.stream(prompt, max_tokens=args.max_tokens, sampling=sampling,
                           stop=args.stop, chat_template=not args.no_chat_template)
    if args.json:
        text, ids, stats = [], [], None
        for chunk in stream:
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            stats = chunk.stats or stats
        print(json.dumps({"text": "".join(text), "token_ids": ids, "stats": stats.to_dict()}))
        return
    stats = None
    for chunk in stream:
        print(chunk.text, end="", flush=True)
        stats = chunk.stats or stats
    print()
    print(stats.summary(), file=sys.stderr)


def cmd_chat(args) -> None:
    from .chat import run_chat

    sampling = _sampling(args)
    with _engine(args) as engine:
        run_chat(engine, sampling, args.max_tokens, system=args.system, stop=tuple(args.stop))


def cmd_doctor(args) -> None:
    from .platform import machine_info

    print("\n".join(machine_info().lines()))


def cmd_download(args) -> None:
    from .models.load import load

    model = load(args.model)
    print(model.path)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "doctor": cmd_doctor,
            "download": cmd_download}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except MirrorError as e:
        print(f"mirror-mlx: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
