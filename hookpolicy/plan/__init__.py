"""Stage 2, the plan: a pure function of typed policies and a model.

Takes `Policy` objects and an `nn.Module`; gives a `Plan`, the bindings of rule to module,
hook point, target and actions, with warnings for rules that bind nothing. Installs nothing.
"""
