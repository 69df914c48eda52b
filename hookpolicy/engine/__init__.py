"""Stage 3, the engine: installs the hooks a plan needs and runs them during training.

Takes a `Plan`; gives hook handles, step boundaries (optimizer steps, backward passes),
statistics kept on the device and read back once per step, the compiled actions (clip,
scale, alert, skip, halt), and what the read-back hands to the export stage. One step
reads top to bottom in `cycle.py`; `runtime.Attached` is the handle `attach` returns.
"""
