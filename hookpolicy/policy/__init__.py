"""Stage 1, policy text to typed policy: strict YAML with positions, schema, semantic checks.

Takes YAML files (or text) and gives `model.Policy` objects, or one `PolicyError` listing
every problem with FILE:LINE:COL and JSON path. Nothing in this stage imports torch.
"""
