"""Stage 3, the engine: installs the hooks a plan needs and runs them during training.

Takes a `Plan`; gives hook handles, step boundaries (optimizer steps, backward passes),
statistics kept on the device and read back once per step, the compiled actions (clip,
scale, alert, skip, halt), and what the read-back hands to the export stage. One step
reads top to bottom in `cycle.py`; `runtime.Attached` is the handle `attach` returns.

Its parts, each importing only those before it (`tests/test_layout.py` checks the order):
`hooks/` (PyTorch's process-wide hooks, one owner each) -> `measure/` (rules compiled,
statistics) -> `execute/` (steps, hook bodies, the step's ledger) -> `decide/` (read-back,
alerts, the ranks' agreement) -> `heal/` (cool-down, rewind) -> `cycle.py`, `runtime.py`.
"""
