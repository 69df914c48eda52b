"""The edge that runs an unmodified script under policies: `hookpolicy apply`.

`launch` is the parent (validates, starts COMMAND, forwards signals, reports halts);
`_bootstrap/sitecustomize.py` brings each Python process of COMMAND to `child.bootstrap`
once it imports torch; `discovery` finds the models the script trains and attaches the
policies to them; `reload` re-reads the policies and swaps them in between steps. What
`apply` tells its children travels in the environment (`hookpolicy.environment`).
"""
