"""Stage 1, policy text to typed policy: strict YAML with positions, schema, semantic checks.

Takes YAML files (or text) and gives `model.Policy` objects, or one `PolicyError` listing
every problem with FILE:LINE:COL and JSON path. Inside, the flow is one way: `loader` reads
a file into a `document.Document`, `build` checks it (`schema`, then `checks` with `patterns`,
`expr` and `messages`) and builds the `model.Policy`, and `sources` finds and loads several files and folders with
both. Nothing in this stage imports torch or any later stage.
"""
