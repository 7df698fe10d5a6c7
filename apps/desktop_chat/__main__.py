"""`python -m apps.desktop_chat [--model SPEC] [--mode ar|sd|mirror] ...`: open the chat window."""

from __future__ import annotations

import argparse
import sys
import tkinter as tk

import mirror_mlx  # noqa: F401  (first: makes MLX use OpenBLAS where installed)
from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.errors import MirrorError
from mirror_mlx.models.load import load

from .window import MODES, ChatWindow


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m apps.desktop_chat",
                                description="A small chat window around the mirror-mlx engine.")
    p.add_argument("--model", default=None, help="target spec (default: the default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context", type=int, default=None, help="KV cache length in tokens")
    p.add_argument("--mode", default=None, choices=tuple(MODES),
                   help="the starting mode (default: Mirror-SD, or AR where no draft can serve "
                        "the target)")
    p.add_argument("--draft", default=None, help="draft spec for SD and Mirror-SD")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy")
    p.add_argument("--system", default=None, help="system message")
    args = p.parse_args(argv)
    try:
        sampling = SamplingParams(temperature=args.temp)
        root = tk.Tk()  # first: without a display there is no point loading the model
        target = load(args.model, dtype=args.dtype)
        ChatWindow(root, target, mode=args.mode, max_tokens=args.max_tokens, sampling=sampling,
                   system=args.system, draft=args.draft, context=args.context)
        root.mainloop()
    except MirrorError as e:
        print(f"desktop_chat: error: {e}", file=sys.stderr)
        return 1
    except tk.TclError as e:  # typically: no display to open the window on
        print(f"desktop_chat: cannot open a window: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
