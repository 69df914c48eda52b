"""The engine's measuring: a rule compiled to a program, and statistics computed without host syncs.

Takes a plan's rules; gives each rule's state (`rulestate`) and compiled program (`actions`:
statistics passes, clips, scales), device-side partials finished on the host (`stats`), the
same for sharded tensors (`distributed`), and the past values history functions read
(`history`). Imports only `hooks` of the engine.
"""
