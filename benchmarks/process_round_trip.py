"""What running the Core ML package in a process of its own adds to each predict.

The child here runs a model that answers at once with outputs of the package's shapes (the
shipped draft's, exported at --context), so what is timed is the round trip alone: inputs
pickled to the child, outputs back. Printed per query length: the median and 90th percentile
of `--calls` calls, and the bytes each way.

    python benchmarks/process_round_trip.py [--draft default] [--context 512] [--calls 500]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import mirror_mlx  # noqa: F401  (before mlx: OpenBLAS)
from mirror_mlx.draft.coreml_package import FEATURE_OUTPUTS, head_chunks
from mirror_mlx.draft.coreml_process import ProcessRuntime
from mirror_mlx.draft.load import load_draft
from mirror_mlx.models.load import load

import numpy as np

from coreml_export.convert import package_spec


class Echo:
    """A model whose predict returns zeros of the package's output shapes at once."""

    def __init__(self, outputs: dict[int, dict[str, tuple[int, ...]]]):
        self.outputs = {s: {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
                        for s, shapes in outputs.items()}

    def make_state(self) -> None:
        return None

    def predict(self, inputs: dict[str, np.ndarray], state) -> dict[str, np.ndarray]:
        return self.outputs[inputs["embeds"].shape[-1]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="default")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args()
    target = load("default")
    spec, _ = package_spec(load_draft(args.draft, target), args.context, 8)
    c = spec.config
    shapes = {}
    for s in spec.query_sizes:
        shapes[s] = {f"logits_{i}": (1, n, 1, s) for i, n in enumerate(head_chunks(c.head_size))}
        if spec.reads_features:
            shapes[s].update({name: (1, c.hidden_size, 1, s) for name in FEATURE_OUTPUTS})
    # By module name, not __main__, so that the child process can import the class.
    from process_round_trip import Echo as Named

    runtime = ProcessRuntime(partial(Named, shapes))
    state = runtime.make_state()
    print(f"{args.draft} draft, context {args.context}: {args.calls} calls per query length")
    print("query  in (KB)  out (KB)  median (ms)  p90 (ms)")
    for s in spec.query_sizes:
        inputs = {n: np.zeros(spec.input_shape(n, s), spec.input_dtype(n)) for n in spec.inputs}
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            out = runtime.predict(inputs, state)
            times.append(time.perf_counter() - start)
        kb_in = sum(v.nbytes for v in inputs.values()) / 1024
        kb_out = sum(v.nbytes for v in out.values()) / 1024
        print(f"{s:5d}  {kb_in:7.1f}  {kb_out:8.1f}  {1e3 * np.median(times):11.3f}  "
              f"{1e3 * np.percentile(times, 90):8.3f}")
    runtime.close()


if __name__ == "__main__":
    main()
