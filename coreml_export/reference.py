"""A stand-in for Core ML where it cannot run: the same PyTorch module the package is converted
from, behind the same runtime interface (`make_state`, `predict`, and a state with
`read_state` / `write_state`) and held to the same rules as coremltools 9.0 on macOS:

- inputs must be exactly the contract's names, float32 or int32 (Core ML rejects int64 and
  float16 numpy at the binding: APPLE_APIS 1.4), with one of the enumerated shapes, the same
  index for every input;
- an input's memory must not be given to predict again within INPUT_HOLD_S seconds (Core ML
  may still hold it from the earlier call: APPLE_APIS fact 2);
- states are fp16; read_state returns a float32 copy, write_state takes float32 (a float16
  array raises, as in coremltools);
- outputs come back as new float32 arrays.

So the Core ML backend's bookkeeping (padding, chunking, masks, positions, slot moves) runs on
Linux exactly as it will against a package.
"""

from __future__ import annotations

import time
from pathlib import Path

from mirror_mlx.draft.coreml_draft import read_package_spec
from mirror_mlx.draft.coreml_package import (
    INPUT_HOLD_S,
    STATES,
    PackageSpec,
    weights_sha256,
)
from mirror_mlx.errors import ModelLoadError

import numpy as np
import torch

from .ane_model import ANEDraft


class ReferenceState:
    def __init__(self, spec: PackageSpec, dtype: torch.dtype = torch.float16):
        self.tensors = {name: torch.zeros(spec.state_shape(name), dtype=dtype)
                        for name in STATES}

    def read_state(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise RuntimeError(f"no state named {name}")
        return self.tensors[name].numpy().astype(np.float32)

    def write_state(self, name: str, value: np.ndarray) -> None:
        if name not in self.tensors:
            raise RuntimeError(f"no state named {name}")
        if not isinstance(value, np.ndarray) or value.dtype not in (np.float32, np.float64):
            raise RuntimeError("value type not convertible")
        if value.shape != tuple(self.tensors[name].shape):
            raise RuntimeError(f"state {name} has shape {tuple(self.tensors[name].shape)}")
        self.tensors[name].copy_(torch.from_numpy(value.astype(np.float32)))


class ReferenceModel:
    """`state_dtype` float32 (tests only) keeps the KV cache unrounded: the module then computes
    what the MLX draft does up to float32 rounding, which isolates the layout's math from the
    package's fp16 cache."""

    def __init__(self, spec: PackageSpec, weights: dict[str, np.ndarray],
                 state_dtype: torch.dtype = torch.float16):
        self.spec, self.state_dtype = spec, state_dtype
        self.module = ANEDraft(spec, weights)
        # A call is hundreds of tiny ops: torch's intra-op threads only add overhead there, and
        # contend with MLX's. (Process-wide; the reference is for tests and Linux checks.)
        torch.set_num_threads(1)
        self._given: dict[int, float] = {}  # input memory address -> when predict was given it

    @staticmethod
    def for_package(package: str | Path, weights: dict[str, np.ndarray]) -> ReferenceModel:
        """The reference for a package, given the draft weights it was exported from."""
        spec = read_package_spec(package)
        if weights_sha256(weights) != spec.weights_sha256:
            raise ModelLoadError(f"{package} was not exported from these weights")
        return ReferenceModel(spec, weights)

    def make_state(self) -> ReferenceState:
        return ReferenceState(self.spec, self.state_dtype)

    def predict(self, inputs: dict[str, np.ndarray], state: ReferenceState) \
            -> dict[str, np.ndarray]:
        self._check(inputs)
        for name, tensor in state.tensors.items():
            setattr(self.module, name, tensor)  # the module writes the state in place
        with torch.no_grad():
            outputs = self.module(*(torch.from_numpy(inputs[name])
                                    for name in self.spec.inputs))
        return {name: out.numpy().astype(np.float32)
                for name, out in zip(self.spec.outputs, outputs)}

    def close(self) -> None:
        """Nothing to release: the module is freed with the object."""

    def _check(self, inputs: dict[str, np.ndarray]) -> None:
        if set(inputs) != set(self.spec.inputs):
            raise RuntimeError(f"inputs {sorted(inputs)} are not the model's "
                               f"{sorted(self.spec.inputs)}")
        for name, value in inputs.items():
            want = self.spec.input_dtype(name)
            if not isinstance(value, np.ndarray) or value.dtype != want:
                raise RuntimeError(f"Error: value type not convertible ({name}: "
                                   f"{getattr(value, 'dtype', type(value))}, want {want})")
        s = inputs["embeds"].shape[-1]
        if s not in self.spec.query_sizes:
            raise RuntimeError(f"query length {s} is not one of {self.spec.query_sizes}")
        for name, value in inputs.items():
            if value.shape != self.spec.input_shape(name, s):
                raise RuntimeError(f"input {name} has shape {value.shape}, "
                                   f"want {self.spec.input_shape(name, s)}")
        now = time.perf_counter()
        self._given = {a: t for a, t in self._given.items() if now - t < INPUT_HOLD_S}
        for name, value in inputs.items():
            address = value.__array_interface__["data"][0]
            if address in self._given:
                raise RuntimeError(f"input {name}: its memory was given to predict "
                                   f"{now - self._given[address]:.3f} s ago and Core ML may "
                                   f"still hold it (keep inputs untouched {INPUT_HOLD_S:g} s)")
        self._given.update((v.__array_interface__["data"][0], now) for v in inputs.values())
