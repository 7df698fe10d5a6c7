"""Energy meters behind one interface, and the one place that picks a meter for this machine.

A meter reads cumulative joules per rail ("cpu", "gpu", "ane", "dram") since it was opened; a
window's energy is the difference of two reads. Backends:

- macOS: IOReport (no sudo; CPU, GPU, ANE, DRAM), else powermetrics (needs passwordless sudo);
- elsewhere: Linux RAPL (/sys/class/powercap), where its counters are readable;
- otherwise none, with the reason said plainly.

All of them are model-based estimates or coarse counters: measure long windows (IOReport's
millijoule channels may publish only every ~2 s), subtract an idle baseline measured the same way,
and report joules per token.
"""
