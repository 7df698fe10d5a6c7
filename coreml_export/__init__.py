"""Export of drafts to Core ML for the Neural Engine (needs the `export` extra: torch, coremltools).

ane_model.py  the draft in PyTorch, laid out for the Neural Engine
convert.py    PyTorch -> mlprogram package, compression, metadata
inspect.py    read a package back: inputs, outputs, states, ops, warnings, placement (macOS)
reference.py  runs ane_model under the package's exact input/output/state contract (Linux tests)
"""
