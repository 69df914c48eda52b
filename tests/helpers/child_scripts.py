"""Code shared by the scripts that tests run as real child processes."""

#: Reports, at the child's exit, how many hooks are left on its model and in torch's
#: process-wide hook dicts. Registered before torch is imported, so it runs after
#: hookpolicy's own exit handler. Needs `REPORT` (a path) set, and the script to put
#: its model in `state["model"]`.
HOOK_REPORT = """\
state = {}


def report():
    # Registered before torch is imported, so it runs after hookpolicy's own exit handler.
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_hooks
    model = state["model"]
    counts = {
        "model": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                     for m in model.modules()),
        "global_forward_pre": len(module_hooks._global_forward_pre_hooks),
        "global_optimizer_pre": len(optimizer_hooks._global_optimizer_pre_hooks),
        "global_optimizer_post": len(optimizer_hooks._global_optimizer_post_hooks),
    }
    with open(REPORT, "w") as out:
        json.dump(counts, out)


atexit.register(report)

import torch  # noqa: E402
"""
