"""Read a Core ML package back (on any OS): its inputs, outputs, states, metadata and MIL ops,
with warnings for what is known to keep work off the Neural Engine; on macOS also where Core ML
plans to run each op (MLComputePlan)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mirror_mlx.draft.coreml_draft import compiled_package, import_coremltools, load_package
from mirror_mlx.draft.coreml_package import MAX_DIM, META

# Ops that run off the Neural Engine, with the reason (APPLE_APIS 2.2, from coremltools' own
# comments, and Core ML's control flow, which the Neural Engine does not execute).
OFF_NE_OPS = {
    "scatter": "scatter falls off the Neural Engine",
    "scatter_nd": "scatter falls off the Neural Engine",
    "scatter_along_axis": "scatter falls off the Neural Engine",
    "while_loop": "control flow runs on the CPU",
    "cond": "control flow runs on the CPU",
}
# Ops whose fp32 outputs are expected: the casts at the model's inputs and outputs.
FP32_OK = {"cast"}


@dataclass
class Report:
    path: str
    inputs: list[tuple[str, str, list[tuple[int, ...]]]] = field(default_factory=list)
    outputs: list[tuple[str, str]] = field(default_factory=list)
    states: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    ops: Counter = field(default_factory=Counter)  # non-const MIL op types
    warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"package: {self.path}", "inputs:"]
        for name, dtype, shapes in self.inputs:
            shown = " | ".join("x".join(map(str, s)) for s in shapes)
            out.append(f"  {name:<10} {dtype:<8} {shown}")
        out.append("outputs:")
        out += [f"  {name:<10} {dtype}" for name, dtype in self.outputs]
        out.append("states:")
        out += [f"  {name:<10} {dtype:<8} {'x'.join(map(str, shape))}"
                for name, dtype, shape in self.states]
        out.append("metadata:")
        for key, value in sorted(self.metadata.items()):
            if key != META + "draft_config":
                out.append(f"  {key.removeprefix(META)}: {value}")
        out.append(f"ops ({sum(self.ops.values())} non-const):")
        out += [f"  {n:>5}  {op}" for op, n in self.ops.most_common()]
        out += [f"warning: {w}" for w in self.warnings] or ["warnings: none"]
        return out


def _array_dtype(ct, value: int) -> str:
    return ct.proto.FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(value)


def _walk(block):
    for op in block.operations:
        yield op
        for inner in op.blocks:
            yield from _walk(inner)


def inspect_package(package: str | Path) -> Report:
    ct = import_coremltools()
    spec = load_package(package)
    desc = spec.description
    report = Report(str(package), metadata=dict(desc.metadata.userDefined))
    for feature in desc.input:
        t = feature.type.multiArrayType
        shapes = [tuple(s.shape) for s in t.enumeratedShapes.shapes] or [tuple(t.shape)]
        report.inputs.append((feature.name, _array_dtype(ct, t.dataType),
                              shapes))
        if t.WhichOneof("ShapeFlexibility") == "shapeRange":
            report.warnings.append(f"input {feature.name} has a range shape: flexible shapes "
                                   "keep a model off the Neural Engine; enumerate them")
    for feature in desc.output:
        t = feature.type.multiArrayType
        report.outputs.append((feature.name, _array_dtype(ct, t.dataType)))
    for feature in desc.state:
        t = feature.type.stateType.arrayType
        report.states.append((feature.name, _array_dtype(ct, t.dataType),
                              tuple(t.shape)))
        if _array_dtype(ct, t.dataType) != "FLOAT16":
            report.warnings.append(f"state {feature.name} is not fp16")
    if len(desc.state) > 2:
        report.warnings.append(f"{len(desc.state)} states: more than 2 per model failed at "
                               "predict on the Neural Engine (third-party report)")
    if spec.WhichOneof("Type") != "mlProgram":
        report.warnings.append("not an ML program: the Neural Engine path needs mlprogram")
        return report
    for fname, function in spec.mlProgram.functions.items():
        block = function.block_specializations[function.opset]
        for op in _walk(block):
            if op.type == "const":
                continue
            report.ops[op.type] += 1
            if op.type in OFF_NE_OPS:
                report.warnings.append(f"{fname}: {op.type} ({OFF_NE_OPS[op.type]})")
            for out in op.outputs:
                tensor = out.type.tensorType
                dtype = ct.proto.MIL_pb2.DataType.Name(tensor.dataType)
                if dtype == "FLOAT32" and op.type not in FP32_OK:
                    report.warnings.append(f"{fname}: {op.type} computes in fp32 (the Neural "
                                           "Engine computes fp16 only)")
                big = [d.constant.size for d in tensor.dimensions
                       if d.WhichOneof("dimension") == "constant" and d.constant.size > MAX_DIM]
                if big:
                    report.warnings.append(f"{fname}: {op.type} makes a tensor with a "
                                           f"dimension of {big[0]} (> {MAX_DIM})")
    if report.metadata.get(META + "compress") == "palettize4":
        report.warnings.append("4-bit palettized stateful packages built with coremltools 9.0 "
                               "crashed on the Neural Engine after ~100-200 predictions "
                               "(coremltools #2716); prefer palettize6 or int8")
    return report


def inspect_command(package: str) -> list[str]:
    """`mirror-mlx inspect`: the report, and on macOS the planned placement."""
    from mirror_mlx.platform import coreml_status

    can_run, why = coreml_status()
    lines = inspect_package(package).lines()
    return lines + (placement(package).lines() if can_run else [f"placement: not checked ({why})"])


@dataclass
class Placement:
    """Where Core ML plans to run a package's ops (MLComputePlan, macOS 14.4+)."""

    ops: Counter  # device -> non-const ops
    cost: dict[str, float]  # device -> share of the estimated cost
    off_ne: list[tuple[str, str]]  # (op, device) for non-const ops not on the Neural Engine

    def lines(self) -> list[str]:
        out = ["placement (MLComputePlan, CPU_AND_NE):"]
        out += [f"  {dev}: {n} ops, {100 * self.cost.get(dev, 0):.1f}% of the estimated cost"
                for dev, n in self.ops.most_common()]
        out += [f"  off the Neural Engine: {op} on {dev}" for op, dev in self.off_ne]
        return out


def placement(package: str | Path) -> Placement:
    """Ask Core ML where each op runs; needs macOS (see mirror_mlx.platform.coreml_status)."""

    import coremltools as ct
    from coremltools.models.compute_device import MLNeuralEngineComputeDevice
    from coremltools.models.compute_plan import MLComputePlan

    compiled = compiled_package(Path(package))
    plan = MLComputePlan.load_from_path(str(compiled), compute_units=ct.ComputeUnit.CPU_AND_NE)
    ops, cost, off = Counter(), Counter(), []
    for function in plan.model_structure.program.functions.values():
        for op in _walk(function.block):
            usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
            if usage is None:  # consts
                continue
            device = usage.preferred_compute_device
            name = ("NE" if isinstance(device, MLNeuralEngineComputeDevice)
                    else type(device).__name__.removeprefix("ML").removesuffix("ComputeDevice"))
            ops[name] += 1
            estimate = plan.get_estimated_cost_for_mlprogram_operation(op)
            cost[name] += estimate.weight if estimate is not None else 0.0
            if name != "NE":
                off.append((op.operator_name, name))
    total = sum(cost.values()) or 1.0
    return Placement(ops, {d: c / total for d, c in cost.items()}, off)
