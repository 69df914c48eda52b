"""The engine's hooks on PyTorch itself: each process-wide mechanism hookpolicy uses, with its one owner.

Takes nothing of a policy; gives subscriptions to optimizer steps (`optimizer_hooks`), module
hooks that copies and saves of a model never carry (`module_hooks`), the loss a script
backpropagates (`loss`), the LR schedulers and GradScalers made (`schedulers`), the one
heap scan (`heap`) and the DDP/FSDP wrappers around a model it finds (`wrappers`); every patch
keeps its own part's faults inside (`contain`). Imports nothing else of the engine.
"""
